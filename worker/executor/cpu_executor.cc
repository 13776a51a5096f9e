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
    const ContextParallelLayout layout{.cp_size = cp.size,
                                       .blocks_per_rank = num_blocks(),
                                       .swap_slots_per_rank = num_swap_blocks()};
    const int64_t blocks = int64_t{cp.size} * num_blocks();
    const int64_t slots = int64_t{cp.size} * num_swap_blocks();
    const bool src_swap = kind == BlockCopyKind::kSwapToDevice;
    const bool dst_swap = kind == BlockCopyKind::kDeviceToSwap;
    local_copies_.clear();
    for (const BlockCopy& c : copies) {
      if (c.src < 0 || c.src >= (src_swap ? slots : blocks) || c.dst < 0 ||
          c.dst >= (dst_swap ? slots : blocks)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block copy ", c.src, " -> ", c.dst, " is outside the context-parallel group"));
      }
      const int32_t src = src_swap ? layout.LocalSwapSlot(c.src, cp.rank)
                                   : layout.LocalBlock(c.src, cp.rank);
      const int32_t dst = dst_swap ? layout.LocalSwapSlot(c.dst, cp.rank)
                                   : layout.LocalBlock(c.dst, cp.rank);
      if ((src < 0) != (dst < 0)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "block copy ", c.src, " -> ", c.dst, " crosses context-parallel ranks"));
      }
      if (src >= 0) local_copies_.push_back({src, dst});
    }
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
