// Bookkeeping of KV blocks for one pool: a free list and per-sequence block tables.
//
// Holds ids only — no memory, no dtype, no device — so it is tested without a device. A block
// id indexes every layer's K and V arena at once. Not thread-safe: the engine that owns it
// serializes calls. Non-copyable.
#ifndef KVGRID_WORKER_KV_BLOCK_MANAGER_H_
#define KVGRID_WORKER_KV_BLOCK_MANAGER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvgrid::worker {

using SequenceId = uint64_t;

class BlockManager {
 public:
  // `num_blocks` >= 1, `block_size` in {8, 16, 32} (checked by ABSL_RAW_CHECK: a programmer error).
  BlockManager(int32_t num_blocks, int32_t block_size);
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  [[nodiscard]] int32_t num_blocks() const { return num_blocks_; }
  [[nodiscard]] int32_t block_size() const { return block_size_; }
  [[nodiscard]] int32_t num_free_blocks() const { return static_cast<int32_t>(free_.size()); }
  [[nodiscard]] int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }

  // Blocks needed to hold `num_tokens` tokens.
  [[nodiscard]] int64_t BlocksFor(int64_t num_tokens) const;

  [[nodiscard]] bool HasSequence(SequenceId seq) const { return tables_.contains(seq); }

  // Grows (never shrinks) `seq`'s table so it holds `num_tokens` tokens, creating the table on
  // first use. All-or-nothing: RESOURCE_EXHAUSTED with the numbers, and no change, when the
  // free list is too short.
  absl::Status Reserve(SequenceId seq, int64_t num_tokens);

  // Returns every block of `seq` to the free list. Unknown ids are fine (idempotent).
  void Free(SequenceId seq);

  // The block ids of `seq` in token order (empty for unknown ids).
  [[nodiscard]] const std::vector<int32_t>& BlockTable(SequenceId seq) const;

  // Slot of token `position` of `seq`: block_id * block_size + position % block_size.
  // The position must be inside the reserved capacity (ABSL_RAW_CHECK).
  [[nodiscard]] int64_t Slot(SequenceId seq, int64_t position) const;

  // Internal consistency (every block either free or owned by exactly one sequence).
  // INTERNAL describing the first violation; for tests.
  absl::Status CheckInvariants() const;

 private:
  int32_t num_blocks_;
  int32_t block_size_;
  std::vector<int32_t> free_;  // LIFO: recently freed blocks are reused first (warm in cache)
  absl::flat_hash_map<SequenceId, std::vector<int32_t>> tables_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_BLOCK_MANAGER_H_
