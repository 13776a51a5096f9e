// Where the blocks of a context-parallel group live. A group of `cp_size` ranks holding the
// same KV heads splits every sequence's blocks between their pools: table position `i` of a
// sequence lives on rank `i % cp_size`, so where a block is follows from its position alone
// and nothing ever moves between ranks (a copy-on-write copy or a swap stays on its rank).
//
// The leader's BlockManager hands out group-wide ids: rank `r`'s pool blocks are
// [r * blocks_per_rank, (r + 1) * blocks_per_rank), and its host swap slots likewise. Each
// rank turns the plan's group-wide tables, slots and copies into its own pool's ids with the
// methods below; what lives elsewhere becomes -1 (not read, not written). With cp_size 1
// every id is its own local id. Plain values; thread-compatible.
#ifndef KVGRID_WORKER_KV_CONTEXT_PARALLEL_LAYOUT_H_
#define KVGRID_WORKER_KV_CONTEXT_PARALLEL_LAYOUT_H_

#include <cstdint>
#include <span>
#include <vector>

namespace kvgrid::worker {

struct ContextParallelLayout {
  int32_t cp_size = 1;
  int32_t blocks_per_rank = 0;      // each rank's pool
  int32_t swap_slots_per_rank = 0;  // each rank's host swap space

  // The rank that holds table position `index` of every sequence.
  [[nodiscard]] int32_t RankOfPosition(int64_t index) const {
    return static_cast<int32_t>(index % cp_size);
  }
  // The rank of group-wide block id `block` (>= 0) and its id in that rank's pool.
  [[nodiscard]] int32_t RankOfBlock(int32_t block) const { return block / blocks_per_rank; }
  [[nodiscard]] int32_t RankOfSlot(int32_t slot) const { return slot / swap_slots_per_rank; }

  // `block` in `rank`'s pool, or -1 where it lives on another rank (or is -1 already).
  [[nodiscard]] int32_t LocalBlock(int32_t block, int32_t rank) const {
    if (block < 0 || RankOfBlock(block) != rank) return -1;
    return block - rank * blocks_per_rank;
  }
  [[nodiscard]] int32_t LocalSwapSlot(int32_t slot, int32_t rank) const {
    if (slot < 0 || RankOfSlot(slot) != rank) return -1;
    return slot - rank * swap_slots_per_rank;
  }
  // A KV write slot (block * block_size + offset) in `rank`'s pool, or -1.
  [[nodiscard]] int64_t LocalSlot(int64_t slot, int32_t block_size, int32_t rank) const {
    if (slot < 0) return -1;
    const int32_t local = LocalBlock(static_cast<int32_t>(slot / block_size), rank);
    return local < 0 ? -1 : int64_t{local} * block_size + slot % block_size;
  }
  // A block table with every entry turned into `rank`'s ids (-1 elsewhere).
  void LocalTable(std::span<const int32_t> table, int32_t rank, std::vector<int32_t>* out) const {
    out->resize(table.size());
    for (size_t i = 0; i < table.size(); ++i) (*out)[i] = LocalBlock(table[i], rank);
  }
  // Table positions [begin, end) that `rank` holds.
  [[nodiscard]] int64_t PositionsOnRank(int64_t begin, int64_t end, int32_t rank) const {
    if (end <= begin) return 0;
    const int64_t first = begin + ((rank - begin % cp_size) % cp_size + cp_size) % cp_size;
    return first >= end ? 0 : (end - 1 - first) / cp_size + 1;
  }
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_CONTEXT_PARALLEL_LAYOUT_H_
