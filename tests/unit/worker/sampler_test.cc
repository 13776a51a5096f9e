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

TEST(SamplerTest, SampledCandidatesBreakTiesLowAcrossSignedZeros) {
  // The candidates' order (logit descending, ties by id) decides which token a draw lands on:
  // with top-k 1 the first candidate always wins, whatever the draw. -0 and +0 tie.
  std::mt19937_64 rng(4);
  SamplingParams p;
  p.top_k = 1;
  for (int i = 0; i < 10; ++i) {
    std::vector<float> zeros = {-1.f, 0.f, -0.f, 0.f, -2.f};
    EXPECT_EQ(SampleToken(zeros, p, {}, rng), 1);
    std::vector<float> negative_zero_first = {-1.f, -0.f, 0.f, -3.f};
    EXPECT_EQ(SampleToken(negative_zero_first, p, {}, rng), 1);
    std::vector<float> negatives = {-5.f, -2.5f, -7.f, -2.5f};
    EXPECT_EQ(SampleToken(negatives, p, {}, rng), 1);
    std::vector<float> infinities = {-std::numeric_limits<float>::infinity(), -1e30f, 1e30f,
                                     std::numeric_limits<float>::infinity(), 1e30f};
    EXPECT_EQ(SampleToken(infinities, p, {}, rng), 3);
  }
  // Top-k 2 over equal logits keeps the two lowest ids, so only they are ever drawn.
  SamplingParams two;
  two.top_k = 2;
  std::map<int32_t, int> seen;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> flat(6, 0.25f);
    ++seen[SampleToken(flat, two, {}, rng)];
  }
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
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
  EXPECT_EQ(SampleToken(logits, p, TokenHistory(p, context), rng), 1);  // 3/2 = 1.5 < 2
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

namespace kvgrid::worker {
namespace {

// The history of a sequence whose prompt is `prompt` and which generated `output`.
TokenHistory History(const SamplingParams& p, std::vector<int32_t> prompt,
                     std::vector<int32_t> output) {
  TokenHistory h(p, prompt);
  for (int32_t t : output) h.AddOutput(t);
  return h;
}

TEST(SamplerPenaltyTest, PresenceFrequencyAndBiasFollowOpenAiFormula) {
  SamplingParams p;
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.25;
  p.logit_bias = {{0, -1.f}, {5, 2.5f}};
  // Prompt {1, 2}; generated 3 three times, 4 and 1 once each.
  const TokenHistory h = History(p, {1, 2}, {3, 3, 4, 3, 1});
  std::vector<float> logits = {1.f, 2.f, -1.f, 4.f, 0.5f, -3.f, 7.f, 0.f};
  ApplyPenalties(logits, p, h);
  // By hand: logit + bias - 0.25 * count - 0.5 * (count > 0); the prompt does not count.
  const std::vector<float> expected = {
      1.f - 1.f,             // biased, never generated
      2.f - 0.25f - 0.5f,    // in the prompt and generated once
      -1.f,                  // in the prompt only: untouched
      4.f - 0.75f - 0.5f,    // generated three times
      0.5f - 0.25f - 0.5f,   // generated once
      -3.f + 2.5f,           // biased
      7.f, 0.f};
  EXPECT_EQ(logits, expected);
}

TEST(SamplerPenaltyTest, BiasThenRepetitionThenFrequencyAndPresenceAsVllmOrdersThem) {
  SamplingParams p;
  p.repetition_penalty = 2.0;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  p.logit_bias = {{0, 1.f}, {2, -4.f}};
  const TokenHistory h = History(p, {0, 1}, {0, 2});
  std::vector<float> logits = {3.f, -1.f, 1.f, 6.f};
  ApplyPenalties(logits, p, h);
  EXPECT_EQ(logits[0], (3.f + 1.f) / 2.f - 0.5f - 0.25f);  // bias, then divided, then counted
  EXPECT_EQ(logits[1], -1.f * 2.f);                        // prompt: repetition penalty only
  EXPECT_EQ(logits[2], (1.f - 4.f) * 2.f - 0.5f - 0.25f);  // the bias made it negative first
  EXPECT_EQ(logits[3], 6.f);
}

TEST(SamplerPenaltyTest, NegativePenaltiesRewardRepeats) {
  SamplingParams p;
  p.temperature = 0;
  p.frequency_penalty = -2.0;
  const TokenHistory h = History(p, {}, {1, 1});
  std::vector<float> logits = {3.f, 0.f, 2.f};
  std::mt19937_64 rng(1);
  EXPECT_EQ(SampleToken(logits, p, h, rng), 1);  // 0 + 2 * 2 = 4 > 3
  EXPECT_EQ(logits[1], 4.f);
}

TEST(SamplerPenaltyTest, ZeroPenaltiesChangeNothing) {
  SamplingParams plain;
  plain.temperature = 0.8;
  plain.top_k = 40;
  SamplingParams zero = plain;
  zero.presence_penalty = 0.0;
  zero.frequency_penalty = 0.0;
  zero.logit_bias = {{7, 0.f}};  // a zero bias is no bias
  const TokenHistory h = History(zero, {1, 2, 3}, {7, 7, 9});
  EXPECT_TRUE(h.seen().empty());  // nothing tracked when nothing is penalized
  EXPECT_TRUE(h.output_counts().empty());
  std::mt19937_64 r1(42), r2(42);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> a(64), b(64);
    for (int j = 0; j < 64; ++j) a[j] = b[j] = std::sin(static_cast<float>(i * 64 + j)) * 4.f;
    const int32_t ta = SampleToken(a, plain, {}, r1);
    const int32_t tb = SampleToken(b, zero, h, r2);
    ASSERT_EQ(ta, tb) << i;
    ASSERT_EQ(a, b) << i;  // bit-identical rows
  }
  EXPECT_TRUE(r1 == r2);
}

TEST(SamplerPenaltyTest, PlusHundredForcesATokenGreedyAndSampled) {
  for (double temperature : {0.0, 1.0, 1.5}) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_p = 0.9;
    p.logit_bias = {{3, 100.f}};
    std::mt19937_64 rng(7);
    for (int i = 0; i < 300; ++i) {
      std::vector<float> logits(50);
      for (int j = 0; j < 50; ++j) logits[j] = std::cos(static_cast<float>(i + 3 * j)) * 10.f;
      ASSERT_EQ(SampleToken(logits, p, {}, rng), 3) << "temperature " << temperature;
    }
  }
}

TEST(SamplerPenaltyTest, MinusHundredBansAToken) {
  for (double temperature : {0.0, 1.0, 2.0}) {
    SamplingParams p;
    p.temperature = temperature;
    p.logit_bias = {{2, -100.f}};
    std::mt19937_64 rng(8);
    std::map<int32_t, int> counts;
    for (int i = 0; i < 2000; ++i) {
      std::vector<float> logits = {0.f, 0.5f, 5.f, 0.2f};  // 2 is by far the likeliest
      ++counts[SampleToken(logits, p, {}, rng)];
    }
    EXPECT_EQ(counts.count(2), 0u) << "temperature " << temperature;
    EXPECT_GT(counts[1], 0);
  }
}

TEST(SamplerPenaltyTest, PenaltiesNeverConsumeRandomDraws) {
  // The same seed with and without penalties stays on the same random stream, so a seeded
  // request's draws do not depend on what the penalties did.
  SamplingParams plain;
  plain.temperature = 1.0;
  SamplingParams penalized = plain;
  penalized.presence_penalty = 1.5;
  penalized.frequency_penalty = 0.7;
  penalized.logit_bias = {{4, 3.f}};
  TokenHistory h(penalized, std::vector<int32_t>{1, 2});
  std::mt19937_64 r1(5), r2(5);
  std::vector<int32_t> a, b;
  for (int i = 0; i < 100; ++i) {
    std::vector<float> l1(16, 0.f), l2(16, 0.f);
    a.push_back(SampleToken(l1, plain, {}, r1));
    b.push_back(SampleToken(l2, penalized, h, r2));
    h.AddOutput(b.back());
  }
  EXPECT_TRUE(r1 == r2);
  EXPECT_NE(a, b);  // yet the penalties steered the picks
  // And a second run of the penalized stream is the same.
  std::mt19937_64 r3(5);
  TokenHistory h3(penalized, std::vector<int32_t>{1, 2});
  std::vector<int32_t> c;
  for (int i = 0; i < 100; ++i) {
    std::vector<float> l(16, 0.f);
    c.push_back(SampleToken(l, penalized, h3, r3));
    h3.AddOutput(c.back());
  }
  EXPECT_EQ(b, c);
}

TEST(SamplerPenaltyTest, HistoryTracksOnlyWhatIsPenalizedAndCopiesAreIndependent) {
  SamplingParams rep;
  rep.repetition_penalty = 1.2;
  TokenHistory r = History(rep, {5, 6}, {7});
  EXPECT_EQ(r.seen().size(), 3u);
  EXPECT_TRUE(r.output_counts().empty());

  SamplingParams freq;
  freq.frequency_penalty = 0.1;
  TokenHistory parent = History(freq, {5, 6}, {});
  EXPECT_TRUE(parent.seen().empty());
  TokenHistory sibling = parent;
  sibling.AddOutput(9);
  sibling.AddOutput(9);
  EXPECT_TRUE(parent.output_counts().empty());
  EXPECT_EQ(sibling.output_counts().at(9), 2);
}

TEST(SamplerPenaltyTest, OutOfRangeIdsAreSkipped) {
  SamplingParams p;
  p.presence_penalty = 1.0;
  p.logit_bias = {{10, 5.f}};
  const TokenHistory h = History(p, {}, {20, 1});
  std::vector<float> logits = {0.f, 0.f};
  ApplyPenalties(logits, p, h);
  EXPECT_EQ(logits, (std::vector<float>{0.f, -1.f}));
}

TEST(SamplerPenaltyTest, ValidateNamesPenaltyAndBiasFields) {
  auto message = [](const SamplingParams& p) { return std::string(p.Validate().message()); };
  SamplingParams p;
  p.presence_penalty = 3;
  EXPECT_EQ(message(p), "presence_penalty: must be in [-2, 2], got 3");
  EXPECT_EQ(p.Validate().code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.frequency_penalty = -2.5;
  EXPECT_EQ(message(p), "frequency_penalty: must be in [-2, 2], got -2.5");
  p = {};
  p.frequency_penalty = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(message(p).find("frequency_penalty"), std::string::npos);
  p = {};
  p.presence_penalty = -2;
  p.frequency_penalty = 2;
  p.logit_bias = {{1, -100.f}, {2, 100.f}};
  EXPECT_TRUE(p.Validate().ok()) << p.Validate();
  p.logit_bias = {{5, 100.5f}};
  EXPECT_EQ(message(p), "logit_bias[5]: must be in [-100, 100], got 100.5");
  p.logit_bias = {{5, std::numeric_limits<float>::infinity()}};
  EXPECT_NE(message(p).find("logit_bias[5]"), std::string::npos);
  p.logit_bias = {{-1, 1.f}};
  EXPECT_NE(message(p).find("logit_bias: token id -1"), std::string::npos);
  p.logit_bias = {{4, 1.f}, {4, 2.f}};
  EXPECT_NE(message(p).find("logit_bias: token id 4 is given more than once"),
            std::string::npos);
  p.logit_bias.clear();
  for (int32_t i = 0; i <= kMaxLogitBiasEntries; ++i) p.logit_bias.push_back({i, 1.f});
  EXPECT_EQ(message(p), "logit_bias: at most 1024 entries, got 1025");
  p.logit_bias.pop_back();
  EXPECT_TRUE(p.Validate().ok());
}

}  // namespace
}  // namespace kvgrid::worker
