// The engine on the GPU executor against the engine on the CPU: the same greedy tokens for the
// trained model, with preemption by swap through pinned host memory; pool sizing by
// --gpu-memory-utilization; bad block copies refused. Skipped without a device.
#include "worker/executor/cuda_executor.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/gpu/device_buffer.h"
#include "tests/gpu/test_models.h"
#include "worker/engine/engine.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::worker {
namespace {

using ::kvgrid::testing::Greedy;
using ::kvgrid::testing::HaveGpu;
using ::kvgrid::testing::KjvTiny;

// fp16 KV, and int8 K / int4 V, whose scale planes must travel with the values.
class CudaExecutorSwapTest
    : public ::testing::TestWithParam<std::pair<kernels::KvDType, kernels::KvDType>> {};

TEST_P(CudaExecutorSwapTest, EngineOnTheGpuGivesTheCpuTokensWithSwaps) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const auto [k_dtype, v_dtype] = GetParam();
  auto cpu_model = LlamaModel::Load(KjvTiny());
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  // The CPU engine runs the exact attention kernels the device is compared with.
  (*cpu_model)->SetAttentionPrecision(kernels::cpu::KvKernelPrecision::kExact);
  (*cpu_model)->SetLinearPrecision(kernels::cpu::LinearPrecision::kExact);
  auto gpu_model =
      CudaLlamaModel::FromWeights((*cpu_model)->config(), (*cpu_model)->weights(),
                                  model::DType::kF32);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();

  // Four sequences of up to 17 tokens (3 blocks of 8) in a pool of 5 blocks: swaps certain.
  const KvGeometry g = (*cpu_model)->KvGeometryFor(8, k_dtype, v_dtype);
  EngineOptions options;
  options.block_size = 8;
  options.k_dtype = k_dtype;
  options.v_dtype = v_dtype;
  options.kv_cache_memory = 5 * g.BytesPerBlock();
  options.swap_space = 16 * g.BytesPerBlock();
  options.watermark = 0;
  options.preemption_mode = PreemptionMode::kSwap;

  auto gpu = CudaExecutor::Create(*std::move(gpu_model),
                                  {.block_size = 8,
                                   .k_dtype = k_dtype,
                                   .v_dtype = v_dtype,
                                   .kv_cache_memory = options.kv_cache_memory,
                                   .swap_space = options.swap_space});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_EQ((*gpu)->num_blocks(), 5);
  EXPECT_EQ((*gpu)->num_swap_blocks(), 16);
  const CudaLlamaModel& model_on_gpu = (*gpu)->model();
  auto gpu_engine = Engine::Create(std::unique_ptr<Executor>(*std::move(gpu)), options);
  ASSERT_TRUE(gpu_engine.ok()) << gpu_engine.status();
  auto cpu_engine = Engine::Create(*std::move(cpu_model), options);
  ASSERT_TRUE(cpu_engine.ok()) << cpu_engine.status();

  const auto on_cpu = Greedy(**cpu_engine);
  const auto on_gpu = Greedy(**gpu_engine);
  EXPECT_EQ(on_gpu, on_cpu);
  EXPECT_GT((*gpu_engine)->Stats().num_swap_outs, 0);
  EXPECT_EQ((*gpu_engine)->Stats().num_swap_outs, (*cpu_engine)->Stats().num_swap_outs);
  // Creation reserved the block tables and attention partials of every step the pool allows:
  // no buffer moved as sequences grew, so no decode graph was dropped for it.
  EXPECT_EQ(model_on_gpu.decode_graph_stats().buffer_moves, 0);
}

INSTANTIATE_TEST_SUITE_P(KvDTypes, CudaExecutorSwapTest,
                         ::testing::Values(std::pair{kernels::KvDType::kF16,
                                                     kernels::KvDType::kF16},
                                           std::pair{kernels::KvDType::kInt8,
                                                     kernels::KvDType::kInt4},
                                           std::pair{kernels::KvDType::kFp8E4m3,
                                                     kernels::KvDType::kFp8E4m3}),
                         [](const auto& info) {
                           const std::string k(kernels::KvDTypeName(info.param.first));
                           const std::string v(kernels::KvDTypeName(info.param.second));
                           return absl::StrCat(k, "_", v);
                         });

TEST(CudaExecutorTest, CreationReservesTheBuffersOfEveryStepSequencesGrowInto) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  auto cpu_model = LlamaModel::Load(KjvTiny());
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto gpu_model = CudaLlamaModel::FromWeights((*cpu_model)->config(), (*cpu_model)->weights(),
                                               model::DType::kF32);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  // Four sequences grow past 64 tokens, where decode attention splits each context into chunks
  // whose partial results need the workspace, and their block tables lengthen every 8 tokens.
  const KvGeometry g = (*cpu_model)->KvGeometryFor(8, kernels::KvDType::kF16,
                                                   kernels::KvDType::kF16);
  EngineOptions options;
  options.block_size = 8;
  options.k_dtype = options.v_dtype = kernels::KvDType::kF16;
  options.kv_cache_memory = 64 * g.BytesPerBlock();
  options.max_num_seqs = 4;
  auto gpu = CudaExecutor::Create(*std::move(gpu_model),
                                  {.block_size = 8,
                                   .k_dtype = options.k_dtype,
                                   .v_dtype = options.v_dtype,
                                   .kv_cache_memory = options.kv_cache_memory,
                                   .max_num_seqs = options.max_num_seqs});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const CudaLlamaModel& model_on_gpu = (*gpu)->model();
  EXPECT_GT(model_on_gpu.AttentionWorkspaceBytes(4, 512, 8), 0);
  auto engine = Engine::Create(std::unique_ptr<Executor>(*std::move(gpu)), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const auto out = Greedy(**engine, 100);
  ASSERT_EQ(out.size(), 4u);
  for (const auto& [id, tokens] : out) EXPECT_EQ(tokens.size(), 100u) << id;
  const CudaLlamaModel::DecodeGraphStats& stats = model_on_gpu.decode_graph_stats();
  EXPECT_GT(stats.replays, 0);
  EXPECT_EQ(stats.buffer_moves, 0);
}

TEST(CudaExecutorTest, SizesThePoolByUtilizationAndRefusesBadCopies) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  auto cpu_model = LlamaModel::Load(KjvTiny());
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto make = [&]() {
    return CudaLlamaModel::FromWeights((*cpu_model)->config(), (*cpu_model)->weights(),
                                       model::DType::kF16);
  };
  auto m = make();
  ASSERT_TRUE(m.ok()) << m.status();
  auto executor = CudaExecutor::Create(*std::move(m), {.gpu_memory_utilization = 0.5,
                                                       .swap_space = 1 << 20});
  ASSERT_TRUE(executor.ok()) << executor.status();
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const int64_t pool_bytes =
      (*executor)->num_blocks() * (*executor)->kv_geometry().BytesPerBlock();
  EXPECT_GT((*executor)->num_blocks(), 1000);
  EXPECT_LE(pool_bytes, static_cast<int64_t>(0.5 * static_cast<double>(total_bytes)));

  const std::vector<BlockCopy> outside = {{0, (*executor)->num_swap_blocks()}};
  EXPECT_EQ((*executor)->CopyBlocks(BlockCopyKind::kDeviceToSwap, outside).code(),
            absl::StatusCode::kInvalidArgument);
  executor->reset();

  // A utilization already exceeded by what is in use leaves no room: a clear error.
  auto m2 = make();
  ASSERT_TRUE(m2.ok());
  auto none = CudaExecutor::Create(*std::move(m2), {.gpu_memory_utilization = 1e-6});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(none.status().message()).find("--gpu-memory-utilization"),
            std::string::npos);
}

}  // namespace
}  // namespace kvgrid::worker
