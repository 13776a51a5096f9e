// The elementwise and GEMM kernels against straightforward loops, and the SIMD vector
// primitives against their portable versions.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <iterator>
#include <limits>
#include <numbers>
#include <random>
#include <tuple>
#include <vector>

#include <omp.h>

#include "gtest/gtest.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/vec.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(LinearTest, MatchesLoopsForGemvAndGemmWithBiasAndAccumulate) {
  // Streamed four tokens at a time up to kStreamTokens (1, 3, 6, 16), SGEMM above (17).
  // k = 64 and n = 28: the AVX-512 blocks of 4 rows x 4 tokens, with a tail of tokens.
  for (auto [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 37, 29}, {3, 37, 29},
                         {6, 37, 29}, {16, 37, 29}, {17, 37, 29}, {4, 64, 28}, {7, 64, 28},
                         {16, 64, 28}}) {
    std::vector<float> x = Random(m * k, 1), w = Random(n * k, 2), bias = Random(n, 3);
    std::vector<float> y = Random(m * n, 4), y0 = y;
    ASSERT_TRUE(Linear({.input = x.data(), .weight = w.data(), .bias = bias.data(),
                        .output = y.data(), .num_tokens = m, .in_features = k, .out_features = n,
                        .accumulate = true})
                    .ok());
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        double ref = y0[t * n + j] + bias[j];
        for (int64_t i = 0; i < k; ++i) ref += double(x[t * k + i]) * w[j * k + i];
        EXPECT_NEAR(y[t * n + j], ref, 1e-4) << m << " " << t << " " << j;
      }
    }
    ASSERT_TRUE(Linear({.input = x.data(), .weight = w.data(), .output = y.data(),
                        .num_tokens = m, .in_features = k, .out_features = n})
                    .ok());
    double ref = 0;
    for (int64_t i = 0; i < k; ++i) ref += double(x[i]) * w[i];
    EXPECT_NEAR(y[0], ref, 1e-4);
  }
}

TEST(RmsNormTest, MatchesFormula) {
  const int64_t n = 3, d = 50;
  std::vector<float> x = Random(n * d, 5), w = Random(d, 6), y(n * d);
  ASSERT_TRUE(RmsNorm({.input = x.data(), .weight = w.data(), .output = y.data(), .num_tokens = n,
                       .hidden = d, .eps = 1e-5f})
                  .ok());
  for (int64_t t = 0; t < n; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += double(x[t * d + i]) * x[t * d + i];
    const double r = 1.0 / std::sqrt(ss / d + 1e-5);
    for (int64_t i = 0; i < d; ++i) EXPECT_NEAR(y[t * d + i], x[t * d + i] * r * w[i], 1e-5);
  }
}

TEST(RmsNormTest, RejectsBadEps) {
  float x = 1, w = 1, y;
  EXPECT_FALSE(RmsNorm({.input = &x, .weight = &w, .output = &y, .num_tokens = 1, .hidden = 1,
                        .eps = 0.f})
                   .ok());
}

TEST(SiluAndMulTest, MatchesFormula) {
  const int64_t n = 2, inter = 7;
  std::vector<float> gu = Random(n * 2 * inter, 7), out(n * inter);
  ASSERT_TRUE(SiluAndMul({.gate_up = gu.data(), .output = out.data(), .num_tokens = n,
                          .intermediate = inter})
                  .ok());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < inter; ++i) {
      const double g = gu[t * 2 * inter + i], u = gu[t * 2 * inter + inter + i];
      EXPECT_NEAR(out[t * inter + i], g / (1 + std::exp(-g)) * u, 1e-6);
    }
  }
}

// The SIMD rows evaluate exp by range reduction and a polynomial: within a few ulp of
// std::exp over the whole float range (the CUDA kernel is held to 8 ulp of this reference),
// overflow to infinity giving -0 as the scalar formula does, NaN kept.
TEST(SiluAndMulTest, SimdRowsStayWithinAFewUlpEverywhere) {
  const int64_t inter = 1003;  // 125 vectors of 8 and a tail
  std::vector<float> gu(2 * inter), out(inter);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> wide(-100.f, 100.f), u(-2.f, 2.f);
  for (int64_t i = 0; i < inter; ++i) {
    gu[i] = i < 400 ? wide(rng) : (i < 800 ? wide(rng) / 25.f : wide(rng) / 2000.f);
    gu[inter + i] = u(rng);
  }
  const float edges[] = {88.72f, -88.72f, 88.75f, -88.75f, 87.34f, -87.34f, 0.f, -0.f,
                         INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f, 30.f, -30.f, 89.f};
  for (size_t i = 0; i < std::size(edges); ++i) gu[i * 7] = edges[i];
  ASSERT_TRUE(SiluAndMul({.gate_up = gu.data(), .output = out.data(), .num_tokens = 1,
                          .intermediate = inter})
                  .ok());
  for (int64_t i = 0; i < inter; ++i) {
    const float g = gu[i], up = gu[inter + i];
    const float want = g / (1.f + std::exp(-g)) * up;
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[i])) << "g " << g;
      continue;
    }
    if (std::isinf(want)) {
      EXPECT_EQ(out[i], want) << "g " << g;
      continue;
    }
    EXPECT_NEAR(out[i], want, 4 * FLT_EPSILON * std::fabs(want) + 1e-37f) << "g " << g;
    EXPECT_EQ(std::signbit(out[i]), std::signbit(want)) << "g " << g;
  }
}

TEST(EmbeddingTest, GathersRowsAndRejectsOutOfVocabIds) {
  std::vector<float> table = Random(5 * 3, 8), out(2 * 3);
  const int32_t ids[] = {4, 0};
  ASSERT_TRUE(Embedding({.table = table.data(), .ids = ids, .output = out.data(), .vocab = 5,
                         .hidden = 3, .num_tokens = 2})
                  .ok());
  EXPECT_EQ(out[0], table[12]);
  EXPECT_EQ(out[3], table[0]);
  const int32_t bad[] = {5};
  absl::Status s = Embedding({.table = table.data(), .ids = bad, .output = out.data(),
                              .vocab = 5, .hidden = 3, .num_tokens = 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

model::ModelConfig RopeConfig() {
  model::ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.0;
  return c;
}

TEST(RopeTest, DefaultInvFreq) {
  auto f = RopeInvFreq(RopeConfig());
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->size(), 64u);
  EXPECT_DOUBLE_EQ((*f)[0], 1.0);
  EXPECT_NEAR((*f)[1], std::pow(500000.0, -2.0 / 128), 1e-15);
}

TEST(RopeTest, Llama3ScalingKeepsHighAndDividesLowFrequencies) {
  model::ModelConfig c = RopeConfig();
  c.rope_scaling = {model::RopeScalingType::kLlama3, 8.0, 1.0, 4.0, 8192};
  auto plain = RopeInvFreq(RopeConfig());
  auto scaled = RopeInvFreq(c);
  ASSERT_TRUE(plain.ok() && scaled.ok());
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < plain->size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / (*plain)[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_DOUBLE_EQ((*scaled)[i], (*plain)[i]);
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_NEAR((*scaled)[i], (*plain)[i] / 8, 1e-18);
      ++divided;
    } else {
      EXPECT_LT((*scaled)[i], (*plain)[i]);
      EXPECT_GT((*scaled)[i], (*plain)[i] / 8);
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(RopeTest, RotatesPairsHalfApart) {
  model::ModelConfig c;
  c.head_dim = 4;
  c.rope_theta = 10000.0;
  auto f = RopeInvFreq(c);
  ASSERT_TRUE(f.ok());
  std::vector<float> q = {1, 2, 3, 4}, k = {1, 0, 0, 1};
  const int32_t pos[] = {3};
  ASSERT_TRUE(Rope({.query = q.data(), .key = k.data(), .positions = pos, .inv_freq = f->data(),
                    .num_tokens = 1, .num_heads = 1, .num_kv_heads = 1, .head_dim = 4})
                  .ok());
  const double a0 = 3.0, a1 = 3.0 * (*f)[1];
  EXPECT_NEAR(q[0], 1 * std::cos(a0) - 3 * std::sin(a0), 1e-6);
  EXPECT_NEAR(q[2], 3 * std::cos(a0) + 1 * std::sin(a0), 1e-6);
  EXPECT_NEAR(q[1], 2 * std::cos(a1) - 4 * std::sin(a1), 1e-6);
  EXPECT_NEAR(q[3], 4 * std::cos(a1) + 2 * std::sin(a1), 1e-6);
  EXPECT_NEAR(k[0], std::cos(a0), 1e-6);
}

TEST(RopeTest, RejectsOddHeadDim) {
  model::ModelConfig c;
  c.head_dim = 5;
  EXPECT_FALSE(RopeInvFreq(c).ok());
}

TEST(VecTest, SimdMatchesPortable) {
  const VecOps& fast = Vec();
  const VecOps& slow = PortableVec();
  for (int64_t n : {1, 7, 8, 15, 16, 33, 128}) {
    std::vector<float> a = Random(n, n), b = Random(n, n + 1);
    EXPECT_NEAR(fast.dot(a.data(), b.data(), n), slow.dot(a.data(), b.data(), n), 1e-4) << n;
    std::vector<float> y1 = b, y2 = b;
    fast.axpy(0.37f, a.data(), y1.data(), n);
    slow.axpy(0.37f, a.data(), y2.data(), n);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(y1[i], y2[i], 1e-6);
    std::vector<uint16_t> h1(n), h2(n);
    fast.f32_to_f16(a.data(), h1.data(), n);
    slow.f32_to_f16(a.data(), h2.data(), n);
    EXPECT_EQ(h1, h2) << n;
    std::vector<float> f1(n), f2(n);
    fast.f16_to_f32(h1.data(), f1.data(), n);
    slow.f16_to_f32(h1.data(), f2.data(), n);
    EXPECT_EQ(f1, f2);
  }
}

// Each case's answer is written out, and both implementations must give it: NaN is -inf, ties
// (+0 and -0 included) go to the lowest index, nothing above -inf gives 0, and the maximum may
// sit in the SIMD body, the scalar tail or both.
TEST(VecTest, ArgmaxAndMaxTreatNanAsMinusInfinityAndArgmaxBreaksTiesLow) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::vector<float> x;
    int64_t want;
  };
  std::vector<Case> cases = {
      {{1.f}, 0},
      {{nan}, 0},
      {{-inf, -inf, -inf}, 0},
      {{nan, -inf, nan}, 0},
      {{nan, -inf, -3.f}, 2},
      {{-0.f, 0.f, -1.f}, 0},
      {{-1.f, 0.f, -0.f}, 1},
      {{1.f, inf, 2.f, inf}, 1},
  };
  for (int64_t n : {9, 16, 17, 31, 32, 33, 1000}) {
    std::vector<float> x = Random(n, n + 5);
    for (float& v : x) v -= 10.f;                 // all below the peaks placed next
    std::vector<float> tie = x, last = x, nans = x, big = x;
    tie[n / 2] = 7.f;  // two equal peaks: the first wins
    tie[n - 1] = 7.f;
    cases.push_back({tie, n / 2});
    last[n - 1] = 3.f;  // in the tail the SIMD loop leaves
    cases.push_back({last, n - 1});
    nans[0] = nan;
    nans[n - 1] = nan;
    nans[n / 3] = 1.f;
    cases.push_back({nans, n / 3});
    std::fill(big.begin(), big.end(), nan);
    big[n - 2] = -inf;
    big[n - 1] = -1e30f;
    cases.push_back({big, n - 1});
  }
  for (const VecOps* ops : {&Vec(), &PortableVec()}) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const std::vector<float>& x = cases[c].x;
      const int64_t n = static_cast<int64_t>(x.size());
      EXPECT_EQ(ops->argmax(x.data(), n), cases[c].want)
          << ops->name << " case " << c << " (n " << n << ")";
      // max: the value argmax points at, -inf where nothing is above it (NaN skipped).
      const float top = std::isnan(x[cases[c].want]) ? -inf : x[cases[c].want];
      EXPECT_EQ(ops->max(x.data(), n), top) << ops->name << " case " << c << " (n " << n << ")";
    }
  }
  // Rows drawn from a few values, NaN, +-0 and +-inf among them, so that ties and the special
  // values land in every SIMD lane: the answer of the sampler's earlier greedy code (NaN
  // rewritten to -inf, then a strict scan from index 0).
  const float pool[] = {nan, -inf, 0.f, -0.f, -1.f, 1.f, 2.f, inf};
  std::mt19937_64 rng(7);
  for (int64_t n : {16, 17, 31, 64, 1000}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> x(n);
      // Rows from the first 8, 6, 4 or 2 values, so that +inf, 1, +-0 and -inf (or NaN
      // alone) each get to be the maximum.
      const int spread = 8 - 2 * (trial % 4);
      for (float& v : x) v = pool[rng() % spread];
      // Every fifth row also has one peak above the pool in its first half, which a SIMD lane
      // that let a later NaN displace its maximum would lose (later values then replace the
      // NaN).
      if (trial % 5 == 4) x[rng() % (n / 2)] = 3.f;
      std::vector<float> rewritten = x;
      for (float& v : rewritten) v = std::isnan(v) ? -inf : v;
      int64_t want = 0;
      for (int64_t i = 1; i < n; ++i) {
        if (rewritten[i] > rewritten[want]) want = i;
      }
      EXPECT_EQ(Vec().argmax(x.data(), n), want) << "n " << n << " trial " << trial;
      EXPECT_EQ(Vec().max(x.data(), n), rewritten[want]) << "n " << n << " trial " << trial;
    }
  }
}

// 33 to 128 tokens: each thread's SGEMM on its share of 16-row panels (the last share short,
// or empty where the rows are fewer than the threads' panels), with and without bias and
// accumulation.
TEST(LinearTest, RowSplitSgemmMatchesDoublePrecision) {
  const int64_t k = 96;
  struct RestoreThreads {
    int threads = omp_get_max_threads();
    ~RestoreThreads() { omp_set_num_threads(threads); }
  } restore;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int64_t m : {33, 64, 128}) {
      for (int64_t n : {8, 50, 96}) {
        for (bool accumulate : {false, true}) {
          std::vector<float> x = Random(m * k, 31), w = Random(n * k, 32), bias = Random(n, 33);
          const std::vector<float> before = Random(m * n, 34);
          std::vector<float> y = before;
          ASSERT_TRUE(Linear({.input = x.data(), .weight = w.data(),
                              .bias = accumulate ? bias.data() : nullptr, .output = y.data(),
                              .num_tokens = m, .in_features = k, .out_features = n,
                              .accumulate = accumulate})
                          .ok());
          for (int64_t t = 0; t < m; ++t) {
            for (int64_t j = 0; j < n; ++j) {
              double want = accumulate ? before[t * n + j] + bias[j] : 0.0;
              for (int64_t c = 0; c < k; ++c) want += double{x[t * k + c]} * w[j * k + c];
              ASSERT_NEAR(y[t * n + j], want, 1e-4 * (1.0 + std::fabs(want)))
                  << threads << " threads, " << m << " tokens, " << n << " rows, accumulate "
                  << accumulate << ": token " << t << " row " << j;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu

namespace kvgrid::kernels::cpu {
namespace {

TEST(LinearTest, SmallBatchPathEqualsGemmPath) {
  const int64_t m = kStreamTokens + 5, k = 68, n = 40;
  std::vector<float> x = Random(m * k, 11), w = Random(n * k, 12), bias = Random(n, 13);
  std::vector<float> a(m * n), b(m * n);
  LinearParams p{.input = x.data(), .weight = w.data(), .bias = bias.data(), .output = a.data(),
                 .num_tokens = m, .in_features = k, .out_features = n};
  ASSERT_TRUE(Linear(p).ok());  // above kStreamTokens: SGEMM
  p.output = b.data();
  ASSERT_TRUE(LinearSmallBatch(p).ok());
  for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(a[i], b[i], 1e-4);
}

// The small-batch path on AVX-512 walks tokens in chunks (1 MiB of inputs, at least 16
// tokens: 16 tokens of 16384 inputs here, so 37 tokens are three chunks, the last of 5); each
// output against a double-precision sum, bias and accumulation included, through it and
// through Linear's dispatch (SGEMM for this shape).
TEST(LinearTest, ChunkedStreamingMatchesDoublePrecision) {
  const int64_t m = 37, k = 16384, n = 8;
  std::vector<float> x = Random(m * k, 21), w = Random(n * k, 22), bias = Random(n, 23);
  const std::vector<float> before = Random(m * n, 24);
  for (auto* linear : {&Linear, &LinearSmallBatch}) {
    std::vector<float> y = before;
    LinearParams p{.input = x.data(), .weight = w.data(), .bias = bias.data(),
                   .output = y.data(), .num_tokens = m, .in_features = k, .out_features = n,
                   .accumulate = true};
    ASSERT_TRUE(linear(p).ok());
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        double want = before[t * n + j] + bias[j];
        for (int64_t c = 0; c < k; ++c) want += double{x[t * k + c]} * w[j * k + c];
        EXPECT_NEAR(y[t * n + j], want, 2e-3)
            << (linear == &Linear ? "Linear" : "LinearSmallBatch") << " token " << t
            << " row " << j;
      }
    }
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
