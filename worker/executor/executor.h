// What an engine runs its steps on: one device's model shard, its paged KV pool and the host
// swap space of that pool, behind one interface, so that the engine (scheduling, block
// bookkeeping, sampling) does not depend on the device. CpuExecutor runs LlamaModel on KvPool
// arenas in host memory; CudaExecutor (kvgrid_worker_cuda) runs CudaLlamaModel on a GPU.
#ifndef KVGRID_WORKER_EXECUTOR_EXECUTOR_H_
#define KVGRID_WORKER_EXECUTOR_EXECUTOR_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "model/model_config.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

enum class BlockCopyKind {
  kDeviceToDevice,  // copy-on-write within the pool
  kDeviceToSwap,    // preemption by swap: pool -> swap space
  kSwapToDevice,    // resuming a swapped sequence: swap space -> pool
};

// Not thread-safe: one thread drives an executor (the engine's).
class Executor {
 public:
  virtual ~Executor() = default;

  [[nodiscard]] virtual const model::ModelConfig& config() const = 0;
  [[nodiscard]] virtual const TensorParallel& tensor_parallel() const = 0;
  // This rank's place in a context-parallel group (none by default): batches and copies then
  // carry the group's block ids (worker/kv/context_parallel_layout.h), num_blocks() and
  // num_swap_blocks() stay this rank's.
  [[nodiscard]] virtual ContextParallel context_parallel() const { return {}; }
  // The pool's geometry (this rank's KV heads, block size, dtypes).
  [[nodiscard]] virtual const KvGeometry& kv_geometry() const = 0;
  // Blocks in the device pool and in the swap space (0 when there is none).
  [[nodiscard]] virtual int32_t num_blocks() const = 0;
  [[nodiscard]] virtual int32_t num_swap_blocks() const = 0;

  // Runs `batch` (as LlamaModel::Forward), writing its tokens' K/V into the pool; `logits`
  // receives [batch.logit_rows.size(), vocab] floats in host memory. Errors: INVALID_ARGUMENT
  // for a malformed batch; UNAVAILABLE when a group collective fails; INTERNAL for a device
  // failure (naming the call).
  virtual absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) = 0;

  // For each copy, block `src` overwrites block `dst` (pool or swap ids as `kind` says) in
  // every layer's K and V planes and their metadata; under context parallelism only the
  // copies within this rank's pool and swap space. Errors: INVALID_ARGUMENT for an id
  // outside its space, or a copy between two ranks (nothing copied); FAILED_PRECONDITION for
  // a swap copy without a swap space; INTERNAL for a device failure.
  virtual absl::Status CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) = 0;
};

// A rank's share of a context-parallel group's block copies, whose ids are the group's
// (worker/kv/context_parallel_layout.h): every copy is checked against the whole group (ids
// inside it, source and destination on one rank), so that every rank accepts or refuses the
// same list; then the copies within rank `cp_rank`'s pool and swap space go into `local`, in
// its own ids. Errors: INVALID_ARGUMENT naming the copy (nothing to copy);
// FAILED_PRECONDITION for a swap copy where there is no swap space.
absl::Status LocalizeBlockCopies(BlockCopyKind kind, std::span<const BlockCopy> copies,
                                 int32_t cp_size, int32_t cp_rank, int32_t blocks_per_rank,
                                 int32_t swap_blocks_per_rank, std::vector<BlockCopy>* local);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_EXECUTOR_H_
