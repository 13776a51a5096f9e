// Placement: only live workers whose whole pool can hold the worst case are eligible; full
// queues are skipped; among the rest, admit-now, prefix affinity, load and free blocks decide;
// the errors say why nothing was chosen.
#include "coordinator/placement.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::coordinator {
namespace {

Candidate Worker(std::string id, int64_t blocks_total, int64_t blocks_free, int64_t in_flight = 0) {
  return Candidate{.worker_id = std::move(id),
                   .live = true,
                   .block_size = 16,
                   .blocks_total = blocks_total,
                   .blocks_free = blocks_free,
                   .max_model_len = 4096,
                   .in_flight = in_flight,
                   .max_num_seqs = 8,
                   .prefix_blocks = 0};
}

TEST(PlacementTest, PrefersAWorkerThatAdmitsNowThenLessLoaded) {
  std::vector<Candidate> c = {Worker("a", 100, 2), Worker("b", 100, 50, 3), Worker("c", 100, 60, 1)};
  const PlacementRequest r{.prompt_tokens = 100, .max_new_tokens = 60, .max_queue_depth = 4};
  auto chosen = ChooseWorker(c, r);  // needs 10 blocks: a cannot admit now
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(c[*chosen].worker_id, "c");
}

TEST(PlacementTest, PrefixAffinityBeatsLoad) {
  std::vector<Candidate> c = {Worker("a", 100, 50, 0), Worker("b", 100, 50, 2)};
  c[1].prefix_blocks = 4;
  auto chosen = ChooseWorker(c, {.prompt_tokens = 64, .max_new_tokens = 16});
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(c[*chosen].worker_id, "b");
}

TEST(PlacementTest, OnlyPoolsThatCanEverHoldItAndNeverDeadWorkers) {
  std::vector<Candidate> c = {Worker("small", 10, 10), Worker("big", 100, 5, 7), Worker("dead", 1000, 1000)};
  c[2].live = false;
  auto chosen = ChooseWorker(c, {.prompt_tokens = 200, .max_new_tokens = 200});  // 25 blocks
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(c[*chosen].worker_id, "big");
}

TEST(PlacementTest, TooLargeForEveryPoolNamesTheNumbers) {
  std::vector<Candidate> c = {Worker("a", 10, 10), Worker("b", 20, 20)};
  auto chosen = ChooseWorker(c, {.prompt_tokens = 300, .max_new_tokens = 100});
  ASSERT_EQ(chosen.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string m(chosen.status().message());
  EXPECT_NE(m.find("400 tokens (25 KV blocks)"), std::string::npos) << m;
  EXPECT_NE(m.find("320 tokens (20 blocks)"), std::string::npos) << m;
}

TEST(PlacementTest, WorstCaseIsCappedAtTheContextLength) {
  Candidate w = Worker("a", 256, 256);  // 4096 tokens = max_model_len
  std::vector<Candidate> c = {w};
  EXPECT_EQ(WorstCaseTokens(w, {.prompt_tokens = 10, .max_new_tokens = 2000000000}), 4096);
  EXPECT_TRUE(ChooseWorker(c, {.prompt_tokens = 10, .max_new_tokens = 2000000000}).ok());
}

TEST(PlacementTest, FullQueuesAreResourceExhaustedAndNoLiveWorkerIsUnavailable) {
  std::vector<Candidate> c = {Worker("a", 100, 100, 10), Worker("b", 100, 100, 9)};
  auto chosen = ChooseWorker(c, {.prompt_tokens = 10, .max_new_tokens = 10, .max_queue_depth = 1});
  EXPECT_EQ(chosen.status().code(), absl::StatusCode::kResourceExhausted);
  chosen = ChooseWorker(c, {.prompt_tokens = 10, .max_new_tokens = 10, .max_queue_depth = 2});
  ASSERT_TRUE(chosen.ok());
  EXPECT_EQ(c[*chosen].worker_id, "b");
  for (Candidate& x : c) x.live = false;
  EXPECT_EQ(ChooseWorker(c, {.prompt_tokens = 1, .max_new_tokens = 1}).status().code(),
            absl::StatusCode::kUnavailable);
}

// A group whose model slides every layer holds a sequence's window plus one prefill chunk,
// however long it runs: placement sizes it so, not by prompt + max_new_tokens.
TEST(PlacementTest, SlidingWindowGroupsAreSizedByTheWindow) {
  Candidate window = Worker("window", 20, 20);
  window.max_model_len = 32768;
  window.kv_window = 4096 / 16;  // 256 tokens
  window.prefill_chunk = 64;
  Candidate full = Worker("full", 20, 20);
  full.max_model_len = 32768;
  const PlacementRequest r{.prompt_tokens = 1000, .max_new_tokens = 9000};
  EXPECT_EQ(WorstCaseBlocks(full, r), 625);
  EXPECT_EQ(WorstCaseBlocks(window, r), 21);  // ceil((255 + 64) / 16) + 1
  window.prefill_chunk = 32;
  EXPECT_EQ(WorstCaseBlocks(window, r), 19);  // ceil((255 + 32) / 16) + 1
  // Never more than the whole sequence.
  EXPECT_EQ(WorstCaseBlocks(window, {.prompt_tokens = 20, .max_new_tokens = 10}), 2);
  std::vector<Candidate> c = {full, window};
  auto chosen = ChooseWorker(c, r);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_EQ(c[*chosen].worker_id, "window");
  // The full-attention group alone cannot ever hold it.
  std::vector<Candidate> only_full = {full};
  EXPECT_EQ(ChooseWorker(only_full, r).status().code(), absl::StatusCode::kInvalidArgument);
  // Nor a windowed pool smaller than the window; the message says the window.
  window.blocks_total = window.blocks_free = 10;
  std::vector<Candidate> small = {window};
  auto refused = ChooseWorker(small, r);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("19 KV blocks with its window of 256"),
            std::string::npos)
      << refused.status();
  // A worker that did not report its chunk counts the whole sequence as one step.
  window.prefill_chunk = 0;
  EXPECT_EQ(WorstCaseBlocks(window, {.prompt_tokens = 100, .max_new_tokens = 100}), 13);
}

}  // namespace
}  // namespace kvgrid::coordinator
