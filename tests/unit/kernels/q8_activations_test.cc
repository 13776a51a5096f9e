// 8-bit activations and integer dot products (kernels/cpu/q8_activations.h): the quantized
// inputs within half a step of the floats; the SIMD dot products equal the portable ones
// (exact integer sums, so up to the order of the fp32 sums) on every weight byte pattern,
// Q8_0's -128 included; and QuantLinear's kFast result within the bound the input rounding
// allows of kExact's, at every decode batch size, with bias and accumulation.
#include "kernels/cpu/q8_activations.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quant_linear.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed, float stddev = 0.5f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

constexpr WeightDType kFormats[] = {WeightDType::kQ8_0, WeightDType::kQ4_0, WeightDType::kQ4_1,
                                    WeightDType::kQ4_Z};

TEST(Q8ActivationsTest, QuantizedWithinHalfAStep) {
  const int64_t tokens = 3, cols = 160;
  std::vector<float> x = Random(tokens * cols, 1);
  for (int i = 32; i < 64; ++i) x[i] = 0.f;  // a block of zeros: scale 0
  x[100] = 7.5f;                               // an outlier sets its block's step
  Q8Activations a;
  QuantizeActivations(x.data(), tokens, cols, &a);
  ASSERT_EQ(a.tokens, tokens);
  ASSERT_EQ(a.q.size(), static_cast<size_t>(tokens * cols));
  ASSERT_EQ(a.scale.size(), static_cast<size_t>(tokens * cols / 32));
  for (int64_t blk = 0; blk < tokens * cols / 32; ++blk) {
    const int64_t t = blk / (cols / 32), b = blk % (cols / 32);
    float amax = 0.f;
    int32_t sum = 0, qmax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[t * cols + b * 32 + i]));
    EXPECT_FLOAT_EQ(a.scale[blk], amax / 127.f) << "block " << blk;
    for (int i = 0; i < 32; ++i) {
      const int64_t at = t * cols + b * 32 + i;
      const int q = a.q[at];
      sum += q;
      qmax = std::max(qmax, std::abs(q));
      EXPECT_LE(std::fabs(q * a.scale[blk] - x[at]), 0.5f * a.scale[blk] * 1.0001f + 1e-7f)
          << "element " << at;
    }
    EXPECT_EQ(qmax, amax > 0.f ? 127 : 0) << "block " << blk;
    EXPECT_FLOAT_EQ(a.scaled_sum[blk], a.scale[blk] * static_cast<float>(sum)) << "block " << blk;
    EXPECT_EQ(a.sum[blk], sum) << "block " << blk;
  }
  EXPECT_EQ(a.scale[1], 0.f);
}

// Every byte pattern is a valid Q8_0/Q4 block once its fp16 fields are finite: the SIMD and
// portable kernels must agree on all of them (int8 weights of -128, which no quantizer writes
// but a file may hold, included).
TEST(Q8ActivationsTest, SimdDotEqualsPortable) {
  const int64_t rows = 5, cols = 512;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  const std::vector<float> x = Random(4 * cols, 8, 2.f);
  Q8Activations a;
  QuantizeActivations(x.data(), 4, cols, &a);
  // Every instruction set this CPU has.
  std::vector<Int8DotIsa> isas;
  if (BestInt8DotIsa() != Int8DotIsa::kPortable) isas.push_back(Int8DotIsa::kAvx2);
  if (BestInt8DotIsa() == Int8DotIsa::kAvx512Vnni) isas.push_back(Int8DotIsa::kAvx512Vnni);
  std::printf("int8 dot products on %zu instruction set(s) beside the portable one\n",
              isas.size());
  for (WeightDType dtype : kFormats) {
    QuantMatrix m{.dtype = dtype, .rows = rows, .cols = cols};
    m.data.resize(static_cast<size_t>(rows * m.RowBytes()));
    for (uint8_t& byte : m.data) byte = static_cast<uint8_t>(rng());
    const int64_t bb = QuantMatrix::BlockBytes(dtype);
    for (size_t b = 0; b < m.data.size(); b += bb) {
      const int fields = dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z ? 2 : 1;
      for (int f = 0; f < fields; ++f) {
        const uint16_t h = model::F32ToF16(f == 0 ? scale(rng) : 10.f * scale(rng));
        std::memcpy(m.data.data() + b + 2 * f, &h, 2);
      }
    }
    for (int64_t count = 1; count <= kInt8DotMaxTokens; ++count) {
      for (int64_t first = 0; first + count <= 4; ++first) {
        for (int64_t r = 0; r < rows; ++r) {
          float want[kInt8DotMaxTokens], got[kInt8DotMaxTokens];
          const uint8_t* row = m.data.data() + r * m.RowBytes();
          Int8DotRowPortable(dtype, row, a, first, count, want);
          for (Int8DotIsa isa : isas) {
            Int8DotRowOn(isa, dtype, row, a, first, count, got);
            for (int64_t t = 0; t < count; ++t) {
              ASSERT_NEAR(got[t], want[t], 1e-5f * (1.f + std::fabs(want[t])))
                  << WeightDTypeName(dtype) << " isa " << static_cast<int>(isa) << " count "
                  << count << " first " << first << " row " << r << " token " << t;
            }
          }
        }
      }
    }
  }
}

TEST(Q8ActivationsTest, FastLinearWithinTheInputRoundingOfExact) {
  // A layer's shape, and a head's (many rows of two blocks, parallel over rows).
  for (auto [n, k] : {std::pair<int64_t, int64_t>{67, 384}, std::pair<int64_t, int64_t>{5000, 64}}) {
  SCOPED_TRACE(::testing::Message() << n << " x " << k);
  const std::vector<float> w = Random(n * k, 11, 0.05f);
  const std::vector<float> bias = Random(n, 12);
  for (WeightDType dtype : kFormats) {
    auto q = QuantizeMatrix(w.data(), n, k, dtype);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(HasInt8Dot(dtype), __builtin_cpu_supports("avx2") != 0) << WeightDTypeName(dtype);
    const std::vector<float> dq = DequantizeMatrix(*q);
    for (int64_t m = 1; m <= 4; ++m) {
      for (bool accumulate : {false, true}) {
        const std::vector<float> x = Random(m * k, 20 + m);
        std::vector<float> exact(m * n, 0.75f), fast(m * n, 0.75f);
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                                 .output = exact.data(), .num_tokens = m,
                                 .accumulate = accumulate,
                                 .precision = LinearPrecision::kExact})
                        .ok());
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                                 .output = fast.data(), .num_tokens = m,
                                 .accumulate = accumulate, .precision = LinearPrecision::kFast})
                        .ok());
        double moved = 0;
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t j = 0; j < n; ++j) {
            const float* wr = dq.data() + j * k;
            const float* xr = x.data() + t * k;
            double magnitude = 0;
            for (int64_t c = 0; c < k; ++c) magnitude += std::fabs(wr[c] * xr[c]);
            const double bound = Int8DotErrorBound(wr, xr, k) + 1e-5 * (1 + magnitude);
            const double diff = std::fabs(fast[t * n + j] - exact[t * n + j]);
            moved += diff;
            ASSERT_LE(diff, bound) << WeightDTypeName(dtype) << " m=" << m << " token " << t
                                   << " row " << j;
          }
        }
        if (HasInt8Dot(dtype)) {
          EXPECT_GT(moved, 0.0) << "kFast took the exact path";
        }
      }
    }
  }
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
