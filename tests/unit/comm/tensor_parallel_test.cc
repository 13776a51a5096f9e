// Tensor parallelism in one process: Gloo collectives between threads, and a model sharded
// over 2 and 4 ranks (KV heads split, then replicated) whose logits match the whole model's.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/unit/comm/gloo_group.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/engine/engine.h"
#include "worker/engine/step_plan.h"
#include "worker/executor/cpu_executor.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {
namespace {

using ::kvgrid::testing::RunGroup;

TEST(GlooCommunicatorTest, Collectives) {
  RunGroup(3, [](int rank, Communicator& comm) {
    std::vector<float> v = {1.f * rank, 2.f, -1.f * rank};
    ASSERT_TRUE(comm.AllReduceSum(std::span<float>(v)).ok());
    EXPECT_EQ(v, (std::vector<float>{3.f, 6.f, -3.f}));
    std::vector<float> in = {10.f * rank, 10.f * rank + 1};
    std::vector<float> out(6);
    ASSERT_TRUE(comm.AllGather(in, std::span<float>(out)).ok());
    EXPECT_EQ(out, (std::vector<float>{0, 1, 10, 11, 20, 21}));
    std::string bytes;
    if (rank == 1) bytes = "the plan of step 7";
    ASSERT_TRUE(BroadcastBytes(comm, &bytes, 1).ok());
    EXPECT_EQ(bytes, "the plan of step 7");
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

// Setup exchanges: each rank's bytes (of different lengths, one empty) everywhere, and the
// group's smallest value (a GPU group's pool size).
// An in-memory store that overwrites keys, as the coordinator's does (Gloo's HashStore
// refuses to).
class OverwritingStore final : public gloo::rendezvous::Store {
 public:
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::MutexLock lock(&mu_);
    values_[key] = data;
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    absl::MutexLock lock(&mu_);
    return values_.at(key);
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::seconds(1));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (std::all_of(keys.begin(), keys.end(),
                        [&](const std::string& k) { return values_.contains(k); })) {
          return;
        }
      }
      if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("wait timed out");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<char>> values_ ABSL_GUARDED_BY(mu_);
};

// A rank whose group never formed (its peer came too late) leaves its keys in the store, and so
// does a group that formed but died before its leader registered (nothing erased them); the
// next attempt, whose ranks start at different moments (the follower first, or the leader),
// must not be misled by them.
TEST(GlooCommunicatorTest, AFailedAttemptDoesNotSpoilTheNext) {
  OverwritingStore store;
  auto alone = GlooCommunicator::Connect(1, 2, store, "127.0.0.1", std::chrono::milliseconds(300),
                                         /*join_timeout=*/std::chrono::milliseconds(300));
  ASSERT_FALSE(alone.ok());
  for (int attempt = 0; attempt < 4; ++attempt) {
    SCOPED_TRACE(attempt);
    const int first = attempt % 2;  // which rank starts first; the other 200 ms later
    absl::Status status[2];
    // Both kept until both returned: a rank done connecting may otherwise close its side while
    // the other still finishes its own.
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> comms[2];
    std::thread late([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comms[1 - first] =
          GlooCommunicator::Connect(1 - first, 2, store, "127.0.0.1", std::chrono::seconds(3));
      status[1 - first] = comms[1 - first].status();
    });
    comms[first] = GlooCommunicator::Connect(first, 2, store, "127.0.0.1", std::chrono::seconds(3));
    status[first] = comms[first].status();
    late.join();
    EXPECT_TRUE(status[0].ok()) << status[0];
    EXPECT_TRUE(status[1].ok()) << status[1];
  }
}

TEST(GlooCommunicatorTest, GatherBytesAndMinAcrossGroup) {
  RunGroup(3, [](int rank, Communicator& comm) {
    auto all = GatherBytes(comm, std::string(static_cast<size_t>(rank), 'a' + rank));
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(*all, (std::vector<std::string>{"", "b", "cc"}));
    const int64_t values[] = {int64_t{5} << 40, -3, 7};
    auto min = MinAcrossGroup(comm, values[rank]);
    ASSERT_TRUE(min.ok()) << min.status();
    EXPECT_EQ(*min, -3);
  });
}

// Logits of a 12-token prefill then one decode step.
std::vector<float> Logits(const std::string& fixture, TensorParallel tp) {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / fixture, tp);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  auto pool = KvPool::Create((*model)->KvGeometryFor(16, kernels::KvDType::kF32,
                                                     kernels::KvDType::kF32),
                             8 << 20);
  EXPECT_TRUE(pool.ok());
  BlockManager blocks((*pool)->num_blocks(), 16);
  EXPECT_TRUE(blocks.Reserve(1, 13).ok());
  std::vector<int32_t> prompt(12);
  std::iota(prompt.begin(), prompt.end(), 5);
  std::vector<float> logits, all;
  EXPECT_TRUE((*model)->Forward(SingleSequenceBatch(blocks, 1, 0, prompt), **pool, &logits).ok());
  all = logits;
  const int32_t next = 42;
  EXPECT_TRUE((*model)->Forward(SingleSequenceBatch(blocks, 1, 12, std::span(&next, 1)), **pool,
                                &logits).ok());
  all.insert(all.end(), logits.begin(), logits.end());
  return all;
}

TEST(TensorParallelTest, ShardedModelMatchesTheWholeModel) {
  // qwen3-tiny: per-head q/k norms replicated on every rank, head_dim 32 over hidden 64.
  for (const std::string fixture : {"llama3-tiny", "qwen2-tiny", "qwen3-tiny"}) {
    const std::vector<float> whole = Logits(fixture, {});
    ASSERT_FALSE(whole.empty());
    for (int size : {2, 4}) {
      std::vector<std::vector<float>> per_rank(size);
      RunGroup(size, [&](int rank, Communicator& comm) {
        per_rank[rank] = Logits(fixture, {.rank = rank, .size = size, .comm = &comm});
      });
      // Only the leader gets logits (it samples); the others computed their shares.
      for (int r = 1; r < size; ++r) EXPECT_TRUE(per_rank[r].empty());
      ASSERT_EQ(per_rank[0].size(), whole.size()) << fixture << " tp " << size;
      float max_rel = 0.f;
      for (size_t i = 0; i < whole.size(); ++i) {
        max_rel = std::max(max_rel, std::abs(per_rank[0][i] - whole[i]) /
                                        std::max(1.f, std::abs(whole[i])));
      }
      EXPECT_LT(max_rel, 1e-4f) << fixture << " tp " << size;
    }
  }
}

TEST(TensorParallelTest, ShardsHoldTheirShareAndBadSizesAreRefused) {
  const auto dir = std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny";
  auto whole = LlamaModel::Load(dir);
  ASSERT_TRUE(whole.ok());
  RunGroup(2, [&](int rank, Communicator& comm) {
    auto shard = LlamaModel::Load(dir, {.rank = rank, .size = 2, .comm = &comm});
    ASSERT_TRUE(shard.ok()) << shard.status();
    const auto g = (*shard)->KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32);
    EXPECT_EQ(g.num_kv_heads, 1);  // 2 KV heads over 2 ranks
    // Layers, embedding and head are split; only the norms are replicated.
    const double share = static_cast<double>((*shard)->WeightBytes()) /
                         static_cast<double>((*whole)->WeightBytes());
    EXPECT_NEAR(share, 0.5, 0.02);
  });
  auto bad = LlamaModel::Load(dir, {.rank = 0, .size = 3});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("num_attention_heads"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace kvgrid::worker

namespace kvgrid::worker {
namespace {

// Greedy outputs of a mixed batch on an engine over a model split `size` ways (size 1: no
// group), with a pool small enough to preempt by swapping.
std::map<std::string, std::vector<int32_t>> EngineOutputs(int size, EngineStats* stats) {
  const auto dir = std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny";
  EngineOptions options;
  // 16 blocks per rank (each rank's blocks hold its share of the KV heads).
  auto pool_bytes = [](const LlamaModel& m) {
    return 16 * m.KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32)
                    .BytesPerBlock();
  };
  options.swap_space = 64 << 20;
  options.max_num_batched_tokens = 64;       // chunked prefill
  std::map<std::string, std::vector<int32_t>> out;
  auto leader = [&](Communicator* comm) {
    auto model = LlamaModel::Load(dir, {.rank = 0, .size = size, .comm = comm});
    ASSERT_TRUE(model.ok()) << model.status();
    EngineOptions o = options;
    o.kv_cache_memory = pool_bytes(**model);
    o.group = size > 1 ? comm : nullptr;
    auto engine = Engine::Create(*std::move(model), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (int i = 0; i < 6; ++i) {
      GenerationRequest r;
      r.id = absl::StrCat("r", i);
      for (int j = 0; j < 20 + 9 * i; ++j) r.prompt.push_back(3 + (j * 7 + i) % 250);
      r.sampling.temperature = 0;
      r.stopping.max_new_tokens = 40;
      r.stopping.ignore_eos = true;
      ASSERT_TRUE((*engine)->AddRequest(r).ok());
    }
    while ((*engine)->HasWork()) {
      auto step = (*engine)->Step();
      ASSERT_TRUE(step.ok()) << step.status();
      for (const TokenOutput& t : *step) out[t.request_id].push_back(t.token_id);
    }
    *stats = (*engine)->Stats();
    ASSERT_TRUE((*engine)->StopFollowers().ok());
  };
  if (size == 1) {
    leader(nullptr);
    return out;
  }
  RunGroup(size, [&](int rank, Communicator& comm) {
    if (rank == 0) return leader(&comm);
    auto model = LlamaModel::Load(dir, {.rank = rank, .size = size, .comm = &comm});
    ASSERT_TRUE(model.ok());
    const int64_t kv_bytes = pool_bytes(**model);
    auto executor = CpuExecutor::Create(*std::move(model), {.block_size = 16,
                                                            .kv_cache_memory = kv_bytes,
                                                            .swap_space = options.swap_space});
    ASSERT_TRUE(executor.ok()) << executor.status();
    EXPECT_TRUE(RunFollower(**executor, comm).ok());
  });
  return out;
}

TEST(TensorParallelTest, EngineOverTwoRanksGivesTheSameTokensWithPreemption) {
  EngineStats alone_stats, group_stats;
  const auto alone = EngineOutputs(1, &alone_stats);
  const auto group = EngineOutputs(2, &group_stats);
  EXPECT_EQ(group, alone);
  EXPECT_EQ(group_stats.blocks_total, alone_stats.blocks_total);
  EXPECT_GT(group_stats.num_preemptions, 0) << "the pool should be small enough to preempt";
  EXPECT_EQ(group_stats.blocks_used, 0);
}

}  // namespace
}  // namespace kvgrid::worker
