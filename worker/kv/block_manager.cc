#include "worker/kv/block_manager.h"

#include <algorithm>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "model/status_macros.h"

namespace kvgrid::worker {

BlockManager::BlockManager(const Options& options)
    : layout_{.cp_size = options.cp_size,
              .blocks_per_rank = options.num_blocks,
              .swap_slots_per_rank = options.num_swap_slots},
      num_blocks_(options.num_blocks * options.cp_size),
      block_size_(options.block_size),
      prefix_caching_(options.prefix_caching),
      num_swap_slots_(options.num_swap_slots * options.cp_size) {
  ABSL_RAW_CHECK(options.num_blocks >= 1, "BlockManager needs at least one block");
  ABSL_RAW_CHECK(options.cp_size >= 1 && options.cp_size <= 1024,
                 "cp_size must be in [1, 1024]");
  ABSL_RAW_CHECK(int64_t{options.num_blocks} * options.cp_size <= INT32_MAX / 32 &&
                     int64_t{options.num_swap_slots} * options.cp_size <= INT32_MAX,
                 "too many blocks for 32-bit ids");
  ABSL_RAW_CHECK(block_size_ == 8 || block_size_ == 16 || block_size_ == 32,
                 "block_size must be 8, 16 or 32");
  ABSL_RAW_CHECK(options.num_swap_slots >= 0, "num_swap_slots must be >= 0");
  const int32_t ranks = options.cp_size;
  free_.resize(ranks);
  free_slots_.resize(ranks);
  lru_.resize(ranks);
  for (int32_t r = 0; r < ranks; ++r) {
    const int32_t first = r * options.num_blocks;
    free_[r].reserve(options.num_blocks);
    for (int32_t id = first + options.num_blocks - 1; id >= first; --id) free_[r].push_back(id);
    const int32_t first_slot = r * options.num_swap_slots;
    for (int32_t slot = first_slot + options.num_swap_slots - 1; slot >= first_slot; --slot) {
      free_slots_[r].push_back(slot);
    }
  }
  num_free_ = num_blocks_;
  refcount_.assign(num_blocks_, 0);
  hash_.assign(num_blocks_, 0);
  has_hash_.assign(num_blocks_, 0);
  block_tokens_.resize(num_blocks_);
  lru_prev_.assign(num_blocks_, kNone);
  lru_next_.assign(num_blocks_, kNone);
}

int64_t BlockManager::BlocksFor(int64_t num_tokens) const {
  return (num_tokens + block_size_ - 1) / block_size_;
}

BlockManagerStats BlockManager::Stats() const {
  BlockManagerStats s = counters_;
  s.blocks_total = num_blocks_;
  s.blocks_free = num_free_;
  s.blocks_cached = lru_size_total_;
  s.blocks_used = num_blocks_ - s.blocks_free - s.blocks_cached;
  s.swap_slots_total = num_swap_slots_;
  s.swap_slots_used = num_swap_slots_;
  for (const std::vector<int32_t>& slots : free_slots_) {
    s.swap_slots_used -= static_cast<int32_t>(slots.size());
  }
  return s;
}

std::vector<RankBlockStats> BlockManager::RankBlocks() const {
  std::vector<RankBlockStats> out(layout_.cp_size);
  for (int32_t r = 0; r < layout_.cp_size; ++r) {
    RankBlockStats& s = out[r];
    s.blocks_total = layout_.blocks_per_rank;
    s.blocks_free = static_cast<int32_t>(free_[r].size());
    s.blocks_cached = lru_[r].size;
    s.blocks_used = s.blocks_total - s.blocks_free - s.blocks_cached;
    s.swap_slots_used = layout_.swap_slots_per_rank - static_cast<int32_t>(free_slots_[r].size());
  }
  return out;
}

std::vector<int64_t> BlockManager::PositionsPerRank(int64_t begin, int64_t end) const {
  std::vector<int64_t> n(layout_.cp_size);
  for (int32_t r = 0; r < layout_.cp_size; ++r) n[r] = layout_.PositionsOnRank(begin, end, r);
  return n;
}

absl::Status BlockManager::CheckFree(std::span<const int64_t> need,
                                     std::span<const int64_t> from_lru) const {
  for (int32_t r = 0; r < layout_.cp_size; ++r) {
    const int64_t have = num_free_blocks(r) - (from_lru.empty() ? 0 : from_lru[r]);
    if (need[r] <= have) continue;
    if (layout_.cp_size == 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV cache: ", need[r], " more blocks needed, ", have, " free of ", num_blocks_));
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache: ", need[r], " more blocks needed on context-parallel rank ", r,
                     ", ", have, " free of ", layout_.blocks_per_rank));
  }
  return absl::OkStatus();
}

uint64_t BlockManager::ChainHash(uint64_t parent, std::span<const int32_t> tokens) {
  // splitmix64 finalizer over (parent, tokens...): stable across processes, unlike absl::Hash,
  // so that hashes can later be compared between workers for prefix-affinity placement.
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(parent ^ 0x6b76677269645f31ull);
  for (int32_t t : tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return h;
}

int32_t BlockManager::FindCached(uint64_t hash, std::span<const int32_t> tokens,
                                 int64_t index) const {
  auto it = cache_.find(hash);
  if (it == cache_.end()) return kNone;
  // The chain fixes the position, so only a 64-bit collision could name another rank's block.
  if (layout_.RankOfBlock(it->second) != layout_.RankOfPosition(index)) return kNone;
  const std::vector<int32_t>& stored = block_tokens_[it->second];
  if (!std::equal(stored.begin(), stored.end(), tokens.begin(), tokens.end())) return kNone;
  return it->second;
}

void BlockManager::LruRemove(int32_t b) {
  Lru& lru = lru_[layout_.RankOfBlock(b)];
  const int32_t prev = lru_prev_[b], next = lru_next_[b];
  (prev == kNone ? lru.head : lru_next_[prev]) = next;
  (next == kNone ? lru.tail : lru_prev_[next]) = prev;
  lru_prev_[b] = lru_next_[b] = kNone;
  --lru.size;
  --lru_size_total_;
}

void BlockManager::LruPushBack(int32_t b) {
  Lru& lru = lru_[layout_.RankOfBlock(b)];
  lru_prev_[b] = lru.tail;
  lru_next_[b] = kNone;
  (lru.tail == kNone ? lru.head : lru_next_[lru.tail]) = b;
  lru.tail = b;
  ++lru.size;
  ++lru_size_total_;
}

int32_t BlockManager::AllocateBlock(int32_t rank) {
  int32_t b;
  std::vector<int32_t>& free = free_[rank];
  if (!free.empty()) {
    b = free.back();
    free.pop_back();
    --num_free_;
  } else {
    ABSL_RAW_CHECK(lru_[rank].head != kNone, "AllocateBlock with no free or cached block");
    b = lru_[rank].head;
    LruRemove(b);
    cache_.erase(hash_[b]);
    has_hash_[b] = 0;
    block_tokens_[b].clear();
    ++counters_.evictions;
  }
  refcount_[b] = 1;
  return b;
}

void BlockManager::Release(int32_t b) {
  if (--refcount_[b] > 0) return;
  if (has_hash_[b]) {
    LruPushBack(b);  // stays reusable by a prefix hit until evicted
  } else {
    free_[layout_.RankOfBlock(b)].push_back(b);
    ++num_free_;
  }
}

template <typename FirstKept, typename ReserveEnd>
absl::StatusOr<int64_t> BlockManager::AllocateShared(SequenceId seq,
                                                     std::span<const int32_t> tokens,
                                                     FirstKept first_kept,
                                                     ReserveEnd reserve_end) {
  if (seqs_.contains(seq)) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " already has blocks"));
  }
  std::vector<int32_t> hits;
  uint64_t hash = 0;
  if (prefix_caching_ && !tokens.empty()) {
    const int64_t max_hits = (static_cast<int64_t>(tokens.size()) - 1) / block_size_;
    for (int64_t i = 0; i < max_hits; ++i) {
      std::span<const int32_t> block_tokens = tokens.subspan(i * block_size_, block_size_);
      const uint64_t h = ChainHash(hash, block_tokens);
      const int32_t b = FindCached(h, block_tokens, i);
      if (b == kNone) break;
      hits.push_back(b);
      hash = h;
    }
  }
  const int64_t num_hits = static_cast<int64_t>(hits.size());
  const int64_t hit_tokens = num_hits * block_size_;
  const int64_t kept_from = std::clamp<int64_t>(first_kept(hit_tokens), 0, num_hits);
  std::vector<int64_t> hits_in_lru(layout_.cp_size);  // kept hits out of the evictable pools
  for (int64_t i = kept_from; i < num_hits; ++i) {
    if (refcount_[hits[i]] == 0) ++hits_in_lru[layout_.RankOfBlock(hits[i])];
  }
  const int64_t total_blocks = std::max<int64_t>(BlocksFor(reserve_end(hit_tokens)), num_hits);
  const int64_t fresh = total_blocks - num_hits;
  KVGRID_RETURN_IF_ERROR(CheckFree(PositionsPerRank(num_hits, total_blocks), hits_in_lru));
  SeqState& state = seqs_[seq];
  for (int64_t i = 0; i < num_hits; ++i) {
    const int32_t b = hits[i];
    if (i < kept_from) {
      state.blocks.push_back(kHole);
      continue;
    }
    if (refcount_[b] == 0) LruRemove(b);
    ++refcount_[b];
    state.blocks.push_back(b);
  }
  state.committed_blocks = num_hits;
  state.last_hash = hash;
  for (int64_t i = 0; i < fresh; ++i) state.blocks.push_back(AllocateAt(num_hits + i));
  state.on_host.assign(state.blocks.size(), 0);
  if (prefix_caching_) {
    counters_.prefix_query_tokens += static_cast<int64_t>(tokens.size());
    counters_.prefix_hit_tokens += hit_tokens;
  }
  return hit_tokens;
}

absl::StatusOr<int64_t> BlockManager::Allocate(SequenceId seq, std::span<const int32_t> tokens,
                                               int64_t reserve_tokens) {
  return AllocateShared(
      seq, tokens, [](int64_t) { return int64_t{0}; },
      [reserve_tokens](int64_t) { return reserve_tokens; });
}

absl::StatusOr<int64_t> BlockManager::AllocateWindowed(SequenceId seq,
                                                       std::span<const int32_t> tokens,
                                                       int64_t window, int64_t chunk) {
  if (window <= 0 || chunk <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllocateWindowed: window ", window, " and chunk ", chunk, " must be > 0"));
  }
  const int64_t len = static_cast<int64_t>(tokens.size());
  const int64_t bs = block_size_;
  return AllocateShared(
      seq, tokens,
      // The first token to compute, at hit_tokens, sees keys from hit_tokens - window + 1.
      [window, bs](int64_t hit_tokens) {
        return std::max<int64_t>(0, hit_tokens - window + 1) / bs;
      },
      [len, chunk](int64_t hit_tokens) { return std::min(len, hit_tokens + chunk); });
}

int64_t BlockManager::ReleaseBefore(SequenceId seq, int64_t first_needed) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || it->second.swapped || first_needed <= 0) return 0;
  SeqState& state = it->second;
  const int64_t end = std::min<int64_t>(first_needed / block_size_,
                                        static_cast<int64_t>(state.blocks.size()));
  // Holes are a prefix of the table: the blocks to release are those between the last hole
  // and the window's edge. Finding them from the edge keeps this call, made after every step,
  // from rescanning every hole of a long sequence; they are released in table order.
  int64_t begin = end;
  while (begin > 0 && state.blocks[begin - 1] != kHole) --begin;
  for (int64_t i = begin; i < end; ++i) {
    Release(state.blocks[i]);
    state.blocks[i] = kHole;
  }
  return end - begin;
}

int64_t BlockManager::NumHoles(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return 0;
  const std::vector<int32_t>& b = it->second.blocks;
  return std::find_if(b.begin(), b.end(), [](int32_t id) { return id != kHole; }) - b.begin();
}

absl::Status BlockManager::Reserve(SequenceId seq, int64_t num_tokens) {
  auto it = seqs_.find(seq);
  const int64_t have = it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.blocks.size());
  const int64_t needed = BlocksFor(num_tokens) - have;
  if (needed <= 0) return absl::OkStatus();
  if (it != seqs_.end() && it->second.swapped) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " is swapped out"));
  }
  KVGRID_RETURN_IF_ERROR(CheckFree(PositionsPerRank(have, have + needed), {}));
  SeqState& state = seqs_[seq];
  for (int64_t i = 0; i < needed; ++i) {
    state.blocks.push_back(AllocateAt(have + i));
    state.on_host.push_back(0);
  }
  return absl::OkStatus();
}

absl::Status BlockManager::PrepareWrite(SequenceId seq, int64_t begin, int64_t end,
                                        std::vector<BlockCopy>* copies) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return Reserve(seq, end);
  SeqState& state = it->second;
  if (state.swapped) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " is swapped out"));
  }
  const int64_t have = static_cast<int64_t>(state.blocks.size());
  const int64_t grow = std::max<int64_t>(0, BlocksFor(end) - have);
  std::vector<int64_t> shared;
  for (int64_t i = begin / block_size_; i < std::min(have, BlocksFor(end)); ++i) {
    if (state.blocks[i] == kHole) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", seq, ": positions from ", i * block_size_, " were released"));
    }
    if (refcount_[state.blocks[i]] > 1) shared.push_back(i);
  }
  std::vector<int64_t> needed = PositionsPerRank(have, have + grow);
  for (int64_t i : shared) ++needed[layout_.RankOfPosition(i)];
  KVGRID_RETURN_IF_ERROR(CheckFree(needed, {}));
  for (int64_t i : shared) {
    const int32_t old = state.blocks[i];
    const int32_t fresh = AllocateAt(i);  // on old's rank: the copy stays on one rank
    copies->push_back({old, fresh});
    Release(old);
    state.blocks[i] = fresh;
    ++counters_.cow_copies;
  }
  for (int64_t i = 0; i < grow; ++i) {
    state.blocks.push_back(AllocateAt(have + i));
    state.on_host.push_back(0);
  }
  return absl::OkStatus();
}

void BlockManager::CommitFullBlocks(SequenceId seq, std::span<const int32_t> tokens,
                                    int64_t num_computed) {
  if (!prefix_caching_) return;
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || it->second.swapped) return;
  SeqState& state = it->second;
  const int64_t full = std::min<int64_t>(num_computed / block_size_,
                                         static_cast<int64_t>(state.blocks.size()));
  for (int64_t i = state.committed_blocks; i < full; ++i) {
    std::span<const int32_t> block_tokens = tokens.subspan(i * block_size_, block_size_);
    const uint64_t h = ChainHash(state.last_hash, block_tokens);
    const int32_t b = state.blocks[i];
    // Another block may already hold the same content (two identical prompts computed side
    // by side); this one then stays unregistered and is freed normally. A hole (released
    // before it was registered) only extends the chain.
    if (b != kHole && !has_hash_[b] && !cache_.contains(h)) {
      has_hash_[b] = 1;
      hash_[b] = h;
      block_tokens_[b].assign(block_tokens.begin(), block_tokens.end());
      cache_[h] = b;
    }
    state.last_hash = h;
    state.committed_blocks = i + 1;
  }
}

void BlockManager::Fork(SequenceId parent, SequenceId child) {
  auto it = seqs_.find(parent);
  ABSL_RAW_CHECK(it != seqs_.end() && !it->second.swapped, "Fork of an unknown or swapped parent");
  ABSL_RAW_CHECK(!seqs_.contains(child), "Fork into an existing sequence");
  SeqState copy = it->second;
  for (int32_t b : copy.blocks) {
    if (b != kHole) ++refcount_[b];
  }
  seqs_.emplace(child, std::move(copy));
}

void BlockManager::Free(SequenceId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  const SeqState& state = it->second;
  for (size_t i = state.blocks.size(); i-- > 0;) {
    if (state.on_host[i]) {
      free_slots_[layout_.RankOfSlot(state.blocks[i])].push_back(state.blocks[i]);
    } else if (state.blocks[i] != kHole) {
      Release(state.blocks[i]);
    }
  }
  seqs_.erase(it);
}

int64_t BlockManager::ExclusiveBlocks(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return 0;
  int64_t n = 0;
  for (int64_t on_rank : ExclusivePerRank(it->second)) n += on_rank;
  return n;
}

std::vector<int64_t> BlockManager::ExclusivePerRank(const SeqState& state) const {
  std::vector<int64_t> n(layout_.cp_size);
  for (size_t i = 0; i < state.blocks.size(); ++i) {
    const int32_t b = state.blocks[i];
    if (!state.on_host[i] && b != kHole && refcount_[b] == 1) ++n[layout_.RankOfBlock(b)];
  }
  return n;
}

bool BlockManager::CanSwapOut(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || it->second.swapped) return false;
  const std::vector<int64_t> need = ExclusivePerRank(it->second);
  for (int32_t r = 0; r < layout_.cp_size; ++r) {
    if (need[r] > static_cast<int64_t>(free_slots_[r].size())) return false;
  }
  return true;
}

absl::Status BlockManager::SwapOut(SequenceId seq, std::vector<BlockCopy>* device_to_host) {
  if (!CanSwapOut(seq)) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end() || it->second.swapped) {
      return absl::FailedPreconditionError(
          absl::StrCat("swap out: sequence ", seq, " is unknown or already swapped"));
    }
    const std::vector<int64_t> need = ExclusivePerRank(it->second);
    for (int32_t r = 0; r < layout_.cp_size; ++r) {
      if (need[r] <= static_cast<int64_t>(free_slots_[r].size())) continue;
      return absl::ResourceExhaustedError(absl::StrCat(
          "swap space: sequence ", seq, " needs ", need[r], " slots",
          layout_.cp_size > 1 ? absl::StrCat(" on context-parallel rank ", r) : "", ", ",
          free_slots_[r].size(), " free of ", layout_.swap_slots_per_rank));
    }
  }
  SeqState& state = seqs_[seq];
  for (size_t i = 0; i < state.blocks.size(); ++i) {
    const int32_t b = state.blocks[i];
    // Shared: stays on the device, still referenced (holes stay holes).
    if (b == kHole || refcount_[b] != 1) continue;
    std::vector<int32_t>& slots = free_slots_[layout_.RankOfBlock(b)];
    const int32_t slot = slots.back();
    slots.pop_back();
    device_to_host->push_back({b, slot});
    Release(b);
    state.blocks[i] = slot;
    state.on_host[i] = 1;
    ++counters_.blocks_swapped_out;
  }
  state.swapped = true;
  return absl::OkStatus();
}

bool BlockManager::CanSwapIn(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || !it->second.swapped) return false;
  std::vector<int64_t> on_host(layout_.cp_size);
  for (size_t i = 0; i < it->second.blocks.size(); ++i) {
    if (it->second.on_host[i]) ++on_host[layout_.RankOfSlot(it->second.blocks[i])];
  }
  return CheckFree(on_host, {}).ok();
}

absl::Status BlockManager::SwapIn(SequenceId seq, std::vector<BlockCopy>* host_to_device) {
  if (!CanSwapIn(seq)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache: not enough free blocks to swap sequence ", seq, " back in"));
  }
  SeqState& state = seqs_[seq];
  for (size_t i = 0; i < state.blocks.size(); ++i) {
    if (!state.on_host[i]) continue;
    const int32_t b = AllocateAt(static_cast<int64_t>(i));
    host_to_device->push_back({state.blocks[i], b});
    free_slots_[layout_.RankOfSlot(state.blocks[i])].push_back(state.blocks[i]);
    state.blocks[i] = b;
    state.on_host[i] = 0;
    ++counters_.blocks_swapped_in;
  }
  state.swapped = false;
  return absl::OkStatus();
}

bool BlockManager::IsSwapped(SequenceId seq) const {
  auto it = seqs_.find(seq);
  return it != seqs_.end() && it->second.swapped;
}

const std::vector<int32_t>& BlockManager::BlockTable(SequenceId seq) const {
  static const std::vector<int32_t> kEmpty;
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? kEmpty : it->second.blocks;
}

int64_t BlockManager::Slot(SequenceId seq, int64_t position) const {
  auto it = seqs_.find(seq);
  const int64_t index = position / block_size_;
  ABSL_RAW_CHECK(it != seqs_.end() && !it->second.swapped && position >= 0 &&
                     index < static_cast<int64_t>(it->second.blocks.size()) &&
                     it->second.blocks[index] != kHole,
                 "position outside the reserved blocks of the sequence");
  return static_cast<int64_t>(it->second.blocks[index]) * block_size_ + position % block_size_;
}

absl::Status BlockManager::CheckInvariants() const {
  std::vector<int32_t> refs(num_blocks_, 0);
  std::vector<int> slot_owners(num_swap_slots_, 0);
  for (const auto& [seq, state] : seqs_) {
    if (state.on_host.size() != state.blocks.size()) {
      return absl::InternalError(absl::StrCat("sequence ", seq, ": on_host size mismatch"));
    }
    bool past_holes = false;
    for (size_t i = 0; i < state.blocks.size(); ++i) {
      const int32_t id = state.blocks[i];
      if (id == kHole && !state.on_host[i]) {
        if (past_holes) {
          return absl::InternalError(
              absl::StrCat("sequence ", seq, ": hole at table index ", i, " after a block"));
        }
        continue;
      }
      past_holes = true;
      const int32_t rank = layout_.RankOfPosition(static_cast<int64_t>(i));
      if (state.on_host[i]) {
        if (!state.swapped || id < 0 || id >= num_swap_slots_) {
          return absl::InternalError(absl::StrCat("sequence ", seq, ": bad host slot ", id));
        }
        if (layout_.RankOfSlot(id) != rank) {
          return absl::InternalError(absl::StrCat("sequence ", seq, ": host slot ", id,
                                                  " at table index ", i, " is not on rank ",
                                                  rank));
        }
        ++slot_owners[id];
      } else {
        if (id < 0 || id >= num_blocks_) {
          return absl::InternalError(absl::StrCat("sequence ", seq, " holds bad block ", id));
        }
        if (layout_.RankOfBlock(id) != rank) {
          return absl::InternalError(absl::StrCat("sequence ", seq, ": block ", id,
                                                  " at table index ", i, " is not on rank ",
                                                  rank));
        }
        ++refs[id];
      }
    }
  }
  std::vector<int> on_free(num_blocks_, 0), on_lru(num_blocks_, 0);
  int64_t free_total = 0, lru_total = 0;
  for (int32_t r = 0; r < layout_.cp_size; ++r) {
    for (int32_t b : free_[r]) {
      if (layout_.RankOfBlock(b) != r) {
        return absl::InternalError(absl::StrCat("block ", b, " is on rank ", r, "'s free list"));
      }
      ++on_free[b];
    }
    free_total += static_cast<int64_t>(free_[r].size());
    int32_t walked = 0;
    const Lru& lru = lru_[r];
    for (int32_t b = lru.head, prev = kNone; b != kNone; prev = b, b = lru_next_[b]) {
      if (lru_prev_[b] != prev || ++walked > num_blocks_) {
        return absl::InternalError("LRU list is corrupt");
      }
      if (layout_.RankOfBlock(b) != r) {
        return absl::InternalError(absl::StrCat("block ", b, " is on rank ", r, "'s LRU"));
      }
      ++on_lru[b];
      if (lru_next_[b] == kNone && lru.tail != b) return absl::InternalError("LRU tail mismatch");
    }
    if (walked != lru.size) return absl::InternalError("LRU size mismatch");
    lru_total += walked;
  }
  if (free_total != num_free_ || lru_total != lru_size_total_) {
    return absl::InternalError("free or cached block count mismatch");
  }
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (refs[b] != refcount_[b]) {
      return absl::InternalError(absl::StrCat("block ", b, ": refcount ", refcount_[b], " but ",
                                              refs[b], " table references"));
    }
    const int states = (refcount_[b] > 0) + on_free[b] + on_lru[b];
    if (states != 1) {
      return absl::InternalError(absl::StrCat("block ", b, " is in ", states,
                                              " states (used/free/cached)"));
    }
    if (on_free[b] && has_hash_[b]) {
      return absl::InternalError(absl::StrCat("free block ", b, " still has a hash"));
    }
    if (on_lru[b] && !has_hash_[b]) {
      return absl::InternalError(absl::StrCat("cached block ", b, " has no hash"));
    }
    if (has_hash_[b]) {
      auto it = cache_.find(hash_[b]);
      if (it == cache_.end() || it->second != b) {
        return absl::InternalError(absl::StrCat("block ", b, " is hashed but not indexed"));
      }
      if (static_cast<int32_t>(block_tokens_[b].size()) != block_size_) {
        return absl::InternalError(absl::StrCat("cached block ", b, " lacks its tokens"));
      }
    }
  }
  for (const auto& [h, b] : cache_) {
    if (!has_hash_[b] || hash_[b] != h) {
      return absl::InternalError(absl::StrCat("index entry for block ", b, " is stale"));
    }
  }
  for (int32_t r = 0; r < layout_.cp_size; ++r) {
    for (int32_t slot : free_slots_[r]) {
      if (layout_.RankOfSlot(slot) != r) {
        return absl::InternalError(absl::StrCat("swap slot ", slot, " is free on rank ", r));
      }
      ++slot_owners[slot];
    }
  }
  for (int32_t slot = 0; slot < num_swap_slots_; ++slot) {
    if (slot_owners[slot] != 1) {
      return absl::InternalError(absl::StrCat("swap slot ", slot, " is owned ",
                                              slot_owners[slot], " times"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
