// Tensor parallelism on the CUDA backend, on one card: the ranks of a group are threads of
// this process, each with its own CudaLlamaModel on the same device, their collectives staged
// through host memory over Gloo (HostStagedCommunicator; NCCL refuses two ranks on one card,
// and its path is the same model code with other collectives). Checked:
//   - a model sharded 2 and 4 ways (KV heads split, then replicated; the vocabulary split,
//     and replicated when it does not divide) gives the whole model's logits, for fp32 and
//     Q8_0 weights, and close ones for fp16 weights;
//   - the engine over a two-rank CUDA group (the leader's engine, a follower in RunFollower)
//     gives the tokens of the engine on one CUDA model, and the ranks agree on the pool size.
// Skipped, with a message, where no GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
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

// Logits of three prefills (37, 20 and 9 tokens) and then 5 decode steps of the three
// sequences with fixed tokens (so that every rank and every configuration computes the same
// batches), through `model` on a pool of its heads. With decode graphs on, the decode steps
// are padded to 4 rows (kernel by kernel in a staged group, which cannot capture).
std::vector<std::vector<float>> Steps(CudaLlamaModel& model, KvDType kv) {
  std::vector<std::vector<float>> out;
  const KvGeometry g = model.KvGeometryFor(16, kv, kv);
  auto pool = CudaKvPool::Create(g, 16 * g.BytesPerBlock());
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (!pool.ok()) return out;
  BlockManager blocks((*pool)->num_blocks(), 16);
  const int64_t vocab = model.config().vocab_size;
  const std::vector<SequenceId> seqs = {1, 2, 3};
  std::vector<int64_t> positions = {37, 20, 9};
  std::vector<float> logits;
  for (size_t i = 0; i < seqs.size(); ++i) {
    std::vector<int32_t> prompt(positions[i]);
    for (int64_t t = 0; t < positions[i]; ++t) {
      prompt[t] = static_cast<int32_t>((t * 7919 + 11 * (i + 1)) % vocab);
    }
    EXPECT_TRUE(blocks.Reserve(seqs[i], positions[i] + 5).ok());
    const absl::Status s =
        model.Forward(SingleSequenceBatch(blocks, seqs[i], 0, prompt), **pool, &logits);
    EXPECT_TRUE(s.ok()) << s;
    out.push_back(logits);
  }
  for (int step = 0; step < 5; ++step) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < 3; ++i) {
      tokens.push_back(static_cast<int32_t>((step * 131 + 5 * i) % vocab));
    }
    const absl::Status s =
        model.Forward(DecodeBatch(blocks, seqs, positions, tokens), **pool, &logits);
    EXPECT_TRUE(s.ok()) << s;
    out.push_back(logits);
    for (int64_t& p : positions) ++p;
  }
  return out;
}

// The whole model on the device, then the same weights sharded over `size` ranks; rank 0's
// logits must match, and the other ranks get none.
void CompareSharded(const model::ModelConfig& config, const LlamaWeights& full, int size,
                    model::DType dense, kernels::cpu::WeightDType weights, KvDType kv,
                    double tolerance, const std::string& what) {
  SCOPED_TRACE(what);
  auto whole_host = LlamaModel::FromWeights(config, full);
  ASSERT_TRUE(whole_host.ok()) << whole_host.status();
  ASSERT_TRUE((*whole_host)->QuantizeWeights(weights).ok());
  auto whole = CudaLlamaModel::FromWeights(config, (*whole_host)->weights(), dense);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const auto want = Steps(**whole, kv);

  std::vector<std::vector<float>> got;
  RunGroup(size, [&](int rank, Communicator& host) {
    auto shard = LlamaModel::ShardWeights(config, full, {.rank = rank, .size = size});
    ASSERT_TRUE(shard.ok()) << shard.status();
    auto host_model =
        LlamaModel::FromWeights(config, *std::move(shard),
                                {.rank = rank, .size = size, .comm = &host});
    ASSERT_TRUE(host_model.ok()) << host_model.status();
    ASSERT_TRUE((*host_model)->QuantizeWeights(weights).ok());
    HostStagedCommunicator device_comm(host);
    auto model = CudaLlamaModel::FromWeights(config, (*host_model)->weights(), dense,
                                             &device_comm);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ((*model)->dims().heads, config.num_attention_heads / size);
    // Padded decode steps (staged collectives: no capture), so that rank 0 reassembles the
    // gathered logits of 3 rows out of 4.
    (*model)->SetDecodeGraphs(true);
    auto logits = Steps(**model, kv);
    if (rank == 0) {
      got = std::move(logits);
    } else {
      for (const auto& step : logits) EXPECT_TRUE(step.empty()) << "rank " << rank;
    }
  });
  ExpectClose(got, want, tolerance);
}

TEST(CudaTensorParallelTest, ShardedModelMatchesTheWholeModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  using kernels::cpu::WeightDType;
  const model::ModelConfig config = TinyQwen(512);
  const LlamaWeights full = LlamaModel::RandomWeights(config, 7);
  // fp32 weights and KV: only the order of the sums differs.
  CompareSharded(config, full, 2, model::DType::kF32, WeightDType::kF32, KvDType::kF32, 1e-4,
                 "tp 2 (KV heads and vocabulary split)");
  CompareSharded(config, full, 4, model::DType::kF32, WeightDType::kF32, KvDType::kF32, 1e-4,
                 "tp 4 (KV heads replicated)");
  CompareSharded(config, full, 2, model::DType::kF32, WeightDType::kQ8_0, KvDType::kInt8, 1e-4,
                 "tp 2, Q8_0 weights, int8 KV");
  // fp16 weights round the activations before each GEMM; the rounding points are the same,
  // but a value near a rounding boundary may fall either way.
  CompareSharded(config, full, 2, model::DType::kF16, WeightDType::kF32, KvDType::kF16, 2e-2,
                 "tp 2, fp16 weights and KV");
  const model::ModelConfig odd = TinyQwen(511);
  CompareSharded(odd, LlamaModel::RandomWeights(odd, 9), 2, model::DType::kF32,
                 WeightDType::kF32, KvDType::kF32, 1e-4,
                 "tp 2, vocabulary of 511: embedding and head replicated");
}

TEST(CudaTensorParallelTest, StagedGroupsRunWithoutGraphs) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen(512);
  const LlamaWeights full = LlamaModel::RandomWeights(config, 7);
  RunGroup(2, [&](int rank, Communicator& host) {
    auto shard = LlamaModel::ShardWeights(config, full, {.rank = rank, .size = 2});
    ASSERT_TRUE(shard.ok());
    HostStagedCommunicator device_comm(host);
    auto model = CudaLlamaModel::FromWeights(config, *shard, model::DType::kF32, &device_comm);
    ASSERT_TRUE(model.ok()) << model.status();
    (*model)->SetDecodeGraphs(true);
    EXPECT_NE((*model)->decode_graph_stats().disabled_by, "");
    Steps(**model, KvDType::kF16);
    EXPECT_EQ((*model)->decode_graph_stats().captures, 0);
    EXPECT_EQ((*model)->decode_graph_stats().replays, 0);
    EXPECT_EQ((*model)->decode_graph_stats().eager_steps, 3 + 5);
  });
}

// The engine on one CUDA model, and on a two-rank CUDA group whose ranks were offered pools
// of different sizes: the group takes the smaller, and the tokens are the same, through
// preemption by swap.
TEST(CudaTensorParallelTest, EngineOverTwoRanksGivesTheTokensOfOne) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  if (!std::filesystem::exists(KjvTiny() / "model.safetensors")) {
    GTEST_SKIP() << KjvTiny() << " not found (set KVGRID_SOURCE_DIR to the repository)";
  }
  const std::map<std::string, std::vector<int32_t>> alone = GreedyOnOneCudaModel(5, 16, 12);

  std::map<std::string, std::vector<int32_t>> group;
  RunGroup(2, [&](int rank, Communicator& host) {
    const TensorParallel tp{.rank = rank, .size = 2, .comm = &host};
    auto host_model = LlamaModel::Load(KjvTiny(), tp);
    ASSERT_TRUE(host_model.ok()) << host_model.status();
    auto device_comm = std::make_unique<HostStagedCommunicator>(host);
    auto model = CudaLlamaModel::FromWeights((*host_model)->config(), (*host_model)->weights(),
                                             model::DType::kF32, device_comm.get());
    ASSERT_TRUE(model.ok()) << model.status();
    const KvGeometry g = (*model)->KvGeometryFor(8, kSwapTestKv, kSwapTestKv);
    // Rank 1 is offered a larger pool and swap space; the group takes rank 0's.
    const CudaExecutor::PoolOptions offered =
        rank == 0 ? SwappingPoolOptions(g, 5, 16) : SwappingPoolOptions(g, 9, 20);
    auto executor = CudaExecutor::Create(*std::move(model), offered, tp, std::move(device_comm));
    ASSERT_TRUE(executor.ok()) << executor.status();
    EXPECT_EQ((*executor)->num_blocks(), 5) << "rank " << rank;
    EXPECT_EQ((*executor)->num_swap_blocks(), 16) << "rank " << rank;
    if (rank != 0) {
      EXPECT_TRUE(RunFollower(**executor, host).ok());
      return;
    }
    EngineOptions o = SwappingEngineOptions(g, 5, 16);
    o.group = &host;
    auto engine = Engine::Create(std::unique_ptr<Executor>(*std::move(executor)), o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    group = Greedy(**engine);
    EXPECT_GT((*engine)->Stats().num_swap_outs, 0);
    EXPECT_TRUE((*engine)->StopFollowers().ok());
  });
  EXPECT_EQ(group, alone);
}

}  // namespace
}  // namespace kvgrid::worker
