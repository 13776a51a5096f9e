// Context parallelism in one process: C ranks on threads, joined by Gloo, each holding every
// C-th block of each sequence in its own pool, give the logits of one rank holding them all,
// through chunked prefill, a batch mixing prefill and decode, a prefix hit and a sliding
// window, for every KV dtype; alone and times tensor parallelism (T x C ranks); and an engine
// over such groups gives one worker's greedy tokens through swaps, recomputes and forks.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "gloo/rendezvous/hash_store.h"
#include "tests/unit/comm/gloo_group.h"
#include "worker/comm/gloo_worker_group.h"
#include "worker/engine/engine.h"
#include "worker/engine/step_plan.h"
#include "worker/executor/cpu_executor.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {
namespace {

using ::kvgrid::testing::RunGroup;

constexpr int32_t kBlockSize = 8;

// Runs body(group) on tp x cp threads, each a rank of one GlooWorkerGroup.
void RunTpCpGroup(int tp, int cp, const std::function<void(GlooWorkerGroup&)>& body) {
  gloo::rendezvous::HashStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < tp * cp; ++r) {
    threads.emplace_back([&, r] {
      auto g = GlooWorkerGroup::Connect(r, tp, cp, store, "127.0.0.1", std::chrono::seconds(60));
      ASSERT_TRUE(g.ok()) << g.status();
      body(**g);
    });
  }
  for (std::thread& t : threads) t.join();
}

// Part of one sequence in a batch: tokens at positions [begin, begin + tokens.size()).
struct Part {
  SequenceId seq;
  int64_t begin;
  std::vector<int32_t> tokens;
};

// A batch of parts with logits for every token, its ids taken from `blocks`.
ForwardBatch Batch(const BlockManager& blocks, const std::vector<Part>& parts) {
  ForwardBatch b;
  b.query_start = {0};
  for (const Part& p : parts) {
    b.max_blocks_per_seq = std::max<int64_t>(
        b.max_blocks_per_seq, static_cast<int64_t>(blocks.BlockTable(p.seq).size()));
  }
  for (const Part& p : parts) {
    for (size_t i = 0; i < p.tokens.size(); ++i) {
      const int64_t pos = p.begin + static_cast<int64_t>(i);
      b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()));
      b.token_ids.push_back(p.tokens[i]);
      b.positions.push_back(static_cast<int32_t>(pos));
      b.slots.push_back(blocks.Slot(p.seq, pos));
    }
    b.query_start.push_back(static_cast<int32_t>(b.token_ids.size()));
    b.seq_lens.push_back(static_cast<int32_t>(p.begin + static_cast<int64_t>(p.tokens.size())));
    std::vector<int32_t> table = blocks.BlockTable(p.seq);
    table.resize(b.max_blocks_per_seq, 0);
    b.block_tables.insert(b.block_tables.end(), table.begin(), table.end());
  }
  return b;
}

std::vector<int32_t> Tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = 3 + static_cast<int32_t>((i * 7 + seed * 13) % 250);
  return t;
}

// The batches of one scenario, built against a manager of `cp_size` pools of `per_rank`
// blocks: sequence 1 (70 tokens) prefilled in chunks of 24; sequence 2 shares its first 32
// tokens through the prefix cache and prefills the rest beside sequence 1's first decode
// step; then both decode 5 tokens side by side.
std::vector<ForwardBatch> Scenario(int32_t cp_size, int32_t per_rank) {
  BlockManager blocks({.num_blocks = per_rank, .block_size = kBlockSize,
                       .prefix_caching = true, .cp_size = cp_size});
  std::vector<ForwardBatch> out;
  const std::vector<int32_t> a = Tokens(70, 1);
  EXPECT_TRUE(blocks.Allocate(1, a, 70 + 8).ok());
  for (int64_t begin = 0; begin < 70; begin += 24) {
    const int64_t end = std::min<int64_t>(70, begin + 24);
    out.push_back(Batch(blocks, {{1, begin, {a.begin() + begin, a.begin() + end}}}));
  }
  blocks.CommitFullBlocks(1, a, 70);
  std::vector<int32_t> b = a;
  b.resize(32);
  const std::vector<int32_t> tail = Tokens(19, 2);
  b.insert(b.end(), tail.begin(), tail.end());
  auto hit = blocks.Allocate(2, b, static_cast<int64_t>(b.size()) + 8);
  EXPECT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(*hit, 32);
  out.push_back(Batch(blocks, {{1, 70, {5}}, {2, 32, {b.begin() + 32, b.end()}}}));
  for (int32_t step = 1; step <= 5; ++step) {
    out.push_back(Batch(blocks, {{1, 70 + step, {9 + step}},
                                 {2, static_cast<int64_t>(b.size()) + step - 1, {17 + step}}}));
  }
  return out;
}

// Rank `cp.rank`'s logits over `batches` (empty on ranks other than 0).
std::vector<float> RunBatches(const std::string& fixture, kernels::KvDType dtype,
                              int32_t per_rank, const std::vector<ForwardBatch>& batches,
                              ContextParallel cp, TensorParallel tp = {}) {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / fixture, tp);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  // Exact int8 arithmetic: the fast path rounds softmax weights against each chunk's
  // maximum, and the chunks differ with the rank's share of the context.
  (*model)->SetAttentionPrecision(kernels::cpu::KvKernelPrecision::kExact);
  EXPECT_TRUE((*model)->SetContextParallel(cp).ok());
  const KvGeometry g = (*model)->KvGeometryFor(kBlockSize, dtype, dtype);
  auto pool = KvPool::Create(g, per_rank * g.BytesPerBlock());
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return {};
  EXPECT_EQ((*pool)->num_blocks(), per_rank);
  std::vector<float> all, logits;
  for (const ForwardBatch& b : batches) {
    absl::Status st = (*model)->Forward(b, **pool, &logits);
    EXPECT_TRUE(st.ok()) << st;
    all.insert(all.end(), logits.begin(), logits.end());
  }
  return all;
}

float MaxRelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  float max_rel = 0.f;
  for (size_t i = 0; i < want.size(); ++i) {
    max_rel = std::max(max_rel, std::abs(got[i] - want[i]) / std::max(1.f, std::abs(want[i])));
  }
  return max_rel;
}

TEST(ContextParallelTest, RanksSplittingTheBlocksGiveOneRanksLogits) {
  struct Case {
    std::string fixture;
    kernels::KvDType dtype;
    float tolerance;
  };
  const std::vector<Case> cases = {
      {"llama3-tiny", kernels::KvDType::kF32, 1e-4f},
      {"qwen2-tiny", kernels::KvDType::kF32, 1e-4f},
      {"qwen3-tiny", kernels::KvDType::kF32, 1e-4f},
      {"mistral-window-tiny", kernels::KvDType::kF32, 1e-4f},
      // Each rank quantizes and dequantizes only its own blocks, as one rank would. The merge
      // sums in another order, and a hidden state 1e-7 off can round a stored K or V value
      // to the neighbouring step of its dtype, which moves the logits by about that step
      // (measured: f16 8.6e-4 at steps of 2^-11, int8 1.2e-2 at 1/127), so these agree to a
      // few steps of the dtype, not to 1e-4. Leaving the merge out is off by about 35.
      {"llama3-tiny", kernels::KvDType::kF16, 5e-3f},
      {"llama3-tiny", kernels::KvDType::kBF16, 2e-2f},
      {"llama3-tiny", kernels::KvDType::kInt8, 5e-2f},
      {"llama3-tiny", kernels::KvDType::kInt4, 0.1f},
      {"llama3-tiny", kernels::KvDType::kFp8E4m3, 0.1f},
  };
  constexpr int32_t kGroupBlocks = 24;  // the scenario needs 19
  for (const Case& c : cases) {
    const std::vector<float> whole =
        RunBatches(c.fixture, c.dtype, kGroupBlocks, Scenario(1, kGroupBlocks), {});
    ASSERT_FALSE(whole.empty()) << c.fixture;
    for (int32_t cp : {2, 3, 4}) {
      SCOPED_TRACE(c.fixture + " kv " + std::to_string(static_cast<int>(c.dtype)) + " cp " +
                   std::to_string(cp));
      const int32_t per_rank = kGroupBlocks / cp;
      const std::vector<ForwardBatch> batches = Scenario(cp, per_rank);
      std::vector<std::vector<float>> per(cp);
      RunGroup(cp, [&](int rank, Communicator& comm) {
        per[rank] = RunBatches(c.fixture, c.dtype, per_rank, batches,
                               {.rank = rank, .size = cp, .comm = &comm});
      });
      for (int r = 1; r < cp; ++r) EXPECT_TRUE(per[r].empty()) << "rank " << r;
      ASSERT_EQ(per[0].size(), whole.size());
      EXPECT_LT(MaxRelativeError(per[0], whole), c.tolerance);
    }
  }
}

TEST(ContextParallelTest, TensorTimesContextParallelGroupsGiveOneRanksLogits) {
  // llama3-tiny and qwen2-tiny have 2 KV heads: tp 2 splits them, cp 2 splits the blocks.
  constexpr int32_t kGroupBlocks = 24;
  for (const std::string fixture : {"llama3-tiny", "qwen2-tiny"}) {
    const std::vector<float> whole = RunBatches(fixture, kernels::KvDType::kF32, kGroupBlocks,
                                                Scenario(1, kGroupBlocks), {});
    ASSERT_FALSE(whole.empty());
    for (auto [tp, cp] : {std::pair{2, 2}, std::pair{2, 3}}) {
      SCOPED_TRACE(fixture + " tp " + std::to_string(tp) + " cp " + std::to_string(cp));
      const int32_t per_rank = kGroupBlocks / cp;
      const std::vector<ForwardBatch> batches = Scenario(cp, per_rank);
      std::vector<std::vector<float>> per(tp * cp);
      RunTpCpGroup(tp, cp, [&](GlooWorkerGroup& g) {
        per[g.cp_rank() * tp + g.tp_rank()] =
            RunBatches(fixture, kernels::KvDType::kF32, per_rank, batches,
                       {.rank = g.cp_rank(), .size = cp, .comm = g.cp()},
                       {.rank = g.tp_rank(), .size = tp, .comm = g.tp()});
      });
      for (size_t r = 1; r < per.size(); ++r) EXPECT_TRUE(per[r].empty()) << "rank " << r;
      ASSERT_EQ(per[0].size(), whole.size());
      EXPECT_LT(MaxRelativeError(per[0], whole), 1e-4f);
    }
  }
}

TEST(ContextParallelTest, BadGroupsAndSlotsOutsideTheGroupAreRefused) {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny");
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->SetContextParallel({.rank = 2, .size = 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->SetContextParallel({.rank = 0, .size = 2}).code(),
            absl::StatusCode::kInvalidArgument);  // no communicator
  RunGroup(2, [&](int rank, Communicator& comm) {
    auto m = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny");
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->SetContextParallel({.rank = rank, .size = 2, .comm = &comm}).ok());
    const KvGeometry g =
        (*m)->KvGeometryFor(kBlockSize, kernels::KvDType::kF32, kernels::KvDType::kF32);
    auto pool = KvPool::Create(g, 4 * g.BytesPerBlock());
    ASSERT_TRUE(pool.ok());
    BlockManager blocks({.num_blocks = 4, .block_size = kBlockSize, .cp_size = 2});
    ASSERT_TRUE(blocks.Reserve(1, 20).ok());
    ForwardBatch b = Batch(blocks, {{1, 0, Tokens(20, 3)}});
    b.slots[3] = int64_t{2} * 4 * kBlockSize;  // past the group's last slot
    std::vector<float> logits;
    absl::Status st = (*m)->Forward(b, **pool, &logits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("slots[3]"), std::string::npos) << st;
    // Entries inside the group but on the wrong rank are refused by every rank before the
    // first collective, so no rank is left waiting and the next good step runs.
    ForwardBatch wrong_table = Batch(blocks, {{1, 0, Tokens(20, 3)}});
    ASSERT_EQ(wrong_table.max_blocks_per_seq, 3);
    wrong_table.block_tables[1] = 1;  // position 1 lives on rank 1 (ids 4..7); 1 is rank 0's
    st = (*m)->Forward(wrong_table, **pool, &logits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("block_tables[0][1] = 1"), std::string::npos) << st;
    ForwardBatch wrong_slot = Batch(blocks, {{1, 0, Tokens(20, 3)}});
    wrong_slot.slots[9] = 2 * kBlockSize;  // position 9 is in table entry 1, rank 1's
    st = (*m)->Forward(wrong_slot, **pool, &logits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("slots[9]"), std::string::npos) << st;
    EXPECT_TRUE((*m)->Forward(Batch(blocks, {{1, 0, Tokens(20, 3)}}), **pool, &logits).ok());
  });
}

TEST(ContextParallelTest, ExecutorsRefuseCopiesAcrossRanksAndSwapsWithoutSwapSpace) {
  RunGroup(2, [&](int rank, Communicator& comm) {
    auto m = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny");
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->SetContextParallel({.rank = rank, .size = 2, .comm = &comm}).ok());
    const int64_t block_bytes =
        (*m)->KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32).BytesPerBlock();
    auto executor =
        CpuExecutor::Create(*std::move(m), {.block_size = 16, .kv_cache_memory = 4 * block_bytes});
    ASSERT_TRUE(executor.ok()) << executor.status();
    ASSERT_EQ((*executor)->num_blocks(), 4);
    // Ids 0..3 are rank 0's, 4..7 rank 1's: a copy within a rank is fine on both ranks.
    const std::vector<BlockCopy> same = {{1, 2}, {5, 6}};
    EXPECT_TRUE((*executor)->CopyBlocks(BlockCopyKind::kDeviceToDevice, same).ok());
    const std::vector<BlockCopy> crossing = {{1, 2}, {3, 4}};
    absl::Status st = (*executor)->CopyBlocks(BlockCopyKind::kDeviceToDevice, crossing);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("crosses context-parallel ranks 0 and 1"), std::string::npos)
        << st;
    const std::vector<BlockCopy> outside = {{0, 8}};
    EXPECT_EQ((*executor)->CopyBlocks(BlockCopyKind::kDeviceToDevice, outside).code(),
              absl::StatusCode::kInvalidArgument);
    const std::vector<BlockCopy> swap = {{0, 0}};
    EXPECT_EQ((*executor)->CopyBlocks(BlockCopyKind::kDeviceToSwap, swap).code(),
              absl::StatusCode::kFailedPrecondition);
  });
}

// Greedy outputs of requests that share prefixes, one of them with n = 2, on an engine whose
// group of `cp` ranks holds `group_blocks` blocks in all, few enough to preempt.
std::map<std::string, std::vector<int32_t>> EngineOutputs(int cp, int32_t group_blocks,
                                                          PreemptionMode mode,
                                                          EngineStats* stats, int tp = 1,
                                                          const std::string& fixture =
                                                              "llama3-tiny") {
  const auto dir = std::filesystem::path(KVGRID_FIXTURES_DIR) / fixture;
  auto pool_bytes = [&](const LlamaModel& m) {
    return (group_blocks / cp) *
           m.KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32).BytesPerBlock();
  };
  EngineOptions options;
  options.swap_space = 64 << 20;
  options.max_num_batched_tokens = 64;  // chunked prefill
  options.preemption_mode = mode;
  std::map<std::string, std::vector<int32_t>> out;
  // Rank `rank` of the group (null for one worker).
  auto load = [&](GlooWorkerGroup* g) {
    TensorParallel shard;
    if (g != nullptr && tp > 1) shard = {.rank = g->tp_rank(), .size = tp, .comm = g->tp()};
    auto model = LlamaModel::Load(dir, shard);
    EXPECT_TRUE(model.ok()) << model.status();
    if (model.ok() && cp > 1) {
      EXPECT_TRUE(
          (*model)->SetContextParallel({.rank = g->cp_rank(), .size = cp, .comm = g->cp()}).ok());
    }
    return model;
  };
  auto leader = [&](GlooWorkerGroup* g) {
    Communicator* comm = g ? &g->group() : nullptr;
    auto model = load(g);
    ASSERT_TRUE(model.ok());
    EngineOptions o = options;
    o.kv_cache_memory = pool_bytes(**model);
    o.group = comm;
    auto engine = Engine::Create(*std::move(model), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<int32_t> shared;
    for (int j = 0; j < 40; ++j) shared.push_back(3 + (j * 11) % 250);
    for (int i = 0; i < 6; ++i) {
      GenerationRequest r;
      r.id = absl::StrCat("r", i);
      if (i % 2 == 1) r.prompt = shared;  // a 32-token prefix hit for the later ones
      for (int j = 0; j < 20 + 9 * i; ++j) r.prompt.push_back(3 + (j * 7 + i) % 250);
      r.sampling.temperature = 0;
      r.stopping.max_new_tokens = 40;
      r.stopping.ignore_eos = true;
      if (i == 2) r.n = 2;
      ASSERT_TRUE((*engine)->AddRequest(r).ok());
    }
    while ((*engine)->HasWork()) {
      auto step = (*engine)->Step();
      ASSERT_TRUE(step.ok()) << step.status();
      for (const TokenOutput& t : *step) {
        out[absl::StrCat(t.request_id, "/", t.index)].push_back(t.token_id);
      }
    }
    *stats = (*engine)->Stats();
    if (comm != nullptr) {
      ASSERT_TRUE((*engine)->StopFollowers().ok());
    }
  };
  if (cp * tp == 1) {
    leader(nullptr);
    return out;
  }
  RunTpCpGroup(tp, cp, [&](GlooWorkerGroup& g) {
    if (g.tp_rank() == 0 && g.cp_rank() == 0) return leader(&g);
    Communicator& comm = g.group();
    auto model = load(&g);
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

TEST(ContextParallelEngineTest, GroupsGiveOneRanksTokensThroughSwapsRecomputesAndForks) {
  constexpr int32_t kGroupBlocks = 24;
  for (PreemptionMode mode : {PreemptionMode::kSwap, PreemptionMode::kRecompute}) {
    EngineStats alone_stats;
    const auto alone = EngineOutputs(1, kGroupBlocks, mode, &alone_stats);
    ASSERT_EQ(alone.size(), 7u);  // six requests, one of them with two continuations
    for (auto [tp, cp] : {std::pair{1, 2}, std::pair{1, 3}, std::pair{1, 4}, std::pair{2, 2}}) {
      SCOPED_TRACE(absl::StrCat("tp ", tp, " cp ", cp, " mode ", static_cast<int>(mode)));
      EngineStats st;
      const auto group = EngineOutputs(cp, kGroupBlocks, mode, &st, tp);
      EXPECT_EQ(group, alone);
      EXPECT_EQ(st.blocks_total, kGroupBlocks);
      EXPECT_EQ(st.tokens_capacity, alone_stats.tokens_capacity);
      EXPECT_GT(st.num_preemptions, 0) << "the pools should be small enough to preempt";
      EXPECT_GT(mode == PreemptionMode::kSwap ? st.num_swap_outs : st.num_recomputes, 0);
      EXPECT_GT(st.prefix_hit_tokens, 0);
      EXPECT_GT(st.cow_copies, 0);
      EXPECT_EQ(st.blocks_used, 0) << "leak";
      EXPECT_EQ(st.swap_blocks_used, 0) << "swap leak";
    }
  }
}

// A sliding-window model (window 24): the blocks that fall out of the window go back to
// each rank's pool as the sequences decode, and the tokens stay one rank's.
TEST(ContextParallelEngineTest, SlidingWindowGroupsGiveOneRanksTokens) {
  constexpr int32_t kGroupBlocks = 24;
  EngineStats alone_stats;
  const auto alone =
      EngineOutputs(1, kGroupBlocks, PreemptionMode::kRecompute, &alone_stats, 1,
                    "mistral-window-tiny");
  ASSERT_EQ(alone.size(), 7u);
  EXPECT_EQ(alone_stats.kv_window, 24);
  for (int cp : {2, 3}) {
    SCOPED_TRACE(absl::StrCat("cp ", cp));
    EngineStats st;
    const auto group =
        EngineOutputs(cp, kGroupBlocks, PreemptionMode::kRecompute, &st, 1, "mistral-window-tiny");
    EXPECT_EQ(group, alone);
    EXPECT_EQ(st.blocks_total, kGroupBlocks);
    EXPECT_EQ(st.blocks_used, 0) << "leak";
  }
}

// Pools of different sizes: a context-parallel group refuses to start on every rank, naming
// the flags; a tensor-parallel group plans with the smaller pool.
TEST(ContextParallelEngineTest, RanksAgreeOnTheirPoolsBeforeTheFirstStep) {
  const auto dir = std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny";
  for (const bool context_parallel : {true, false}) {
    SCOPED_TRACE(context_parallel ? "cp 2" : "tp 2");
    const int tp = context_parallel ? 1 : 2, cp = context_parallel ? 2 : 1;
    RunTpCpGroup(tp, cp, [&](GlooWorkerGroup& g) {
      TensorParallel shard;
      if (tp > 1) shard = {.rank = g.tp_rank(), .size = tp, .comm = g.tp()};
      auto model = LlamaModel::Load(dir, shard);
      ASSERT_TRUE(model.ok()) << model.status();
      if (cp > 1) {
        ASSERT_TRUE(
            (*model)->SetContextParallel({.rank = g.cp_rank(), .size = cp, .comm = g.cp()}).ok());
      }
      const int64_t block_bytes =
          (*model)->KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32)
              .BytesPerBlock();
      const int64_t blocks = g.group().rank() == 0 ? 9 : 6;  // the leader's is larger
      if (g.group().rank() != 0) {
        auto executor = CpuExecutor::Create(
            *std::move(model), {.block_size = 16, .kv_cache_memory = blocks * block_bytes});
        ASSERT_TRUE(executor.ok()) << executor.status();
        const absl::Status st = RunFollower(**executor, g.group());
        if (context_parallel) {
          EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
        } else {
          EXPECT_TRUE(st.ok()) << st;
        }
        return;
      }
      EngineOptions o;
      o.kv_cache_memory = blocks * block_bytes;
      o.group = &g.group();
      auto engine = Engine::Create(*std::move(model), o);
      if (context_parallel) {
        ASSERT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_NE(engine.status().message().find("--kv-cache-memory"), std::string::npos)
            << engine.status();
        EXPECT_NE(engine.status().message().find("rank 1 holds 6"), std::string::npos)
            << engine.status();
        return;
      }
      ASSERT_TRUE(engine.ok()) << engine.status();
      EXPECT_EQ((*engine)->Stats().blocks_total, 6);
      EXPECT_TRUE((*engine)->StopFollowers().ok());
    });
  }
}

}  // namespace
}  // namespace kvgrid::worker
