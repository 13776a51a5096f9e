// The CPU executor: LlamaModel over a KvPool in host memory, with a second KvPool of the same
// geometry as the swap space (a swap is then a plain block copy between arenas).
#ifndef KVGRID_WORKER_EXECUTOR_CPU_EXECUTOR_H_
#define KVGRID_WORKER_EXECUTOR_CPU_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "worker/executor/executor.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

class CpuExecutor final : public Executor {
 public:
  struct PoolOptions {
    int64_t block_size = 16;
    kernels::KvDType k_dtype = kernels::KvDType::kF32;
    kernels::KvDType v_dtype = kernels::KvDType::kF32;
    int64_t kv_cache_memory = 256ll << 20;  // bytes for the pool
    int64_t swap_space = 0;                 // bytes for the swap space; 0: none
  };

  // Allocates the pool and swap space for `model`. Errors: as KvPool::Create (naming
  // --kv-cache-memory / --swap-space), INVALID_ARGUMENT for a negative swap space.
  static absl::StatusOr<std::unique_ptr<CpuExecutor>> Create(std::unique_ptr<LlamaModel> model,
                                                             const PoolOptions& options);

  [[nodiscard]] const model::ModelConfig& config() const override { return model_->config(); }
  [[nodiscard]] const TensorParallel& tensor_parallel() const override {
    return model_->tensor_parallel();
  }
  [[nodiscard]] ContextParallel context_parallel() const override {
    return model_->context_parallel();
  }
  [[nodiscard]] const KvGeometry& kv_geometry() const override { return pool_->geometry(); }
  [[nodiscard]] int32_t num_blocks() const override { return pool_->num_blocks(); }
  [[nodiscard]] int32_t num_swap_blocks() const override {
    return swap_ ? swap_->num_blocks() : 0;
  }
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override;
  absl::Status CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) override;

  [[nodiscard]] LlamaModel& model() { return *model_; }
  [[nodiscard]] KvPool& pool() { return *pool_; }

 private:
  CpuExecutor(std::unique_ptr<LlamaModel> model, std::unique_ptr<KvPool> pool,
              std::unique_ptr<KvPool> swap)
      : model_(std::move(model)), pool_(std::move(pool)), swap_(std::move(swap)) {}

  // CopyBlocks in this rank's own ids.
  absl::Status CopyLocal(BlockCopyKind kind, std::span<const BlockCopy> copies);

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<KvPool> swap_;  // null without a swap space
  std::vector<BlockCopy> local_copies_;  // context parallelism: this rank's share of a copy
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_CPU_EXECUTOR_H_
