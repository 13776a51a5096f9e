// Shared set-up of the gpu tests that compare an engine over a CUDA group with the engine on
// one CUDA model: kjv-tiny's weights in fp32 on the device, an fp16 KV pool of 8-token blocks,
// no watermark and preemption by swap, so that small pools swap.
#ifndef KVGRID_TESTS_GPU_CUDA_ENGINE_SETUP_H_
#define KVGRID_TESTS_GPU_CUDA_ENGINE_SETUP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/test_models.h"
#include "worker/engine/engine.h"
#include "worker/executor/cuda_executor.h"
#include "worker/executor/cuda_llama_model.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::testing {

inline constexpr kernels::KvDType kSwapTestKv = kernels::KvDType::kF16;

// Engine options with the pool and swap sizes of `blocks` and `swap_blocks` blocks of `g`.
inline worker::EngineOptions SwappingEngineOptions(const worker::KvGeometry& g, int64_t blocks,
                                                   int64_t swap_blocks) {
  worker::EngineOptions o;
  o.block_size = 8;
  o.k_dtype = o.v_dtype = kSwapTestKv;
  o.watermark = 0;
  o.preemption_mode = worker::PreemptionMode::kSwap;
  o.kv_cache_memory = blocks * g.BytesPerBlock();
  o.swap_space = swap_blocks * g.BytesPerBlock();
  return o;
}

// The CUDA executor's pool options of the same sizes.
inline worker::CudaExecutor::PoolOptions SwappingPoolOptions(const worker::KvGeometry& g,
                                                             int64_t blocks,
                                                             int64_t swap_blocks) {
  return {.block_size = 8,
          .k_dtype = kSwapTestKv,
          .v_dtype = kSwapTestKv,
          .kv_cache_memory = blocks * g.BytesPerBlock(),
          .swap_space = swap_blocks * g.BytesPerBlock()};
}

// Greedy's tokens (`max_new_tokens` each) from the engine on one CUDA model of kjv-tiny with
// `blocks` pool and `swap_blocks` swap blocks; fails the test unless it swapped.
inline std::map<std::string, std::vector<int32_t>> GreedyOnOneCudaModel(
    int64_t blocks, int64_t swap_blocks, int64_t max_new_tokens) {
  auto host = worker::LlamaModel::Load(KjvTiny());
  EXPECT_TRUE(host.ok()) << host.status();
  if (!host.ok()) return {};
  auto model = worker::CudaLlamaModel::FromWeights((*host)->config(), (*host)->weights(),
                                                   model::DType::kF32);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  const worker::KvGeometry g = (*model)->KvGeometryFor(8, kSwapTestKv, kSwapTestKv);
  auto executor = worker::CudaExecutor::Create(*std::move(model),
                                               SwappingPoolOptions(g, blocks, swap_blocks));
  EXPECT_TRUE(executor.ok()) << executor.status();
  if (!executor.ok()) return {};
  auto engine = worker::Engine::Create(std::unique_ptr<worker::Executor>(*std::move(executor)),
                                       SwappingEngineOptions(g, blocks, swap_blocks));
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  auto tokens = Greedy(**engine, max_new_tokens);
  EXPECT_GT((*engine)->Stats().num_swap_outs, 0) << "the pool should be small enough to swap";
  return tokens;
}

}  // namespace kvgrid::testing

#endif  // KVGRID_TESTS_GPU_CUDA_ENGINE_SETUP_H_
