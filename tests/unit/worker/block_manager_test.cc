// Property test: random Reserve/Free sequences keep every block owned exactly once.
#include "worker/kv/block_manager.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvgrid::worker {
namespace {

TEST(BlockManagerTest, ReserveGrowsTablesAndSlotsFollowBlocks) {
  BlockManager m(4, 16);
  ASSERT_TRUE(m.Reserve(1, 17).ok());
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
  EXPECT_EQ(m.num_free_blocks(), 2);
  EXPECT_EQ(m.Slot(1, 0), m.BlockTable(1)[0] * 16);
  EXPECT_EQ(m.Slot(1, 16), m.BlockTable(1)[1] * 16);
  EXPECT_EQ(m.Slot(1, 5), m.BlockTable(1)[0] * 16 + 5);
  ASSERT_TRUE(m.Reserve(1, 10).ok());  // never shrinks
  EXPECT_EQ(m.BlockTable(1).size(), 2u);
}

TEST(BlockManagerTest, ReserveIsAllOrNothing) {
  BlockManager m(3, 8);
  ASSERT_TRUE(m.Reserve(1, 8).ok());
  absl::Status s = m.Reserve(2, 24);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.num_free_blocks(), 2);
  EXPECT_FALSE(m.HasSequence(2));
  EXPECT_TRUE(m.CheckInvariants().ok());
}

TEST(BlockManagerTest, FreeIsIdempotent) {
  BlockManager m(2, 8);
  ASSERT_TRUE(m.Reserve(7, 9).ok());
  m.Free(7);
  m.Free(7);
  m.Free(12345);
  EXPECT_EQ(m.num_free_blocks(), 2);
  EXPECT_TRUE(m.CheckInvariants().ok());
}

TEST(BlockManagerTest, RandomOperationsKeepInvariants) {
  std::mt19937_64 rng(42);
  for (int32_t block_size : {8, 16, 32}) {
    BlockManager m(64, block_size);
    std::vector<int64_t> lens(20, 0);
    for (int op = 0; op < 5000; ++op) {
      const SequenceId seq = rng() % lens.size();
      if (rng() % 4 == 0) {
        m.Free(seq);
        lens[seq] = 0;
      } else {
        const int64_t want = lens[seq] + static_cast<int64_t>(rng() % 40);
        const int32_t free_before = m.num_free_blocks();
        const size_t table_before = m.BlockTable(seq).size();
        absl::Status s = m.Reserve(seq, want);
        if (s.ok()) {
          lens[seq] = want;
          EXPECT_GE(static_cast<int64_t>(m.BlockTable(seq).size()) * block_size, want);
        } else {
          EXPECT_EQ(m.num_free_blocks(), free_before);
          EXPECT_EQ(m.BlockTable(seq).size(), table_before);
        }
      }
      int64_t used = 0;
      for (size_t s = 0; s < lens.size(); ++s) used += m.BlockTable(s).size();
      ASSERT_EQ(used + m.num_free_blocks(), m.num_blocks()) << "op " << op;
      ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
    }
    for (size_t s = 0; s < lens.size(); ++s) m.Free(s);
    EXPECT_EQ(m.num_free_blocks(), m.num_blocks());
  }
}

}  // namespace
}  // namespace kvgrid::worker

namespace kvgrid::worker {
namespace {

std::vector<int32_t> Tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = (seed * 1000 + static_cast<int32_t>(i)) % 50000;
  return t;
}

BlockManager::Options Caching(int32_t blocks, int32_t swap_slots = 0) {
  return {.num_blocks = blocks, .block_size = 8, .prefix_caching = true,
          .num_swap_slots = swap_slots};
}

TEST(PrefixCacheTest, SecondSequenceSharesCommittedFullBlocks) {
  BlockManager m(Caching(16));
  const std::vector<int32_t> prompt = Tokens(20, 1);  // 2 full blocks + 4 tokens
  auto hit = m.Allocate(1, prompt, 21);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(*hit, 0);
  m.CommitFullBlocks(1, prompt, 20);
  auto hit2 = m.Allocate(2, prompt, 21);
  ASSERT_TRUE(hit2.ok());
  EXPECT_EQ(*hit2, 16);
  EXPECT_EQ(m.BlockTable(2)[0], m.BlockTable(1)[0]);
  EXPECT_EQ(m.BlockTable(2)[1], m.BlockTable(1)[1]);
  EXPECT_NE(m.BlockTable(2)[2], m.BlockTable(1)[2]);
  EXPECT_EQ(m.Stats().prefix_hit_tokens, 16);
  EXPECT_EQ(m.Stats().prefix_query_tokens, 40);
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(PrefixCacheTest, AlwaysLeavesOneTokenToCompute) {
  BlockManager m(Caching(16));
  const std::vector<int32_t> prompt = Tokens(16, 2);  // exactly 2 blocks
  ASSERT_TRUE(m.Allocate(1, prompt, 17).ok());
  m.CommitFullBlocks(1, prompt, 16);
  auto hit = m.Allocate(2, prompt, 17);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(*hit, 8);  // the last block is recomputed so the prompt yields logits
}

TEST(PrefixCacheTest, FreedBlocksStayCachedUntilEvictedLeastRecentlyUsedFirst) {
  BlockManager m(Caching(4));
  const std::vector<int32_t> a = Tokens(9, 3), b = Tokens(9, 4);
  ASSERT_TRUE(m.Allocate(1, a, 9).ok());
  m.CommitFullBlocks(1, a, 9);
  m.Free(1);
  ASSERT_TRUE(m.Allocate(2, b, 9).ok());
  m.CommitFullBlocks(2, b, 9);
  m.Free(2);
  EXPECT_EQ(m.Stats().blocks_cached, 2);
  EXPECT_EQ(m.num_free_blocks(), 4);
  // Needs all 4 blocks: both cached blocks are evicted, `a`'s first (older).
  ASSERT_TRUE(m.Reserve(3, 32).ok());
  EXPECT_EQ(m.Stats().evictions, 2);
  m.Free(3);
  EXPECT_EQ(*m.Allocate(4, a, 9), 0);  // gone
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(PrefixCacheTest, HitRevivesACachedBlock) {
  BlockManager m(Caching(4));
  const std::vector<int32_t> a = Tokens(9, 5);
  ASSERT_TRUE(m.Allocate(1, a, 9).ok());
  m.CommitFullBlocks(1, a, 9);
  m.Free(1);
  EXPECT_EQ(m.Stats().blocks_cached, 1);
  EXPECT_EQ(*m.Allocate(2, a, 9), 8);
  EXPECT_EQ(m.Stats().blocks_cached, 0);
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(CopyOnWriteTest, ForkedSequencesCopyTheSharedPartialBlockOnWrite) {
  BlockManager m(Caching(8));
  const std::vector<int32_t> prompt = Tokens(12, 6);
  ASSERT_TRUE(m.Allocate(1, prompt, 12).ok());
  m.Fork(1, 2);
  EXPECT_EQ(m.BlockTable(1), m.BlockTable(2));
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(m.PrepareWrite(2, 12, 13, &copies).ok());
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, m.BlockTable(1)[1]);
  EXPECT_EQ(copies[0].dst, m.BlockTable(2)[1]);
  EXPECT_EQ(m.BlockTable(1)[0], m.BlockTable(2)[0]);  // the full block stays shared
  copies.clear();
  ASSERT_TRUE(m.PrepareWrite(1, 12, 13, &copies).ok());
  EXPECT_TRUE(copies.empty());  // now exclusive
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(SwapTest, ExclusiveBlocksRoundTripThroughHostSlots) {
  BlockManager m(Caching(8, 4));
  const std::vector<int32_t> prompt = Tokens(20, 7);
  ASSERT_TRUE(m.Allocate(1, prompt, 20).ok());
  m.Fork(1, 2);
  std::vector<BlockCopy> w;
  ASSERT_TRUE(m.PrepareWrite(2, 20, 30, &w).ok());  // 2 gets its own block 2 and a 4th
  const std::vector<int32_t> before = m.BlockTable(2);
  std::vector<BlockCopy> out, in;
  ASSERT_TRUE(m.SwapOut(2, &out).ok());
  EXPECT_TRUE(m.IsSwapped(2));
  EXPECT_EQ(out.size(), 2u);  // blocks 0 and 1 are shared with sequence 1 and stay
  EXPECT_EQ(m.Stats().swap_slots_used, 2);
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  ASSERT_TRUE(m.SwapIn(2, &in).ok());
  ASSERT_EQ(in.size(), 2u);
  EXPECT_EQ(in[0].src, out[0].dst);
  EXPECT_EQ(m.BlockTable(2)[0], before[0]);
  EXPECT_EQ(m.Stats().swap_slots_used, 0);
  ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

// Copies never cross context-parallel ranks: `src` and `dst` are in one rank's pool (or its
// swap space).
void ExpectCopiesStayOnTheirRank(const BlockManager& m, const std::vector<BlockCopy>& copies,
                                 bool src_on_host, bool dst_on_host) {
  const ContextParallelLayout& l = m.layout();
  for (const BlockCopy& c : copies) {
    const int32_t src = src_on_host ? l.RankOfSlot(c.src) : l.RankOfBlock(c.src);
    const int32_t dst = dst_on_host ? l.RankOfSlot(c.dst) : l.RankOfBlock(c.dst);
    EXPECT_EQ(src, dst) << "copy " << c.src << " -> " << c.dst;
  }
}

// Random admits (from shared prefixes), appends, forks, frees, swaps and big reservations,
// with every invariant checked after each operation, per rank too, and no leak at the end.
void RandomWalk(int32_t cp_size, int32_t block_size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  {
    const int32_t per_rank = 48 / cp_size;
    BlockManager m({.num_blocks = per_rank, .block_size = block_size, .prefix_caching = true,
                    .num_swap_slots = 24 / cp_size, .cp_size = cp_size});
    struct Live {
      std::vector<int32_t> tokens;
      int64_t computed = 0;
    };
    absl::flat_hash_map<SequenceId, Live> live;
    SequenceId next = 1;
    for (int op = 0; op < 6000; ++op) {
      const int kind = static_cast<int>(rng() % 7);
      auto pick = [&]() -> SequenceId {
        if (live.empty()) return 0;
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        return it->first;
      };
      if (kind == 0 || live.empty()) {  // allocate, prompts from a few shared prefixes
        Live l;
        l.tokens = Tokens(1 + rng() % 60, static_cast<int32_t>(rng() % 4));
        for (int k = rng() % 3; k > 0; --k) l.tokens.push_back(static_cast<int32_t>(rng() % 9));
        auto hit = m.Allocate(next, l.tokens, static_cast<int64_t>(l.tokens.size()));
        if (hit.ok()) {
          ASSERT_LT(*hit, static_cast<int64_t>(l.tokens.size()));
          ASSERT_EQ(*hit % block_size, 0);
          l.computed = static_cast<int64_t>(l.tokens.size());
          m.CommitFullBlocks(next, l.tokens, l.computed);
          live[next] = std::move(l);
        }
        ++next;
      } else if (kind == 1) {  // append tokens (decode)
        const SequenceId s = pick();
        if (m.IsSwapped(s)) continue;
        Live& l = live[s];
        const int64_t add = 1 + rng() % 10;
        std::vector<BlockCopy> copies;
        const int32_t free_before = m.num_free_blocks();
        if (m.PrepareWrite(s, l.computed, l.computed + add, &copies).ok()) {
          for (int64_t i = 0; i < add; ++i) l.tokens.push_back(static_cast<int32_t>(rng() % 9));
          l.computed += add;
          m.CommitFullBlocks(s, l.tokens, l.computed);
          for (const BlockCopy& c : copies) ASSERT_NE(c.src, c.dst);
          ExpectCopiesStayOnTheirRank(m, copies, false, false);
        } else {
          ASSERT_EQ(m.num_free_blocks(), free_before);
        }
      } else if (kind == 2) {  // fork
        const SequenceId s = pick();
        if (m.IsSwapped(s)) continue;
        m.Fork(s, next);
        // Copied first: inserting `next` may rehash the map under a reference to live[s].
        Live copy = live.at(s);
        live[next] = std::move(copy);
        ++next;
      } else if (kind == 3) {  // free
        const SequenceId s = pick();
        m.Free(s);
        live.erase(s);
      } else if (kind == 4) {  // swap out
        const SequenceId s = pick();
        std::vector<BlockCopy> copies;
        if (m.CanSwapOut(s)) {
          ASSERT_TRUE(m.SwapOut(s, &copies).ok());
          ExpectCopiesStayOnTheirRank(m, copies, false, true);
        }
      } else if (kind == 5) {  // swap in
        const SequenceId s = pick();
        std::vector<BlockCopy> copies;
        if (m.CanSwapIn(s)) {
          ASSERT_TRUE(m.SwapIn(s, &copies).ok());
          ExpectCopiesStayOnTheirRank(m, copies, true, false);
        }
      } else {  // pressure: a big reservation that may evict cached blocks
        const int64_t want = static_cast<int64_t>(rng() % 200);
        if (m.Reserve(next, want).ok() && m.HasSequence(next)) live[next] = Live{Tokens(want, 9), want};
        ++next;
      }
      const BlockManagerStats st = m.Stats();
      ASSERT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total);
      int32_t rank_used = 0;
      for (const RankBlockStats& r : m.RankBlocks()) {
        ASSERT_EQ(r.blocks_total, per_rank);
        ASSERT_EQ(r.blocks_free + r.blocks_cached + r.blocks_used, r.blocks_total);
        rank_used += r.blocks_used;
      }
      ASSERT_EQ(rank_used, st.blocks_used);
      ASSERT_TRUE(m.CheckInvariants().ok()) << "op " << op << ": " << m.CheckInvariants();
      for (const auto& [s, l] : live) {
        if (!m.IsSwapped(s)) {
          ASSERT_GE(static_cast<int64_t>(m.BlockTable(s).size()) * block_size,
                    static_cast<int64_t>(l.tokens.size()));
        }
      }
    }
    // The random walk really exercised every mechanism.
    const BlockManagerStats st = m.Stats();
    EXPECT_GT(st.prefix_hit_tokens, 0);
    EXPECT_GT(st.cow_copies, 0);
    EXPECT_GT(st.blocks_swapped_out, 0);
    EXPECT_GT(st.blocks_swapped_in, 0);
    EXPECT_GT(st.evictions, 0);
    for (const auto& [s, l] : live) m.Free(s);
    EXPECT_EQ(m.num_free_blocks(), m.num_blocks()) << "leak";
    for (int32_t r = 0; r < cp_size; ++r) EXPECT_EQ(m.num_free_blocks(r), per_rank) << r;
    EXPECT_EQ(m.Stats().swap_slots_used, 0) << "swap slot leak";
    EXPECT_TRUE(m.CheckInvariants().ok());
  }
}

TEST(BlockManagerPropertyTest, RandomOperationsKeepEveryInvariant) {
  for (int32_t block_size : {8, 16}) RandomWalk(1, block_size, 1234);
}

TEST(BlockManagerPropertyTest, ContextParallelRanksKeepEveryInvariant) {
  for (int32_t cp_size : {2, 3, 4}) {
    SCOPED_TRACE(cp_size);
    RandomWalk(cp_size, 8, 99 + cp_size);
  }
}

// --- Context parallelism: one sequence's blocks spread over the pools of C ranks. ---

TEST(ContextParallelLayoutTest, RanksHoldTheirPositionsAndLocalIdsMapBack) {
  for (int32_t cp : {1, 2, 3, 4}) {
    const ContextParallelLayout l{.cp_size = cp, .blocks_per_rank = 5, .swap_slots_per_rank = 2};
    for (int64_t begin = 0; begin < 9; ++begin) {
      for (int64_t end = 0; end < 12; ++end) {
        for (int32_t r = 0; r < cp; ++r) {
          int64_t n = 0;
          for (int64_t i = begin; i < end; ++i) n += l.RankOfPosition(i) == r;
          EXPECT_EQ(l.PositionsOnRank(begin, end, r), n) << cp << " " << begin << " " << end;
        }
      }
    }
    for (int32_t id = 0; id < 5 * cp; ++id) {
      for (int32_t r = 0; r < cp; ++r) {
        const int32_t local = l.LocalBlock(id, r);
        EXPECT_EQ(local >= 0, l.RankOfBlock(id) == r);
        if (local >= 0) {
          EXPECT_EQ(local + r * 5, id);
        }
        const int64_t slot = l.LocalSlot(int64_t{id} * 16 + 7, 16, r);
        EXPECT_EQ(slot, local < 0 ? -1 : int64_t{local} * 16 + 7);
      }
    }
    EXPECT_EQ(l.LocalBlock(-1, 0), -1);
    EXPECT_EQ(l.LocalSlot(-1, 16, 0), -1);
    EXPECT_EQ(l.LocalSwapSlot(2 * cp - 1, cp - 1), 1);
  }
}

TEST(ContextParallelTest, SequenceBlocksGoRoundRobinAndCapacityIsPerRank) {
  BlockManager m({.num_blocks = 3, .block_size = 8, .cp_size = 2});
  EXPECT_EQ(m.num_blocks(), 6);
  ASSERT_TRUE(m.Reserve(1, 5 * 8).ok());  // 5 blocks: 3 on rank 0, 2 on rank 1
  const std::vector<int32_t>& t = m.BlockTable(1);
  ASSERT_EQ(t.size(), 5u);
  for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(m.layout().RankOfBlock(t[i]), i % 2) << i;
  EXPECT_EQ(m.num_free_blocks(0), 0);
  EXPECT_EQ(m.num_free_blocks(1), 1);
  // A second sequence's first block belongs on rank 0, which is full, though rank 1 has one.
  absl::Status s = m.Reserve(2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s;
  EXPECT_FALSE(m.HasSequence(2));
  // The sixth block of the first sequence is rank 1's.
  ASSERT_TRUE(m.Reserve(1, 6 * 8).ok());
  EXPECT_EQ(m.num_free_blocks(), 0);
  // Slots are group-wide; each rank finds only its own.
  const int64_t slot = m.Slot(1, 8 + 3);  // block 1, rank 1
  EXPECT_EQ(m.layout().LocalSlot(slot, 8, 0), -1);
  EXPECT_EQ(m.layout().LocalSlot(slot, 8, 1), int64_t{m.layout().LocalBlock(t[1], 1)} * 8 + 3);
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 6);
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(ContextParallelTest, PrefixHitsShareBlocksOnEveryRank) {
  BlockManager m({.num_blocks = 8, .block_size = 8, .prefix_caching = true, .cp_size = 3});
  const std::vector<int32_t> prompt = Tokens(8 * 5 + 2, 1);
  ASSERT_TRUE(m.Allocate(1, prompt, static_cast<int64_t>(prompt.size())).ok());
  m.CommitFullBlocks(1, prompt, static_cast<int64_t>(prompt.size()));
  auto hit = m.Allocate(2, prompt, static_cast<int64_t>(prompt.size()));
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(*hit, 8 * 5);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(m.BlockTable(2)[i], m.BlockTable(1)[i]) << i;
  EXPECT_NE(m.BlockTable(2)[5], m.BlockTable(1)[5]);
  // A prompt that differs only in block 1 (rank 1) shares block 0 and nothing after it, though
  // blocks 2..4 hold the same tokens: the chain covers every rank's blocks.
  std::vector<int32_t> other = prompt;
  other[8 + 3] = 777;
  auto hit3 = m.Allocate(3, other, static_cast<int64_t>(other.size()));
  ASSERT_TRUE(hit3.ok());
  EXPECT_EQ(*hit3, 8);
  EXPECT_EQ(m.BlockTable(3)[0], m.BlockTable(1)[0]);
  for (size_t i = 1; i < 6; ++i) EXPECT_NE(m.BlockTable(3)[i], m.BlockTable(1)[i]) << i;
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

TEST(ContextParallelTest, CopyOnWriteAndSwapStayOnTheBlocksRank) {
  BlockManager m({.num_blocks = 6, .block_size = 8, .num_swap_slots = 4, .cp_size = 2});
  ASSERT_TRUE(m.Reserve(1, 8 + 4).ok());  // block 1 (rank 1) is partial
  m.Fork(1, 2);
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(m.PrepareWrite(2, 12, 13, &copies).ok());
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(m.layout().RankOfBlock(copies[0].src), 1);
  EXPECT_EQ(m.layout().RankOfBlock(copies[0].dst), 1);
  m.Free(2);
  copies.clear();
  ASSERT_TRUE(m.SwapOut(1, &copies).ok());
  ASSERT_EQ(copies.size(), 2u);
  for (const BlockCopy& c : copies) {
    EXPECT_EQ(m.layout().RankOfBlock(c.src), m.layout().RankOfSlot(c.dst));
  }
  EXPECT_EQ(m.RankBlocks()[0].swap_slots_used, 1);
  EXPECT_EQ(m.RankBlocks()[1].swap_slots_used, 1);
  copies.clear();
  ASSERT_TRUE(m.SwapIn(1, &copies).ok());
  for (size_t i = 0; i < m.BlockTable(1).size(); ++i) {
    EXPECT_EQ(m.layout().RankOfBlock(m.BlockTable(1)[i]), i % 2);
  }
  m.Free(1);
  EXPECT_EQ(m.Stats().swap_slots_used, 0);
  // Each rank has 4 swap slots; a sequence with 5 blocks on rank 0 cannot swap, and nothing
  // moves.
  ASSERT_TRUE(m.Reserve(3, 9 * 8).ok());  // positions 0, 2, 4, 6, 8 on rank 0
  copies.clear();
  const absl::Status short_slots = m.SwapOut(3, &copies);
  EXPECT_EQ(short_slots.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(short_slots.message().find("needs 5 slots on context-parallel rank 0, 4 free of 4"),
            std::string::npos)
      << short_slots;
  EXPECT_TRUE(copies.empty());
  EXPECT_EQ(m.SwapOut(99, &copies).code(), absl::StatusCode::kFailedPrecondition);
  m.Free(3);
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
}

// --- Sliding windows: blocks wholly before the window of the next query go back. ---

// Blocks of `seq` that are not holes.
int64_t HeldBlocks(const BlockManager& m, SequenceId seq) {
  return static_cast<int64_t>(m.BlockTable(seq).size()) - m.NumHoles(seq);
}

TEST(SlidingWindowTest, DecodingHoldsOnlyTheWindow) {
  constexpr int64_t kWindow = 24;
  BlockManager m(8, 16);
  ASSERT_TRUE(m.Reserve(1, 30).ok());  // a 30-token prompt, computed
  int64_t computed = 30;
  // The next query, at 30, sees 7..30: block 0 (0..15) is still needed.
  EXPECT_EQ(m.ReleaseBefore(1, computed - kWindow + 1), 0);
  for (; computed < 300; ++computed) {
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(m.PrepareWrite(1, computed, computed + 1, &copies).ok()) << computed;
    m.ReleaseBefore(1, computed + 1 - kWindow + 1);
    // Held: the blocks overlapping [computed + 1 - 23, computed + 1).
    const int64_t first = std::max<int64_t>(0, computed + 1 - kWindow + 1) / 16;
    ASSERT_EQ(m.NumHoles(1), first);
    ASSERT_EQ(HeldBlocks(m, 1), computed / 16 + 1 - first);
    ASSERT_LE(HeldBlocks(m, 1), 3);
    ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  }
  EXPECT_EQ(m.num_free_blocks(), 8 - HeldBlocks(m, 1));
  // Holes are never written again, and slots past them still work.
  std::vector<BlockCopy> copies;
  EXPECT_EQ(m.PrepareWrite(1, 0, 1, &copies).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.Slot(1, 299) / 16, m.BlockTable(1)[299 / 16]);
  m.Free(1);
  EXPECT_EQ(m.num_free_blocks(), 8);
  EXPECT_TRUE(m.CheckInvariants().ok());
}

TEST(SlidingWindowTest, ExactBoundary) {
  BlockManager m(4, 8);
  ASSERT_TRUE(m.Reserve(1, 24).ok());
  // first_needed 15: position 15 is in block 1, block 0 (0..7) goes.
  EXPECT_EQ(m.ReleaseBefore(1, 15), 1);
  EXPECT_EQ(m.ReleaseBefore(1, 15), 0);  // idempotent
  // first_needed 16: block 1 (8..15) goes too; 17 does not take block 2.
  EXPECT_EQ(m.ReleaseBefore(1, 17), 1);
  EXPECT_EQ(m.NumHoles(1), 2);
  EXPECT_EQ(m.ReleaseBefore(1, 1000), 1);  // past the table: everything
  EXPECT_EQ(m.num_free_blocks(), 4);
  EXPECT_TRUE(m.CheckInvariants().ok());
  EXPECT_EQ(m.ReleaseBefore(42, 100), 0);  // unknown
}

TEST(SlidingWindowTest, ReleasedBlocksStayInThePrefixCacheAndHitsSkipTheirHoles) {
  constexpr int64_t kWindow = 10;
  BlockManager m(Caching(12));
  const std::vector<int32_t> prompt = Tokens(60, 3);  // 7 full blocks of 8 + 4 tokens
  auto hit = m.AllocateWindowed(1, prompt, kWindow, 16);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(*hit, 0);
  EXPECT_EQ(m.BlockTable(1).size(), 2u);  // only the first chunk is reserved
  int64_t computed = 16;
  m.CommitFullBlocks(1, prompt, computed);
  m.ReleaseBefore(1, computed - kWindow + 1);
  while (computed < 60) {
    const int64_t n = std::min<int64_t>(16, 60 - computed);
    std::vector<BlockCopy> copies;
    ASSERT_TRUE(m.PrepareWrite(1, computed, computed + n, &copies).ok());
    computed += n;
    m.CommitFullBlocks(1, prompt, computed);
    m.ReleaseBefore(1, computed - kWindow + 1);
    ASSERT_LE(HeldBlocks(m, 1), 3);
    ASSERT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  }
  EXPECT_GT(m.Stats().blocks_cached, 0);  // released full blocks stay reusable
  // The same prompt again: 7 cached blocks match; the first to compute (56) sees 47..56, so
  // blocks 0..4 (0..39) are holes and only 5 and 6 are taken, plus one for the rest.
  auto again = m.AllocateWindowed(2, prompt, kWindow, 16);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, 56);
  EXPECT_EQ(m.NumHoles(2), 5);
  EXPECT_EQ(m.BlockTable(2).size(), 8u);
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  m.Free(1);
  m.Free(2);
  EXPECT_EQ(m.num_free_blocks(), 12);
  EXPECT_TRUE(m.CheckInvariants().ok());
}

TEST(SlidingWindowTest, AllocateWindowedIsAllOrNothing) {
  BlockManager m(Caching(3));
  ASSERT_TRUE(m.Reserve(1, 16).ok());
  auto hit = m.AllocateWindowed(2, Tokens(40, 1), 8, 40);  // needs 5 blocks, 1 free
  EXPECT_EQ(hit.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(m.HasSequence(2));
  EXPECT_EQ(m.AllocateWindowed(2, Tokens(40, 1), 0, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.CheckInvariants().ok());
}

TEST(SlidingWindowTest, ForkSwapAndFreeSkipHoles) {
  BlockManager m(Caching(10, 10));
  ASSERT_TRUE(m.Reserve(1, 40).ok());  // 5 blocks of 8
  EXPECT_EQ(m.ReleaseBefore(1, 17), 2);
  m.Fork(1, 2);
  EXPECT_EQ(m.NumHoles(2), 2);
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  // Copy-on-write of the shared last block; holes are untouched.
  std::vector<BlockCopy> copies;
  ASSERT_TRUE(m.PrepareWrite(2, 39, 41, &copies).ok());
  EXPECT_EQ(copies.size(), 1u);
  m.Free(1);
  EXPECT_EQ(m.ExclusiveBlocks(2), 4);
  std::vector<BlockCopy> out, in;
  ASSERT_TRUE(m.SwapOut(2, &out).ok());
  EXPECT_EQ(out.size(), 4u);
  EXPECT_EQ(m.num_free_blocks(), 10);
  ASSERT_TRUE(m.SwapIn(2, &in).ok());
  EXPECT_EQ(in.size(), 4u);
  EXPECT_EQ(m.NumHoles(2), 2);
  EXPECT_TRUE(m.CheckInvariants().ok()) << m.CheckInvariants();
  m.Free(2);
  EXPECT_EQ(m.num_free_blocks(), 10);
  EXPECT_EQ(m.Stats().swap_slots_used, 0);
}

// The property test of a sliding-window pool: windowed admissions (prefix hits included),
// prefill chunks and decodes each followed by the release of what the next query cannot see,
// forks, frees, swaps and pressure; after every operation every invariant holds and every
// running sequence holds exactly the blocks its window needs.
// Also over context-parallel groups: about the same blocks in all, split over C ranks.
TEST(BlockManagerPropertyTest, SlidingWindowKeepsEveryInvariantAndTheBound) {
  std::mt19937_64 rng(77);
  for (int32_t cp : {1, 2, 3}) {
    for (int32_t block_size : {8, 16}) {
      for (int64_t window : {5, 20, 40}) {
        SCOPED_TRACE(absl::StrCat("cp ", cp, " block ", block_size, " window ", window));
        BlockManager m({.num_blocks = (40 + cp - 1) / cp, .block_size = block_size,
                        .prefix_caching = true, .num_swap_slots = 20 / cp, .cp_size = cp});
        struct Live {
          std::vector<int32_t> tokens;
          int64_t computed = 0;
        };
        absl::flat_hash_map<SequenceId, Live> live;
        SequenceId next = 1;
        int64_t released = 0;
        auto release = [&](SequenceId s, const Live& l) {
          released += m.ReleaseBefore(s, l.computed - window + 1);
        };
        for (int op = 0; op < 4000; ++op) {
          const int kind = static_cast<int>(rng() % 7);
          auto pick = [&]() -> SequenceId {
            auto it = live.begin();
            std::advance(it, rng() % live.size());
            return it->first;
          };
          if (kind == 0 || live.empty()) {  // admit: prompts from a few shared prefixes
            Live l;
            l.tokens = Tokens(1 + rng() % 120, static_cast<int32_t>(rng() % 3));
            const int64_t chunk = 1 + rng() % 40;
            auto hit = m.AllocateWindowed(next, l.tokens, window, chunk);
            if (hit.ok()) {
              ASSERT_LT(*hit, static_cast<int64_t>(l.tokens.size()));
              l.computed = std::min<int64_t>(l.tokens.size(), *hit + chunk);
              ASSERT_EQ(static_cast<int64_t>(m.BlockTable(next).size()), m.BlocksFor(l.computed));
              m.CommitFullBlocks(next, l.tokens, l.computed);
              release(next, l);
              live[next] = std::move(l);
            }
            ++next;
          } else if (kind == 1) {  // a prefill chunk or decode tokens
            const SequenceId s = pick();
            if (m.IsSwapped(s)) continue;
            Live& l = live[s];
            int64_t add = 1 + rng() % 12;
            const int64_t len = static_cast<int64_t>(l.tokens.size());
            const bool prefill = l.computed < len;
            if (prefill) add = std::min(add, len - l.computed);
            std::vector<BlockCopy> copies;
            const int32_t free_before = m.num_free_blocks();
            if (m.PrepareWrite(s, l.computed, l.computed + add, &copies).ok()) {
              if (!prefill) {
                for (int64_t i = 0; i < add; ++i) {
                  l.tokens.push_back(static_cast<int32_t>(rng() % 9));
                }
              }
              l.computed += add;
              m.CommitFullBlocks(s, l.tokens, l.computed);
              release(s, l);
            } else {
              ASSERT_EQ(m.num_free_blocks(), free_before);
            }
          } else if (kind == 2) {  // fork
            const SequenceId s = pick();
            if (m.IsSwapped(s)) continue;
            m.Fork(s, next);
            // Copied first: inserting `next` may rehash the map under a reference to live[s].
            Live copy = live.at(s);
            live[next] = std::move(copy);
            ++next;
          } else if (kind == 3) {  // free
            const SequenceId s = pick();
            m.Free(s);
            live.erase(s);
          } else if (kind == 4) {  // swap out
            const SequenceId s = pick();
            std::vector<BlockCopy> copies;
            if (m.CanSwapOut(s)) {
              ASSERT_TRUE(m.SwapOut(s, &copies).ok());
            }
          } else if (kind == 5) {  // swap in
            const SequenceId s = pick();
            std::vector<BlockCopy> copies;
            if (m.CanSwapIn(s)) {
              ASSERT_TRUE(m.SwapIn(s, &copies).ok());
            }
          } else {  // pressure: a full-attention style reservation that may evict cached blocks
            const int64_t want = static_cast<int64_t>(rng() % 100);
            if (m.Reserve(next, want).ok() && m.HasSequence(next)) {
              live[next] = Live{Tokens(want, 9), want};
              release(next, live[next]);
            }
            ++next;
          }
          const BlockManagerStats st = m.Stats();
          ASSERT_EQ(st.blocks_free + st.blocks_cached + st.blocks_used, st.blocks_total);
          for (const RankBlockStats& r : m.RankBlocks()) {
            ASSERT_EQ(r.blocks_free + r.blocks_cached + r.blocks_used, r.blocks_total);
          }
          ASSERT_TRUE(m.CheckInvariants().ok()) << "op " << op << ": " << m.CheckInvariants();
          for (const auto& [s, l] : live) {
            if (!m.IsSwapped(s)) {
              const std::vector<int32_t>& table = m.BlockTable(s);
              for (size_t i = 0; i < table.size(); ++i) {
                if (table[i] == BlockManager::kHole) continue;
                ASSERT_EQ(m.layout().RankOfBlock(table[i]), m.layout().RankOfPosition(i))
                    << "op " << op;
              }
            }
            // Exactly the blocks overlapping [computed - window + 1, computed).
            const int64_t first = std::max<int64_t>(0, l.computed - window + 1) / block_size;
            ASSERT_EQ(m.NumHoles(s), first) << "op " << op;
            ASSERT_EQ(static_cast<int64_t>(m.BlockTable(s).size()), m.BlocksFor(l.computed));
            ASSERT_LE(HeldBlocks(m, s), m.BlocksFor(window - 1) + 1) << "op " << op;
          }
        }
        EXPECT_GT(released, 0);
        EXPECT_GT(m.Stats().prefix_hit_tokens, 0);
        EXPECT_GT(m.Stats().blocks_swapped_out, 0);
        for (const auto& [s, l] : live) m.Free(s);
        EXPECT_EQ(m.num_free_blocks(), m.num_blocks()) << "leak";
        EXPECT_EQ(m.Stats().swap_slots_used, 0) << "swap slot leak";
        EXPECT_TRUE(m.CheckInvariants().ok());
      }
    }
  }
}

}  // namespace
}  // namespace kvgrid::worker
