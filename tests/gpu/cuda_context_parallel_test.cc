// Context parallelism on the CUDA backend, on one card: the ranks of a group are threads of
// this process, each with its own CudaLlamaModel and pool on the same device, their
// collectives staged through host memory over Gloo (HostStagedCommunicator; NCCL refuses two
// ranks on one card, and its path is the same model code with other collectives). Checked:
//   - CP groups of 2 and 3 ranks (each holding every C-th block of each sequence, attending
//     over its own and merging the shares by log-sum-exp after each layer) give one rank's
//     logits through prefills and padded decode steps, for fp32, int8 and fp16 KV; the other
//     ranks get none; a table entry on the wrong rank is refused by every rank alike;
//   - the engine over a two-rank CUDA CP group (the leader's engine, a follower in
//     RunFollower) gives the tokens of the engine on one CUDA model through swaps.
// Skipped, with a message, where no GPU is visible.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/gpu/cuda_engine_setup.h"
#include "tests/gpu/device_buffer.h"
#include "tests/gpu/test_models.h"
#include "tests/unit/comm/gloo_group.h"
#include "worker/comm/host_staged_communicator.h"
#include "worker/engine/engine.h"
#include "worker/engine/step_plan.h"
#include "worker/executor/cuda_executor.h"
#include "worker/executor/cuda_llama_model.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"

namespace kvgrid::worker {
namespace {

using kernels::KvDType;
using ::kvgrid::testing::ExpectClose;
using ::kvgrid::testing::Greedy;
using ::kvgrid::testing::GreedyOnOneCudaModel;
using ::kvgrid::testing::HaveGpu;
using ::kvgrid::testing::KjvTiny;
using ::kvgrid::testing::RunGroup;
using ::kvgrid::testing::kSwapTestKv;
using ::kvgrid::testing::SwappingEngineOptions;
using ::kvgrid::testing::SwappingPoolOptions;
using ::kvgrid::testing::TinyQwen;

constexpr int32_t kBlockSize = 16;
constexpr int32_t kBlocksPerRank = 12;

// The batches of one scenario, with the group's block ids of `cp_size` pools: three
// prefills (37, 20 and 9 tokens; 37 in chunks of 24 and 13), then 5 decode steps of the three
// sequences with fixed tokens.
std::vector<ForwardBatch> Scenario(int32_t cp_size, int64_t vocab) {
  BlockManager blocks({.num_blocks = kBlocksPerRank, .block_size = kBlockSize,
                       .cp_size = cp_size});
  std::vector<ForwardBatch> out;
  const std::vector<SequenceId> seqs = {1, 2, 3};
  std::vector<int64_t> positions = {37, 20, 9};
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<int32_t> prompt(positions[i]);
    for (int64_t t = 0; t < positions[i]; ++t) {
      prompt[t] = static_cast<int32_t>((t * 7919 + 11 * (i + 1)) % vocab);
    }
    EXPECT_TRUE(blocks.Reserve(seqs[i], positions[i] + 5).ok());
    if (i == 0) {  // chunked: the second chunk attends over the first's blocks on both ranks
      const std::span<const int32_t> all(prompt);
      out.push_back(SingleSequenceBatch(blocks, seqs[i], 0, all.first(24)));
      out.push_back(SingleSequenceBatch(blocks, seqs[i], 24, all.subspan(24)));
    } else {
      out.push_back(SingleSequenceBatch(blocks, seqs[i], 0, prompt));
    }
  }
  for (int step = 0; step < 5; ++step) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < 3; ++i) {
      tokens.push_back(static_cast<int32_t>((step * 131 + 5 * i) % vocab));
    }
    out.push_back(DecodeBatch(blocks, seqs, positions, tokens));
    for (int64_t& p : positions) ++p;
  }
  return out;
}

std::vector<std::vector<float>> RunBatches(CudaLlamaModel& model, KvDType kv,
                                    const std::vector<ForwardBatch>& batches) {
  std::vector<std::vector<float>> out;
  const KvGeometry g = model.KvGeometryFor(kBlockSize, kv, kv);
  auto pool = CudaKvPool::Create(g, kBlocksPerRank * g.BytesPerBlock());
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return out;
  EXPECT_EQ((*pool)->num_blocks(), kBlocksPerRank);
  std::vector<float> logits;
  for (const ForwardBatch& b : batches) {
    const absl::Status s = model.Forward(b, **pool, &logits);
    EXPECT_TRUE(s.ok()) << s;
    out.push_back(logits);
  }
  return out;
}

TEST(CudaContextParallelTest, RanksSplittingTheBlocksGiveOneRanksLogits) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen(512);
  const LlamaWeights weights = LlamaModel::RandomWeights(config, 7);
  // The merge changes only the order of the sums: fp32 KV to fp32 noise; the quantized and
  // 16-bit caches hold the same values on every rank, so they stay as close.
  for (auto [kv, tolerance] : {std::pair{KvDType::kF32, 1e-4}, std::pair{KvDType::kInt8, 1e-4},
                               std::pair{KvDType::kF16, 1e-3}}) {
    auto alone = CudaLlamaModel::FromWeights(config, weights, model::DType::kF32);
    ASSERT_TRUE(alone.ok()) << alone.status();
    (*alone)->SetDecodeGraphs(true);  // padded decode steps, as the group runs them
    const auto want = RunBatches(**alone, kv, Scenario(1, config.vocab_size));
    for (int cp : {2, 3}) {
      SCOPED_TRACE(absl::StrCat("cp ", cp, " kv ", std::string(kernels::KvDTypeName(kv))));
      const std::vector<ForwardBatch> batches = Scenario(cp, config.vocab_size);
      std::vector<std::vector<float>> got;
      RunGroup(cp, [&](int rank, Communicator& host) {
        HostStagedCommunicator device_comm(host);
        auto model = CudaLlamaModel::FromWeights(config, weights, model::DType::kF32);
        ASSERT_TRUE(model.ok()) << model.status();
        ASSERT_TRUE((*model)->SetContextParallel(rank, cp, &device_comm).ok());
        (*model)->SetDecodeGraphs(true);  // staged collectives: padded, kernel by kernel
        EXPECT_NE((*model)->decode_graph_stats().disabled_by, "");
        auto logits = RunBatches(**model, kv, batches);
        if (rank == 0) {
          got = std::move(logits);
        } else {
          for (const auto& step : logits) EXPECT_TRUE(step.empty()) << "rank " << rank;
        }
      });
      ExpectClose(got, want, tolerance);
    }
  }
}

TEST(CudaContextParallelTest, BadGroupsAndEntriesOnTheWrongRankAreRefused) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen(512);
  const LlamaWeights weights = LlamaModel::RandomWeights(config, 7);
  auto lone = CudaLlamaModel::FromWeights(config, weights, model::DType::kF32);
  ASSERT_TRUE(lone.ok());
  EXPECT_EQ((*lone)->SetContextParallel(0, 2, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*lone)->SetContextParallel(2, 2, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  RunGroup(2, [&](int rank, Communicator& host) {
    HostStagedCommunicator device_comm(host);
    auto model = CudaLlamaModel::FromWeights(config, weights, model::DType::kF32);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->SetContextParallel(rank, 2, &device_comm).ok());
    const KvGeometry g = (*model)->KvGeometryFor(kBlockSize, KvDType::kF16, KvDType::kF16);
    auto pool = CudaKvPool::Create(g, kBlocksPerRank * g.BytesPerBlock());
    ASSERT_TRUE(pool.ok());
    BlockManager blocks({.num_blocks = kBlocksPerRank, .block_size = kBlockSize, .cp_size = 2});
    ASSERT_TRUE(blocks.Reserve(1, 40).ok());
    std::vector<int32_t> prompt(40);
    for (int t = 0; t < 40; ++t) prompt[t] = 3 + t;
    ForwardBatch wrong = SingleSequenceBatch(blocks, 1, 0, prompt);
    wrong.block_tables[1] = wrong.block_tables[0];  // position 1 is rank 1's; this is rank 0's
    std::vector<float> logits;
    const absl::Status st = (*model)->Forward(wrong, **pool, &logits);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("block_tables[0][1]"), std::string::npos) << st;
    // Refused alike on both ranks before any collective: the group goes on.
    EXPECT_TRUE(
        (*model)->Forward(SingleSequenceBatch(blocks, 1, 0, prompt), **pool, &logits).ok());
    EXPECT_EQ(logits.empty(), rank != 0);
  });
}

// The engine on one CUDA model, and on a two-rank CUDA CP group whose ranks hold 3 blocks
// each: the same tokens, through preemption by swap (sequences of up to 35 tokens take three
// blocks of rank 0's, so the running ones outgrow it); the swap copies stay on their ranks.
TEST(CudaContextParallelTest, EngineOverTwoRanksGivesTheTokensOfOne) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  if (!std::filesystem::exists(KjvTiny() / "model.safetensors")) {
    GTEST_SKIP() << KjvTiny() << " not found (set KVGRID_SOURCE_DIR to the repository)";
  }
  const std::map<std::string, std::vector<int32_t>> alone = GreedyOnOneCudaModel(5, 16, 30);

  std::map<std::string, std::vector<int32_t>> group;
  RunGroup(2, [&](int rank, Communicator& host) {
    auto host_model = LlamaModel::Load(KjvTiny());
    ASSERT_TRUE(host_model.ok()) << host_model.status();
    const ContextParallel cp{.rank = rank, .size = 2, .comm = &host};
    auto device_comm = std::make_unique<HostStagedCommunicator>(host);
    auto model = CudaLlamaModel::FromWeights((*host_model)->config(), (*host_model)->weights(),
                                             model::DType::kF32);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE((*model)->SetContextParallel(rank, 2, device_comm.get()).ok());
    const KvGeometry g = (*model)->KvGeometryFor(8, kSwapTestKv, kSwapTestKv);
    auto executor = CudaExecutor::Create(*std::move(model), SwappingPoolOptions(g, 3, 8), {},
                                         nullptr, cp, std::move(device_comm));
    ASSERT_TRUE(executor.ok()) << executor.status();
    EXPECT_EQ((*executor)->context_parallel().size, 2);
    if (rank != 0) {
      EXPECT_TRUE(RunFollower(**executor, host).ok());
      return;
    }
    EngineOptions o = SwappingEngineOptions(g, 3, 8);
    o.group = &host;
    auto engine = Engine::Create(std::unique_ptr<Executor>(*std::move(executor)), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->Stats().blocks_total, 6);
    group = Greedy(**engine, 30);
    EXPECT_GT((*engine)->Stats().num_swap_outs, 0) << "the pools should be small enough to swap";
    EXPECT_TRUE((*engine)->StopFollowers().ok());
  });
  EXPECT_EQ(group, alone);
}

}  // namespace
}  // namespace kvgrid::worker
