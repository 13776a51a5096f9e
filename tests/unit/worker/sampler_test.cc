#include "worker/executor/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::worker {
namespace {

TEST(SamplerTest, GreedyPicksArgmaxAndBreaksTiesLow) {
  std::mt19937_64 rng(1);
  std::vector<float> logits = {0.f, 3.f, 1.f, 3.f};
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(SampleToken(logits, p, {}, rng), 1);
}

TEST(SamplerTest, TopKOneIsGreedy) {
  std::mt19937_64 rng(2);
  SamplingParams p;
  p.top_k = 1;
  for (int i = 0; i < 20; ++i) {
    std::vector<float> logits = {0.5f, 0.1f, 2.f, 1.9f};
    EXPECT_EQ(SampleToken(logits, p, {}, rng), 2);
  }
}

TEST(SamplerTest, TinyTopPKeepsOnlyTheBestToken) {
  std::mt19937_64 rng(3);
  SamplingParams p;
  p.top_p = 1e-6;
  for (int i = 0; i < 20; ++i) {
    std::vector<float> logits = {0.5f, 0.1f, 2.f, 1.9f};
    EXPECT_EQ(SampleToken(logits, p, {}, rng), 2);
  }
}

TEST(SamplerTest, MinPDropsUnlikelyTokens) {
  std::mt19937_64 rng(4);
  SamplingParams p;
  p.min_p = 0.5;  // keeps tokens with p >= 0.5 * p(best)
  std::map<int, int> counts;
  for (int i = 0; i < 500; ++i) {
    std::vector<float> logits = {0.f, -10.f, 0.1f, -10.f};
    ++counts[SampleToken(logits, p, {}, rng)];
  }
  EXPECT_EQ(counts.count(1) + counts.count(3), 0u);
  EXPECT_GT(counts[0], 100);
  EXPECT_GT(counts[2], 100);
}

TEST(SamplerTest, SameSeedSameTokens) {
  SamplingParams p;
  p.temperature = 1.3;
  p.top_p = 0.9;
  std::vector<int32_t> a, b;
  std::mt19937_64 r1(99), r2(99);
  for (int i = 0; i < 50; ++i) {
    std::vector<float> l1(100), l2(100);
    for (int j = 0; j < 100; ++j) l1[j] = l2[j] = static_cast<float>((j * 37 + i) % 11) * 0.3f;
    a.push_back(SampleToken(l1, p, {}, r1));
    b.push_back(SampleToken(l2, p, {}, r2));
  }
  EXPECT_EQ(a, b);
}

TEST(SamplerTest, FrequenciesFollowTheSoftmax) {
  std::mt19937_64 rng(5);
  SamplingParams p;  // temperature 1, no truncation
  std::vector<int> counts(3, 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    std::vector<float> logits = {0.f, std::log(2.f), std::log(3.f)};  // p = 1/6, 2/6, 3/6
    ++counts[SampleToken(logits, p, {}, rng)];
  }
  EXPECT_NEAR(counts[0] / double(n), 1 / 6.0, 0.015);
  EXPECT_NEAR(counts[1] / double(n), 2 / 6.0, 0.015);
  EXPECT_NEAR(counts[2] / double(n), 3 / 6.0, 0.015);
}

TEST(SamplerTest, RepetitionPenaltyFollowsHfSemantics) {
  std::mt19937_64 rng(6);
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0;
  std::vector<float> logits = {3.f, 2.f, -1.f};
  const int32_t context[] = {0, 0, 2};
  EXPECT_EQ(SampleToken(logits, p, context, rng), 1);  // 3/2 = 1.5 < 2
  EXPECT_FLOAT_EQ(logits[0], 1.5f);
  EXPECT_FLOAT_EQ(logits[2], -2.f);
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 1.5;
  EXPECT_NE(std::string(p.Validate().message()).find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_NE(std::string(p.Validate().message()).find("temperature"), std::string::npos);
  p = {};
  p.top_k = -2;
  EXPECT_NE(std::string(p.Validate().message()).find("top_k"), std::string::npos);
  p = {};
  p.min_p = 2;
  EXPECT_NE(std::string(p.Validate().message()).find("min_p"), std::string::npos);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_NE(std::string(p.Validate().message()).find("repetition_penalty"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::worker

namespace kvgrid::worker {
namespace {

TEST(SamplerTest, NanAndInfiniteLogitsNeverBreakSampling) {
  std::mt19937_64 rng(8);
  SamplingParams p;
  p.temperature = 0.7;
  p.top_p = 0.9;
  for (int i = 0; i < 50; ++i) {
    std::vector<float> logits = {NAN, 1.f, NAN, 2.f, -INFINITY};
    const int32_t t = SampleToken(logits, p, {}, rng);
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  std::vector<float> inf = {0.f, INFINITY, 3.f};
  EXPECT_EQ(SampleToken(inf, p, {}, rng), 1);
  p.temperature = 0;
  std::vector<float> nan_first = {NAN, 0.5f};
  EXPECT_EQ(SampleToken(nan_first, p, {}, rng), 1);
}

TEST(SamplerTest, SubnormalTemperatureIsGreedy) {
  std::mt19937_64 rng(9);
  SamplingParams p;
  p.temperature = 1e-310;
  std::vector<float> logits = {0.f, 5.f, 4.9f};
  EXPECT_EQ(SampleToken(logits, p, {}, rng), 1);
}

TEST(SamplerTest, LogSoftmaxIsNormalizedAndSurvivesNanAndInfinity) {
  const float kInf = std::numeric_limits<float>::infinity();
  const float kNan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> row = {1.f, 2.f, 3.f};
  LogSoftmaxInPlace(row);
  double sum = 0;
  for (float x : row) sum += std::exp(static_cast<double>(x));
  EXPECT_NEAR(sum, 1.0, 1e-6);
  EXPECT_NEAR(row[2] - row[1], 1.f, 1e-6);

  // NaN counts as -inf: the others still sum to one.
  row = {kNan, 0.f, 0.f};
  LogSoftmaxInPlace(row);
  EXPECT_EQ(row[0], -kInf);
  EXPECT_NEAR(row[1], std::log(0.5f), 1e-6);
  EXPECT_NEAR(row[2], std::log(0.5f), 1e-6);

  // +inf logits take all the probability, shared.
  row = {kInf, 5.f, kInf, kNan};
  LogSoftmaxInPlace(row);
  EXPECT_NEAR(row[0], std::log(0.5f), 1e-6);
  EXPECT_NEAR(row[2], std::log(0.5f), 1e-6);
  EXPECT_EQ(row[1], -kInf);
  EXPECT_EQ(row[3], -kInf);

  // Nothing finite: uniform, never NaN.
  row = {-kInf, kNan, -kInf, -kInf};
  LogSoftmaxInPlace(row);
  for (float x : row) EXPECT_NEAR(x, std::log(0.25f), 1e-6);
}

}  // namespace
}  // namespace kvgrid::worker
