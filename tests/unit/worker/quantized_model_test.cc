// A model whose linear weights are quantized at load: logits stay close to fp32's (Q8_0 very
// close, Q4_0 close), the weights shrink, and greedy decoding mostly agrees.
#include <algorithm>
#include <cstdio>
#include <string>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {
namespace {

using kernels::cpu::WeightDType;

std::vector<float> PromptLogits(LlamaModel& model) {
  auto pool = KvPool::Create(model.KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32),
                             4 << 20);
  EXPECT_TRUE(pool.ok());
  BlockManager blocks((*pool)->num_blocks(), 16);
  std::vector<int32_t> prompt(20);
  std::iota(prompt.begin(), prompt.end(), 9);
  EXPECT_TRUE(blocks.Reserve(1, 20).ok());
  std::vector<float> logits;
  EXPECT_TRUE(model.Forward(SingleSequenceBatch(blocks, 1, 0, prompt), **pool, &logits).ok());
  return logits;
}

TEST(QuantizedModelTest, LogitsStayCloseAndWeightsShrink) {
  const auto dir = std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny";
  auto whole = LlamaModel::Load(dir);
  ASSERT_TRUE(whole.ok());
  const std::vector<float> ref = PromptLogits(**whole);
  for (auto [dtype, tolerance] : {std::pair{WeightDType::kQ8_0, 0.03},
                                  std::pair{WeightDType::kQ4_0, 0.45}}) {
    auto model = LlamaModel::Load(dir);
    ASSERT_TRUE(model.ok());
    ASSERT_TRUE((*model)->QuantizeWeights(dtype).ok());
    EXPECT_LT((*model)->WeightBytes(), (*whole)->WeightBytes());
    const std::vector<float> got = PromptLogits(**model);
    ASSERT_EQ(got.size(), ref.size());
    // Mean absolute error against the mean magnitude of the logits (the random-weight fixture
    // amplifies quantization error far more than a trained model: see kvgrid perplexity).
    double err = 0, mag = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      err += std::fabs(got[i] - ref[i]);
      mag += std::fabs(ref[i]);
    }
    EXPECT_LT(err / mag, tolerance) << kernels::cpu::WeightDTypeName(dtype);
    EXPECT_GT(err, 0.0) << "the weights should have changed";
    std::printf("%s: mean |dlogit| / mean |logit| = %.4f\n",
                std::string(kernels::cpu::WeightDTypeName(dtype)).c_str(), err / mag);
    const auto argmax = [](const std::vector<float>& v) {
      return std::max_element(v.begin(), v.end()) - v.begin();
    };
    if (dtype == WeightDType::kQ8_0) {
      EXPECT_EQ(argmax(got), argmax(ref));
    }
  }
}

}  // namespace
}  // namespace kvgrid::worker
