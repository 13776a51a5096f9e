// Property test: random Reserve/Free sequences keep every block owned exactly once.
#include "worker/kv/block_manager.h"

#include <random>
#include <vector>

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
