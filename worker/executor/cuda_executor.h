// The GPU executor: CudaLlamaModel over a CudaKvPool, with the swap space in pinned host
// memory laid out as the pool (so a swap is one asynchronous copy per block, layer and plane on
// the model's stream, ordered with the forward passes around it).
//
// Pool size: --kv-cache-memory bytes when given, else --gpu-memory-utilization of the card
// after the weights and a step workspace (GpuKvBudget); the step buffers are allocated at
// creation (CudaLlamaModel::ReserveSteps). In a tensor-parallel group every rank's executor
// holds its shard and its heads' pool; the group agrees on the smallest pool, so that every
// rank holds every block the leader's engine hands out.
// Not thread-safe (one engine thread), like the model.
#ifndef KVGRID_WORKER_EXECUTOR_CUDA_EXECUTOR_H_
#define KVGRID_WORKER_EXECUTOR_CUDA_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "worker/executor/cuda_llama_model.h"
#include "worker/executor/cuda_plugin.h"
#include "worker/executor/executor.h"

namespace kvgrid::worker {

// Page-locked host memory (cudaMallocHost / cudaFreeHost), zero-filled. Move-only.
class PinnedBuffer {
 public:
  // Errors: RESOURCE_EXHAUSTED naming cudaMallocHost and the size.
  static absl::StatusOr<PinnedBuffer> Allocate(int64_t bytes);
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  [[nodiscard]] void* get() const { return ptr_; }
  [[nodiscard]] int64_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

class CudaExecutor final : public Executor {
 public:
  using PoolOptions = CudaPoolOptions;

  // Allocates the pool, the swap space and the step buffers for `model` (already on the
  // device). In a group (tp.size > 1) `device_comm` is the one `model` was built with, owned
  // from here on, and tp.comm (not owned) agrees the pool's size with the other ranks, which
  // call Create at the same time. Errors: INVALID_ARGUMENT naming the option (a budget below
  // one block, a utilization that leaves no room); RESOURCE_EXHAUSTED when the device or the
  // host cannot hold them; INTERNAL naming a failed CUDA call; UNAVAILABLE when the group's
  // collective fails.
  // A context-parallel rank (cp.size > 1; model->SetContextParallel done with
  // `cp_device_comm`, owned from here on): cp.comm (host, not owned) agrees the sizes with the
  // other CP ranks as well, so that every rank of the T x C group has the same pool and swap
  // space (a block's rank follows from its id and the pool size); batches and copies then
  // carry the group's ids.
  static absl::StatusOr<std::unique_ptr<CudaExecutor>> Create(
      std::unique_ptr<CudaLlamaModel> model, const PoolOptions& options,
      TensorParallel tp = {}, std::unique_ptr<DeviceCommunicator> device_comm = nullptr,
      ContextParallel cp = {}, std::unique_ptr<DeviceCommunicator> cp_device_comm = nullptr);

  ~CudaExecutor() override;
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  [[nodiscard]] const model::ModelConfig& config() const override { return model_->config(); }
  [[nodiscard]] const TensorParallel& tensor_parallel() const override { return tp_; }
  [[nodiscard]] ContextParallel context_parallel() const override { return cp_; }
  [[nodiscard]] const KvGeometry& kv_geometry() const override { return pool_->geometry(); }
  [[nodiscard]] int32_t num_blocks() const override { return pool_->num_blocks(); }
  [[nodiscard]] int32_t num_swap_blocks() const override { return num_swap_blocks_; }
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override;
  absl::Status CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) override;

  [[nodiscard]] CudaLlamaModel& model() { return *model_; }
  [[nodiscard]] CudaKvPool& pool() { return *pool_; }

 private:
  CudaExecutor(std::unique_ptr<CudaLlamaModel> model, std::unique_ptr<CudaKvPool> pool)
      : model_(std::move(model)), pool_(std::move(pool)) {}

  // What this rank alone would take: pool and swap blocks, and whether it runs graphs (1/0).
  struct LocalSizes {
    int64_t blocks = 0, swap_blocks = 0, graphs = 0;
  };
  static absl::StatusOr<LocalSizes> SizeLocally(const CudaLlamaModel& model,
                                                const PoolOptions& options,
                                                const KvGeometry& geometry);
  // The pool, step buffers and swap space of the agreed sizes.
  static absl::StatusOr<std::unique_ptr<CudaExecutor>> Allocate(
      std::unique_ptr<CudaLlamaModel> model, const PoolOptions& options,
      const KvGeometry& geometry, const LocalSizes& sizes);
  // Bytes of one block in plane `plane` (0: K values, 1: V values, 2: K meta, 3: V meta).
  [[nodiscard]] int64_t PlaneBlockBytes(int plane) const;
  [[nodiscard]] void* DevicePlane(int64_t layer, int plane) const;

  std::unique_ptr<DeviceCommunicator> device_comm_;  // outlives model_, which uses it
  std::unique_ptr<DeviceCommunicator> cp_device_comm_;  // likewise
  std::unique_ptr<CudaLlamaModel> model_;
  std::unique_ptr<CudaKvPool> pool_;
  TensorParallel tp_;
  ContextParallel cp_;
  std::vector<BlockCopy> local_copies_;  // a CP rank's share of a copy list, reused
  int32_t num_swap_blocks_ = 0;
  std::vector<PinnedBuffer> swap_;  // [layer * 4 + plane], laid out as the pool's planes
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_CUDA_EXECUTOR_H_
