// Bookkeeping of KV blocks for one pool: free list, reference counts, per-sequence block
// tables, a prefix cache of full blocks, copy-on-write, forking, and swapping to a host space.
//
// Holds ids only — no memory, no dtype, no device — so it is tested without a device. A block
// id indexes every layer's K and V arena at once. Operations that need data moved (copy-on-
// write, swap out, swap in) return the copies for the caller to perform on the pools before
// the next forward pass. Not thread-safe: the engine that owns it serializes calls.
//
// Every block is in exactly one state:
//   free      refcount 0, no hash                  (on the free list)
//   cached    refcount 0, hash of its full tokens  (evictable, LRU order; reusable by a hit)
//   used      refcount >= 1                        (in one or more sequence tables)
// Allocation takes a free block first, else evicts the least recently used cached block.
// The prefix cache keys each full block by a chained hash of (previous block's hash, its
// tokens) and stores the tokens too, so a hash collision can never share wrong data.
//
// Sliding-window models (every layer slides, so no query reads a key more than `window`
// positions back): ReleaseBefore gives back a running sequence's blocks that fall wholly
// before the window of its next query, and AllocateWindowed never takes them, so a
// sequence holds about window + one step's tokens however long it runs. A released position
// of a table is a hole, kHole (-1): holes are always a prefix of the table, never written
// (PrepareWrite refuses), never read by the attention kernels (which start at the window), and
// skipped by every other operation (fork, swap, free, prefix-cache registration).
//
// Context parallelism (cp_size C > 1): the manager keeps the C pools of a group whose ranks
// hold the same KV heads, each of `num_blocks` blocks and `num_swap_slots` host slots. Table
// position i of every sequence lives on rank i % C (ContextParallelLayout), ids are group-wide,
// and each rank has its own free list, LRU of cached blocks and swap slots, so every
// capacity check is made per rank and a copy (copy-on-write, swap) never crosses ranks. The
// prefix cache's hash chain runs over the whole sequence, so a hit on one rank's block means
// every earlier block, wherever it lives, matched too.
#ifndef KVGRID_WORKER_KV_BLOCK_MANAGER_H_
#define KVGRID_WORKER_KV_BLOCK_MANAGER_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/kv/context_parallel_layout.h"

namespace kvgrid::worker {

using SequenceId = uint64_t;

// Move the K/V data of one block. For copy-on-write both ids are device blocks; for swap out
// `src` is a device block and `dst` a host slot; for swap in the reverse.
struct BlockCopy {
  int32_t src = -1;
  int32_t dst = -1;
};

struct BlockManagerStats {
  int32_t blocks_total = 0;
  int32_t blocks_free = 0;     // free list only
  int32_t blocks_cached = 0;   // evictable prefix-cache blocks
  int32_t blocks_used = 0;     // referenced by at least one sequence
  int32_t swap_slots_total = 0;
  int32_t swap_slots_used = 0;
  int64_t prefix_query_tokens = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_hit_tokens = 0;    // of which found cached
  int64_t cow_copies = 0;
  int64_t blocks_swapped_out = 0;
  int64_t blocks_swapped_in = 0;
  int64_t evictions = 0;
};

// One context-parallel rank's pool (BlockManager::RankBlocks).
struct RankBlockStats {
  int32_t blocks_total = 0;
  int32_t blocks_free = 0;
  int32_t blocks_cached = 0;
  int32_t blocks_used = 0;
  int32_t swap_slots_used = 0;
};

class BlockManager {
 public:
  struct Options {
    int32_t num_blocks = 0;        // >= 1, per rank
    int32_t block_size = 16;       // 8, 16 or 32
    bool prefix_caching = false;
    int32_t num_swap_slots = 0;    // host blocks for swapped-out sequences, per rank
    int32_t cp_size = 1;           // context-parallel ranks whose pools this manager keeps
  };

  // Invalid options are programmer errors (ABSL_RAW_CHECK).
  explicit BlockManager(const Options& options);
  BlockManager(int32_t num_blocks, int32_t block_size)
      : BlockManager(Options{.num_blocks = num_blocks, .block_size = block_size}) {}
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  // A released table position (sliding windows).
  static constexpr int32_t kHole = -1;

  // Blocks of the whole group (every rank's pool).
  [[nodiscard]] int32_t num_blocks() const { return num_blocks_; }
  [[nodiscard]] int32_t block_size() const { return block_size_; }
  [[nodiscard]] int32_t cp_size() const { return layout_.cp_size; }
  [[nodiscard]] const ContextParallelLayout& layout() const { return layout_; }
  // Blocks an allocation can take now: free plus evictable cached blocks, on every rank or on
  // one. A sequence of n blocks needs ceil(n / cp_size) on rank 0.
  [[nodiscard]] int32_t num_free_blocks() const { return num_free_ + lru_size_total_; }
  [[nodiscard]] int32_t num_free_blocks(int32_t rank) const {
    return static_cast<int32_t>(free_[rank].size()) + lru_[rank].size;
  }
  [[nodiscard]] int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  [[nodiscard]] int64_t BlocksFor(int64_t num_tokens) const;
  [[nodiscard]] bool HasSequence(SequenceId seq) const { return seqs_.contains(seq); }
  [[nodiscard]] BlockManagerStats Stats() const;
  // Each rank's pool, rank 0 first (one entry without context parallelism).
  [[nodiscard]] std::vector<RankBlockStats> RankBlocks() const;

  // Starts `seq` (which must be new) with `tokens` (its prompt, or prompt + generated for a
  // recompute): shares the longest run of cached full blocks matching the start of `tokens`,
  // leaving at least one token to compute, then reserves blocks for `reserve_tokens` in all.
  // Returns how many leading tokens are already in the cache. All-or-nothing:
  // RESOURCE_EXHAUSTED, and no change, when the blocks do not fit.
  absl::StatusOr<int64_t> Allocate(SequenceId seq, std::span<const int32_t> tokens,
                                   int64_t reserve_tokens);

  // Allocate for a sliding-window model whose every layer attends `window` (> 0) positions
  // back: shares the cached prefix like Allocate, but leaves holes where cached blocks lie
  // wholly before the window of the first token to compute (they are not taken from the
  // cache), and reserves blocks only up to `chunk` tokens past the cached prefix (capped at
  // the tokens' end): the first prefill chunk. Returns how many leading tokens are already
  // computed. All-or-nothing: RESOURCE_EXHAUSTED, and no change, when the blocks do not fit.
  absl::StatusOr<int64_t> AllocateWindowed(SequenceId seq, std::span<const int32_t> tokens,
                                           int64_t window, int64_t chunk);

  // Releases the blocks of `seq` whose positions all lie before `first_needed` (for a window
  // W and a next query at position p: p - W + 1), making them holes. A block another
  // sequence shares just loses this reference; one in the prefix cache stays cached
  // (evictable). Returns the number of blocks released; 0 for unknown or swapped-out
  // sequences. Call only for models whose every layer slides.
  int64_t ReleaseBefore(SequenceId seq, int64_t first_needed);

  // Table entries released by ReleaseBefore (or never taken by AllocateWindowed) of `seq`:
  // its leading holes.
  [[nodiscard]] int64_t NumHoles(SequenceId seq) const;

  // Grows (never shrinks) `seq`'s table so it holds `num_tokens` tokens, creating the table on
  // first use (without prefix lookup). All-or-nothing: RESOURCE_EXHAUSTED with the numbers.
  absl::Status Reserve(SequenceId seq, int64_t num_tokens);

  // Makes positions [begin, end) of `seq` writable: grows the table to `end` tokens and gives
  // `seq` its own copy of any shared block in that range (copy-on-write), appending the data
  // copies to `copies`. All-or-nothing: RESOURCE_EXHAUSTED, and no change;
  // FAILED_PRECONDITION when the range reaches into a hole.
  absl::Status PrepareWrite(SequenceId seq, int64_t begin, int64_t end,
                            std::vector<BlockCopy>* copies);

  // Registers every full block among the first `num_computed` tokens of `seq` (whose K/V are
  // now written) in the prefix cache. `tokens` are the sequence's tokens from position 0. A
  // no-op without prefix caching.
  void CommitFullBlocks(SequenceId seq, std::span<const int32_t> tokens, int64_t num_computed);

  // `child` (new) shares every block of `parent` (not swapped). Writes into shared blocks go
  // through PrepareWrite's copy-on-write.
  void Fork(SequenceId parent, SequenceId child);

  // Releases `seq`'s blocks and swap slots. Unknown ids are fine (idempotent).
  void Free(SequenceId seq);

  // Swapping: blocks only `seq` references move to host slots; blocks it shares with others
  // stay on the device, still referenced. CanSwapOut: enough free slots. SwapIn needs enough
  // allocatable device blocks. Both all-or-nothing (RESOURCE_EXHAUSTED / FAILED_PRECONDITION).
  [[nodiscard]] bool CanSwapOut(SequenceId seq) const;
  absl::Status SwapOut(SequenceId seq, std::vector<BlockCopy>* device_to_host);
  [[nodiscard]] bool CanSwapIn(SequenceId seq) const;
  absl::Status SwapIn(SequenceId seq, std::vector<BlockCopy>* host_to_device);
  [[nodiscard]] bool IsSwapped(SequenceId seq) const;
  // Device blocks `seq` holds exclusively (what a swap out would move).
  [[nodiscard]] int64_t ExclusiveBlocks(SequenceId seq) const;

  // The device block ids of `seq` in token order (empty for unknown ids), kHole where
  // released. Meaningless while the sequence is swapped out.
  [[nodiscard]] const std::vector<int32_t>& BlockTable(SequenceId seq) const;

  // Slot of token `position` of `seq`: block_id * block_size + position % block_size.
  // The position must be inside the reserved capacity and not in a hole (ABSL_RAW_CHECK).
  [[nodiscard]] int64_t Slot(SequenceId seq, int64_t position) const;

  // Every invariant: each block in exactly one state, refcounts equal to the number of table
  // references, cached blocks hashed and indexed, LRU consistent, swap slots owned once,
  // holes only as a prefix of a table, every block and slot on the rank of its position and
  // on its own rank's free list or LRU.
  // INTERNAL describing the first violation; for tests.
  absl::Status CheckInvariants() const;

 private:
  struct SeqState {
    std::vector<int32_t> blocks;   // device ids, or host slot ids where on_host[i]
    std::vector<uint8_t> on_host;  // parallel to blocks
    int64_t committed_blocks = 0;  // leading full blocks registered in the prefix cache
    uint64_t last_hash = 0;        // chained hash of block committed_blocks - 1
    bool swapped = false;
  };
  static constexpr int32_t kNone = -1;

  // Allocate and AllocateWindowed: shares cached blocks matching the start of `tokens`, leaves
  // holes for the hits before block `first_kept` (a function of the hit length), and reserves
  // blocks up to `reserve_end` tokens (a function of the hit length too).
  template <typename FirstKept, typename ReserveEnd>
  absl::StatusOr<int64_t> AllocateShared(SequenceId seq, std::span<const int32_t> tokens,
                                         FirstKept first_kept, ReserveEnd reserve_end);
  struct Lru {
    int32_t head = kNone, tail = kNone, size = 0;
  };
  // Takes a free block of `rank` (or evicts its LRU cached one) with refcount 1. Caller
  // checked space.
  int32_t AllocateBlock(int32_t rank);
  // For table position `index`: a block of the rank that holds it.
  int32_t AllocateAt(int64_t index) { return AllocateBlock(layout_.RankOfPosition(index)); }
  void Release(int32_t block);  // refcount--, to free list or LRU at 0
  void LruRemove(int32_t block);
  void LruPushBack(int32_t block);
  static uint64_t ChainHash(uint64_t parent, std::span<const int32_t> tokens);
  // The cached block holding exactly `tokens` after `parent_hash` at table position `index`,
  // or kNone.
  int32_t FindCached(uint64_t hash, std::span<const int32_t> tokens, int64_t index) const;
  // OK when every rank can take need[rank] more blocks (of which `from_lru[rank]` kept hits
  // are already counted in its evictable pool), else RESOURCE_EXHAUSTED with the numbers of
  // the first rank short.
  absl::Status CheckFree(std::span<const int64_t> need, std::span<const int64_t> from_lru) const;
  // need[r] = table positions in [begin, end) on rank r.
  std::vector<int64_t> PositionsPerRank(int64_t begin, int64_t end) const;
  // The device blocks `state` holds exclusively, per rank.
  std::vector<int64_t> ExclusivePerRank(const SeqState& state) const;

  ContextParallelLayout layout_;
  int32_t num_blocks_;              // all ranks
  int32_t block_size_;
  bool prefix_caching_;
  std::vector<std::vector<int32_t>> free_;  // per rank; LIFO: recently freed are reused first
  int32_t num_free_ = 0;                    // on every rank's free list
  std::vector<int32_t> refcount_;   // per block
  std::vector<uint64_t> hash_;      // per block, meaningful when has_hash_
  std::vector<uint8_t> has_hash_;
  std::vector<std::vector<int32_t>> block_tokens_;  // tokens of cached blocks (collision check)
  std::vector<int32_t> lru_prev_, lru_next_;        // intrusive LRUs of cached blocks
  std::vector<Lru> lru_;                            // per rank
  int32_t lru_size_total_ = 0;
  absl::flat_hash_map<uint64_t, int32_t> cache_;    // hash -> block
  std::vector<std::vector<int32_t>> free_slots_;    // host swap slots, per rank
  int32_t num_swap_slots_;                          // all ranks
  absl::flat_hash_map<SequenceId, SeqState> seqs_;
  BlockManagerStats counters_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_BLOCK_MANAGER_H_
