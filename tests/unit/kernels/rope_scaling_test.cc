// RopeInvFreq and RopeAttentionFactor for the scalings beyond llama3: yarn (the ramp's
// kept, blended and divided dimensions, truncate, the attention factor's three sources),
// dynamic NTK fixed at original * factor, and GGUF's per-frequency divisors; Rope's scale.
#include <cmath>
#include <numbers>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rope.h"

namespace kvgrid::kernels::cpu {
namespace {

model::ModelConfig Config(int64_t head_dim = 16, double theta = 10000.0) {
  model::ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  c.max_position_embeddings = 256;
  return c;
}

std::vector<double> Plain(const model::ModelConfig& c) {
  std::vector<double> f(c.head_dim / 2);
  for (int64_t i = 0; i < c.head_dim / 2; ++i) {
    f[i] = std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / c.head_dim);
  }
  return f;
}

model::ModelConfig Yarn(double factor, int64_t original) {
  model::ModelConfig c = Config();
  c.rope_scaling.type = model::RopeScalingType::kYarn;
  c.rope_scaling.factor = factor;
  c.rope_scaling.original_max_position_embeddings = original;
  return c;
}

TEST(RopeYarnTest, RampKeepsBlendsAndDivides) {
  // head_dim 16, theta 1e4, original 64: the beta_fast (32) dimension is -0.99 (floored, then
  // clamped to 0) and the beta_slow (1) dimension 2.02 (ceiled to 3), so dimension 0 is kept,
  // 1 and 2 blend by 1/3 and 2/3, and 3.. are divided by the factor.
  const model::ModelConfig c = Yarn(4.0, 64);
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok()) << f.status();
  const std::vector<double> p = Plain(c);
  EXPECT_DOUBLE_EQ((*f)[0], p[0]);
  EXPECT_NEAR((*f)[1], p[1] * (2.0 / 3 + 1.0 / 3 / 4), 1e-15);
  EXPECT_NEAR((*f)[2], p[2] * (1.0 / 3 + 2.0 / 3 / 4), 1e-15);
  for (size_t i = 3; i < p.size(); ++i) EXPECT_NEAR((*f)[i], p[i] / 4, 1e-18) << i;
}

TEST(RopeYarnTest, WithoutTruncateTheRampEndsAreExact) {
  model::ModelConfig c = Yarn(4.0, 64);
  c.rope_scaling.truncate = false;
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok());
  const std::vector<double> p = Plain(c);
  const double high = 16 * std::log(64 / (2 * std::numbers::pi)) / (2 * std::log(1e4));
  const double ramp = 1.0 / high;  // dimension 1 over [0, high]
  EXPECT_NEAR((*f)[1], p[1] / 4 * ramp + p[1] * (1 - ramp), 1e-15);
  EXPECT_NEAR((*f)[2], p[2] / 4 * std::min(1.0, 2 / high) + p[2] * (1 - std::min(1.0, 2 / high)),
              1e-15);
}

TEST(RopeYarnTest, AttentionFactor) {
  model::ModelConfig c = Yarn(4.0, 64);
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(c), 0.1 * std::log(4.0) + 1.0);
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 0.5;
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(c),
                   (0.1 * std::log(4.0) + 1.0) / (0.05 * std::log(4.0) + 1.0));
  c.rope_scaling.attention_factor = 1.25;  // given: used as it is
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(c), 1.25);
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(Config()), 1.0);
  model::ModelConfig linear = Config();
  linear.rope_scaling.type = model::RopeScalingType::kLinear;
  linear.rope_scaling.factor = 4.0;
  EXPECT_DOUBLE_EQ(RopeAttentionFactor(linear), 1.0);
}

TEST(RopeYarnTest, RejectsBadParameters) {
  model::ModelConfig c = Yarn(4.0, 0);
  EXPECT_FALSE(RopeInvFreq(c).ok());
  c = Yarn(4.0, 64);
  c.rope_scaling.beta_fast = 0.5;
  EXPECT_FALSE(RopeInvFreq(c).ok());
  c = Yarn(4.0, 64);
  c.rope_theta = 1.0;  // ln(theta) = 0: no correction range
  EXPECT_FALSE(RopeInvFreq(c).ok());
}

TEST(RopeDynamicTest, BaseScaledForOriginalTimesFactor) {
  model::ModelConfig c = Config();
  c.rope_scaling.type = model::RopeScalingType::kDynamic;
  c.rope_scaling.factor = 3.0;
  c.rope_scaling.original_max_position_embeddings = 128;
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok()) << f.status();
  model::ModelConfig plain = Config(16, 1e4 * std::pow(7.0, 16.0 / 14.0));  // 3^2 - 3 + 1
  const std::vector<double> p = Plain(plain);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR((*f)[i], p[i], 1e-15 * p[i] + 1e-300) << i;
  EXPECT_DOUBLE_EQ((*f)[0], 1.0);
  c.head_dim = 2;
  EXPECT_FALSE(RopeInvFreq(c).ok());
}

TEST(RopeDivisorsTest, GgufRopeFreqsDivideEachFrequency) {
  model::ModelConfig c = Config(8);
  c.rope_scaling.freq_divisors = {1.0, 2.0, 4.0, 8.0};
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok());
  const std::vector<double> p = Plain(c);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_DOUBLE_EQ((*f)[i], p[i] / (1 << i)) << i;
  c.rope_scaling.freq_divisors = {1.0, 2.0};
  EXPECT_FALSE(RopeInvFreq(c).ok());
}

TEST(RopeScaleTest, ScaleMultipliesCosAndSin) {
  const model::ModelConfig c = Config(4);
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok());
  std::vector<float> q = {1, 2, 3, 4}, k = {1, 0, 0, 1};
  std::vector<float> q2 = q, k2 = k;
  const int32_t pos[] = {5};
  RopeParams p{.query = q.data(), .key = k.data(), .positions = pos, .inv_freq = f->data(),
               .num_tokens = 1, .num_heads = 1, .num_kv_heads = 1, .head_dim = 4};
  ASSERT_TRUE(Rope(p).ok());
  p.query = q2.data();
  p.key = k2.data();
  p.scale = 1.5;
  ASSERT_TRUE(Rope(p).ok());
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(q2[i], 1.5 * q[i], 1e-5) << i;
    EXPECT_NEAR(k2[i], 1.5 * k[i], 1e-5) << i;
  }
  p.scale = 0;
  EXPECT_FALSE(Rope(p).ok());
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
