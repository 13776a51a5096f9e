// Q8_0 / Q4_0 / Q4_1 weights: round-trip error within the quantization step's bound, the block
// layouts (ggml's), and QuantLinear equal to dequantize-then-matmul at decode and prefill
// sizes, with and without an input permutation.
#include "kernels/cpu/quant_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 0.5f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(QuantLinearTest, RoundTripWithinHalfAStep) {
  const int64_t rows = 7, cols = 96;
  const std::vector<float> w = Random(rows * cols, 1);
  for (WeightDType dtype :
       {WeightDType::kQ8_0, WeightDType::kQ4_0, WeightDType::kQ4_1, WeightDType::kQ4_Z}) {
    auto q = QuantizeMatrix(w.data(), rows, cols, dtype);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(static_cast<int64_t>(q->data.size()), rows * cols / 32 * QuantMatrix::BlockBytes(dtype));
    std::vector<float> row(cols);
    for (int64_t r = 0; r < rows; ++r) {
      DequantizeRow(*q, r, row.data());
      for (int64_t b = 0; b < cols / 32; ++b) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w[r * cols + b * 32 + i]));
        const auto [lo, hi] = std::minmax_element(w.begin() + r * cols + b * 32,
                                                  w.begin() + r * cols + b * 32 + 32);
        // Q8_0: half a step; Q4_0: half a step, one for values that clamp at +7; Q4_1: half a
        // step of the range, plus the fp16 rounding of the offset; Q4_Z: one step (the zero
        // point is rounded to an integer).
        const float bound = dtype == WeightDType::kQ8_0   ? 0.5f * amax / 127.f
                            : dtype == WeightDType::kQ4_0 ? amax / 8.f
                            : dtype == WeightDType::kQ4_1
                                ? 0.5f * (*hi - *lo) / 15.f + std::fabs(*lo) / 1024.f
                                : (*hi - *lo) / 15.f;
        for (int i = 0; i < 32; ++i) {
          const int64_t at = r * cols + b * 32 + i;
          EXPECT_LE(std::fabs(row[b * 32 + i] - w[at]), bound * 1.002f + 1e-6f)
              << WeightDTypeName(dtype) << " row " << r << " col " << b * 32 + i;
        }
      }
    }
  }
  EXPECT_EQ(QuantizeMatrix(w.data(), 1, 48, WeightDType::kQ8_0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(QuantLinearTest, Q4BlockLayoutIsGgmls) {
  // Value i in the low nibble of byte i, value i + 16 in the high nibble; q - 8 times d.
  QuantMatrix m{.dtype = WeightDType::kQ4_0, .rows = 1, .cols = 32};
  m.data.assign(18, 0);
  const uint16_t d = model::F32ToF16(0.5f);
  std::memcpy(m.data.data(), &d, 2);
  for (int i = 0; i < 16; ++i) m.data[2 + i] = static_cast<uint8_t>((i & 0xF) | ((15 - i) << 4));
  std::vector<float> row(32);
  DequantizeRow(m, 0, row.data());
  for (int i = 0; i < 16; ++i) {
    EXPECT_FLOAT_EQ(row[i], 0.5f * (i - 8));
    EXPECT_FLOAT_EQ(row[i + 16], 0.5f * (15 - i - 8));
  }
}

TEST(QuantLinearTest, Q41BlockLayoutIsGgmls) {
  // fp16 d, fp16 m, then the nibbles as Q4_0's; d q + m.
  QuantMatrix m{.dtype = WeightDType::kQ4_1, .rows = 1, .cols = 32};
  m.data.assign(20, 0);
  const uint16_t d = model::F32ToF16(0.25f), mn = model::F32ToF16(-1.5f);
  std::memcpy(m.data.data(), &d, 2);
  std::memcpy(m.data.data() + 2, &mn, 2);
  for (int i = 0; i < 16; ++i) m.data[4 + i] = static_cast<uint8_t>(i | ((15 - i) << 4));
  std::vector<float> row(32);
  DequantizeRow(m, 0, row.data());
  for (int i = 0; i < 16; ++i) {
    EXPECT_FLOAT_EQ(row[i], 0.25f * i - 1.5f);
    EXPECT_FLOAT_EQ(row[i + 16], 0.25f * (15 - i) - 1.5f);
  }
}

TEST(QuantLinearTest, DequantizeMatrixUndoesTheInputPermutation) {
  const int64_t n = 3, k = 64;
  const std::vector<float> w = Random(n * k, 4);
  std::vector<int32_t> perm(k);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
  std::vector<float> stored(n * k);  // column j holds input perm[j]
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) stored[r * k + j] = w[r * k + perm[j]];
  }
  auto q = QuantizeMatrix(stored.data(), n, k, WeightDType::kQ8_0);
  ASSERT_TRUE(q.ok());
  auto plain = QuantizeMatrix(w.data(), n, k, WeightDType::kQ8_0);
  q->input_perm = perm;
  const std::vector<float> got = DequantizeMatrix(*q);
  for (int64_t i = 0; i < n * k; ++i) EXPECT_NEAR(got[i], w[i], 0.02f) << i;
  EXPECT_EQ(plain->input_perm.size(), 0u);
}

TEST(QuantLinearTest, MatchesDequantizeThenMatmul) {
  const int64_t n = 150, k = 256;  // not a multiple of the tile
  const std::vector<float> w = Random(n * k, 2);
  const std::vector<float> bias = Random(n, 3);
  std::vector<int32_t> perm(k);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(6));
  for (auto [dtype, permuted] :
       {std::pair{WeightDType::kQ8_0, false}, std::pair{WeightDType::kQ4_0, false},
        std::pair{WeightDType::kQ4_1, false}, std::pair{WeightDType::kQ4_Z, false},
        std::pair{WeightDType::kQ4_Z, true}}) {
    auto q = QuantizeMatrix(w.data(), n, k, dtype);
    ASSERT_TRUE(q.ok());
    if (permuted) q->input_perm = perm;
    const std::vector<float> dq = DequantizeMatrix(*q);
    for (int64_t m : {1, 3, 4, 5, 17}) {
      for (bool accumulate : {false, true}) {
        const std::vector<float> x = Random(m * k, 10 + m);
        std::vector<float> want(m * n, 0.25f), got(m * n, 0.25f);
        ASSERT_TRUE(Linear({.input = x.data(), .weight = dq.data(), .bias = bias.data(),
                            .output = want.data(), .num_tokens = m, .in_features = k,
                            .out_features = n, .accumulate = accumulate})
                        .ok());
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                                 .output = got.data(), .num_tokens = m, .accumulate = accumulate})
                        .ok());
        for (int64_t i = 0; i < m * n; ++i) {
          ASSERT_NEAR(got[i], want[i], 1e-4f * (1.f + std::fabs(want[i])))
              << WeightDTypeName(dtype) << (permuted ? " permuted" : "") << " m=" << m
              << " i=" << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
