// The worker registry: ids are unique across coordinator restarts (the epoch is part of them),
// an id of another epoch is unknown (so its worker registers again instead of keeping another
// worker's entry fresh), a lost worker's KV usage is cleared, and a stalled worker is out of
// placement while its heartbeats say so.
#include "coordinator/registry.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::coordinator {
namespace {

v1::RegisterWorkerRequest Worker(const std::string& address) {
  v1::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_model("tiny");
  r.mutable_capacity()->set_block_size(16);
  r.mutable_capacity()->set_blocks_total(100);
  r.mutable_capacity()->set_max_model_len(1024);
  r.set_max_num_seqs(4);
  return r;
}

v1::HeartbeatRequest Beat(const std::string& id, int64_t blocks_used) {
  v1::HeartbeatRequest h;
  h.set_worker_id(id);
  h.mutable_usage()->set_blocks_free(100 - blocks_used);
  h.mutable_usage()->set_blocks_used(blocks_used);
  h.mutable_usage()->set_num_running(1);
  return h;
}

const v1::WorkerInfo* Find(const v1::ClusterStatusResponse& s, const std::string& id) {
  for (const v1::WorkerInfo& w : s.workers()) {
    if (w.worker_id() == id) return &w;
  }
  return nullptr;
}

TEST(RegistryTest, IdsCarryTheEpochAndAreUniqueAcrossRestarts) {
  WorkerRegistry first({.epoch = "aaaa"});
  const std::string a1 = first.Register(Worker("127.0.0.1:1"));
  const std::string b1 = first.Register(Worker("127.0.0.1:2"));
  EXPECT_EQ(a1, "w1-aaaa");
  EXPECT_EQ(b1, "w2-aaaa");

  // A restarted coordinator: worker B happens to register first.
  WorkerRegistry second({.epoch = "bbbb"});
  const std::string b2 = second.Register(Worker("127.0.0.1:2"));
  EXPECT_NE(b2, a1);
  EXPECT_NE(b2, b1);
  // A's heartbeat under its old id is unknown: it must register again, and must not keep
  // B's entry fresh.
  EXPECT_FALSE(second.Heartbeat(Beat(a1, 10)));
  EXPECT_FALSE(second.Heartbeat(Beat(b1, 10)));
  EXPECT_TRUE(second.Heartbeat(Beat(b2, 10)));
  const std::string a2 = second.Register(Worker("127.0.0.1:1"));
  EXPECT_NE(a2, b2);
  EXPECT_EQ(second.NumLive("tiny"), 2);
}

TEST(RegistryTest, RandomEpochsDiffer) {
  WorkerRegistry a({}), b({});
  EXPECT_FALSE(a.epoch().empty());
  EXPECT_NE(a.epoch(), b.epoch());
  EXPECT_NE(a.Register(Worker("127.0.0.1:1")), b.Register(Worker("127.0.0.1:1")));
}

TEST(RegistryTest, ReRegisteringAtTheSameAddressReplacesTheOldEntry) {
  WorkerRegistry r({.epoch = "e"});
  const std::string old_id = r.Register(Worker("127.0.0.1:1"));
  ASSERT_TRUE(r.Heartbeat(Beat(old_id, 30)));
  const std::string new_id = r.Register(Worker("127.0.0.1:1"));
  EXPECT_NE(new_id, old_id);
  EXPECT_FALSE(r.Heartbeat(Beat(old_id, 30)));  // the old entry is lost
  EXPECT_EQ(r.NumLive("tiny"), 1);
  v1::ClusterStatusResponse s;
  r.FillStatus(&s);
  const v1::WorkerInfo* old_w = Find(s, old_id);
  ASSERT_NE(old_w, nullptr);
  EXPECT_EQ(old_w->state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(old_w->usage().blocks_used(), 0);
}

TEST(RegistryTest, MarkLostClearsUsage) {
  WorkerRegistry r({.epoch = "e"});
  const std::string id = r.Register(Worker("127.0.0.1:1"));
  ASSERT_TRUE(r.Heartbeat(Beat(id, 42)));
  {
    v1::ClusterStatusResponse s;
    r.FillStatus(&s);
    ASSERT_NE(Find(s, id), nullptr);
    EXPECT_EQ(Find(s, id)->usage().blocks_used(), 42);
  }
  r.MarkLost(id);
  v1::ClusterStatusResponse s;
  r.FillStatus(&s);
  const v1::WorkerInfo* w = Find(s, id);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(w->usage().blocks_used(), 0);
  EXPECT_EQ(w->usage().num_running(), 0);
  EXPECT_EQ(w->usage().blocks_free(), 0);
  EXPECT_EQ(r.NumLive("tiny"), 0);
}

TEST(RegistryTest, ExpiredWorkersUsageIsCleared) {
  WorkerRegistry r({.heartbeat_timeout = absl::Milliseconds(1), .epoch = "e"});
  const std::string id = r.Register(Worker("127.0.0.1:1"));
  ASSERT_TRUE(r.Heartbeat(Beat(id, 42)));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(r.ExpireStale());
  v1::ClusterStatusResponse s;
  r.FillStatus(&s);
  const v1::WorkerInfo* w = Find(s, id);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(w->usage().blocks_used(), 0);
  EXPECT_EQ(w->usage().num_running(), 0);
  // A lost worker's heartbeat is refused: it registers again.
  EXPECT_FALSE(r.Heartbeat(Beat(id, 42)));
}

TEST(RegistryTest, AStalledWorkerIsNotPlacedOnUntilItsHeartbeatSaysOtherwise) {
  WorkerRegistry r({.epoch = "e"});
  const std::string id = r.Register(Worker("127.0.0.1:1"));
  v1::HeartbeatRequest stalled = Beat(id, 10);
  stalled.set_stalled(true);
  ASSERT_TRUE(r.Heartbeat(stalled));
  EXPECT_EQ(r.NumLive("tiny"), 0);
  {
    v1::ClusterStatusResponse s;
    r.FillStatus(&s);
    ASSERT_NE(Find(s, id), nullptr);
    EXPECT_EQ(Find(s, id)->state(), v1::WORKER_STATE_STALLED);
    EXPECT_EQ(Find(s, id)->usage().blocks_used(), 10);  // it still reports, unlike a lost one
  }
  const std::vector<int32_t> prompt = {1, 2, 3};
  EXPECT_FALSE(r.Place("tiny", prompt, 8, {}).ok());
  // Steps finish again: placed on as before, under the same id.
  ASSERT_TRUE(r.Heartbeat(Beat(id, 10)));
  EXPECT_EQ(r.NumLive("tiny"), 1);
  absl::StatusOr<WorkerRegistry::Placement> placed = r.Place("tiny", prompt, 8, {});
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->worker_id, id);
}

}  // namespace
}  // namespace kvgrid::coordinator
