#include "worker/executor/executor.h"

#include "absl/strings/str_cat.h"
#include "worker/kv/context_parallel_layout.h"

namespace kvgrid::worker {

absl::Status LocalizeBlockCopies(BlockCopyKind kind, std::span<const BlockCopy> copies,
                                 int32_t cp_size, int32_t cp_rank, int32_t blocks_per_rank,
                                 int32_t swap_blocks_per_rank, std::vector<BlockCopy>* local) {
  local->clear();
  if (kind != BlockCopyKind::kDeviceToDevice && swap_blocks_per_rank <= 0) {
    return absl::FailedPreconditionError("block copy: a swap without a swap space");
  }
  const ContextParallelLayout layout{.cp_size = cp_size,
                                     .blocks_per_rank = blocks_per_rank,
                                     .swap_slots_per_rank = swap_blocks_per_rank};
  const int64_t blocks = int64_t{cp_size} * blocks_per_rank;
  const int64_t slots = int64_t{cp_size} * swap_blocks_per_rank;
  const bool src_swap = kind == BlockCopyKind::kSwapToDevice;
  const bool dst_swap = kind == BlockCopyKind::kDeviceToSwap;
  for (const BlockCopy& c : copies) {
    if (c.src < 0 || c.src >= (src_swap ? slots : blocks) || c.dst < 0 ||
        c.dst >= (dst_swap ? slots : blocks)) {
      local->clear();
      return absl::InvalidArgumentError(absl::StrCat(
          "block copy ", c.src, " -> ", c.dst, " is outside the context-parallel group"));
    }
    const int32_t src_rank = src_swap ? layout.RankOfSlot(c.src) : layout.RankOfBlock(c.src);
    const int32_t dst_rank = dst_swap ? layout.RankOfSlot(c.dst) : layout.RankOfBlock(c.dst);
    if (src_rank != dst_rank) {
      local->clear();
      return absl::InvalidArgumentError(absl::StrCat("block copy ", c.src, " -> ", c.dst,
                                                     " crosses context-parallel ranks ",
                                                     src_rank, " and ", dst_rank));
    }
    if (src_rank != cp_rank) continue;
    local->push_back({src_swap ? layout.LocalSwapSlot(c.src, cp_rank)
                               : layout.LocalBlock(c.src, cp_rank),
                      dst_swap ? layout.LocalSwapSlot(c.dst, cp_rank)
                               : layout.LocalBlock(c.dst, cp_rank)});
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
