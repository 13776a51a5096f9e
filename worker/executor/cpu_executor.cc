#include "worker/executor/cpu_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "worker/kv/kv_block_copy.h"

namespace kvgrid::worker {

absl::StatusOr<std::unique_ptr<CpuExecutor>> CpuExecutor::Create(
    std::unique_ptr<LlamaModel> model, const PoolOptions& options) {
  if (options.swap_space < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--swap-space: must be >= 0, got ", options.swap_space));
  }
  const KvGeometry geometry =
      model->KvGeometryFor(options.block_size, options.k_dtype, options.v_dtype);
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<KvPool> pool,
                          KvPool::Create(geometry, options.kv_cache_memory));
  std::unique_ptr<KvPool> swap;
  if (options.swap_space > 0) {
    KVGRID_ASSIGN_OR_RETURN(swap, KvPool::Create(geometry, options.swap_space));
  }
  return std::unique_ptr<CpuExecutor>(
      new CpuExecutor(std::move(model), std::move(pool), std::move(swap)));
}

absl::Status CpuExecutor::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  return model_->Forward(batch, *pool_, logits);
}

absl::Status CpuExecutor::CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) {
  if (const ContextParallel cp = model_->context_parallel(); cp.size > 1) {
    KVGRID_RETURN_IF_ERROR(LocalizeBlockCopies(kind, copies, cp.size, cp.rank, num_blocks(),
                                               num_swap_blocks(), &local_copies_));
    return CopyLocal(kind, local_copies_);
  }
  return CopyLocal(kind, copies);
}

absl::Status CpuExecutor::CopyLocal(BlockCopyKind kind, std::span<const BlockCopy> copies) {
  if (kind == BlockCopyKind::kDeviceToDevice) return CopyKvBlocks(*pool_, *pool_, copies);
  if (swap_ == nullptr) {
    return absl::FailedPreconditionError("block copy: a swap without a swap space");
  }
  return kind == BlockCopyKind::kDeviceToSwap ? CopyKvBlocks(*pool_, *swap_, copies)
                                              : CopyKvBlocks(*swap_, *pool_, copies);
}

}  // namespace kvgrid::worker
