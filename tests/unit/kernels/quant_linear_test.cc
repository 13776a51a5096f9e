// Q8_0 / Q4_0 / Q4_1 weights: round-trip error within the quantization step's bound, the block
// layouts (ggml's), and QuantLinear equal to dequantize-then-matmul at decode and prefill
// sizes, with and without an input permutation; the same for the formats read from GGUF files
// (Q5_0 .. Q6_K) on random valid blocks. Their decoding itself is checked bit for bit against
// the `gguf` package in tests/reference/test_gguf_kquants.py.
#include "kernels/cpu/quant_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ggml_blocks.h"
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
        std::pair{WeightDType::kQ4_Z, true}, std::pair{WeightDType::kF16, false},
        std::pair{WeightDType::kBF16, false}}) {
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
        // kExact: fp32 inputs (the 8-bit ones of kFast are q8_activations_test's).
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                                 .output = got.data(), .num_tokens = m, .accumulate = accumulate,
                                 .precision = LinearPrecision::kExact})
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

// 16-bit weights at batched-decode sizes (4 to 16 tokens: blocks of 4 rows x 4 tokens on
// AVX-512, with a tail of tokens), with bias, accumulation and a wider output, equal to the
// product with the decoded matrix.
TEST(QuantLinearTest, Float16BatchesMatchTheDecodedMatrix) {
  const int64_t n = 64, k = 192, ldo = 70;
  const std::vector<float> w = Random(n * k, 31), bias = Random(n, 32);
  for (WeightDType dtype : {WeightDType::kF16, WeightDType::kBF16}) {
    auto q = QuantizeMatrix(w.data(), n, k, dtype);
    ASSERT_TRUE(q.ok());
    const std::vector<float> dq = DequantizeMatrix(*q);
    for (int64_t m : {4, 5, 8, 15, 16}) {
      const std::vector<float> x = Random(m * k, 40 + m);
      for (bool accumulate : {false, true}) {
        std::vector<float> got(m * ldo, 0.5f);
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                                 .output = got.data(), .num_tokens = m, .accumulate = accumulate,
                                 .output_stride = ldo})
                        .ok());
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t j = 0; j < ldo; ++j) {
            if (j >= n) {
              ASSERT_EQ(got[t * ldo + j], 0.5f) << "past the rows";
              continue;
            }
            double want = bias[j] + (accumulate ? 0.5 : 0.0);
            for (int64_t i = 0; i < k; ++i) want += double(x[t * k + i]) * dq[j * k + i];
            ASSERT_NEAR(got[t * ldo + j], want, 1e-4 * (1.0 + std::fabs(want)))
                << WeightDTypeName(dtype) << " m=" << m << " t=" << t << " j=" << j;
          }
        }
      }
    }
  }
}

// F16/BF16 matrices: each weight the nearest 16-bit float (rows decoded to exactly
// model::F16ToF32/BF16ToF32 of the stored bits), at any width (here not a multiple of the
// 8-wide vectors), and QuantLinear equal to the product with the decoded matrix at decode and
// prefill sizes.
TEST(QuantLinearTest, SixteenBitWeightsAtAnyWidth) {
  const int64_t n = 13, k = 45;
  const std::vector<float> w = Random(n * k, 31);
  for (WeightDType dtype : {WeightDType::kF16, WeightDType::kBF16}) {
    auto q = QuantizeMatrix(w.data(), n, k, dtype);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(QuantMatrix::BlockElements(dtype), 1);
    EXPECT_EQ(q->RowBytes(), 2 * k);
    const std::vector<float> dq = DequantizeMatrix(*q);
    for (int64_t i = 0; i < n * k; ++i) {
      const uint16_t h = dtype == WeightDType::kF16 ? model::F32ToF16(w[i]) : model::F32ToBF16(w[i]);
      const float want = dtype == WeightDType::kF16 ? model::F16ToF32(h) : model::BF16ToF32(h);
      ASSERT_EQ(dq[i], want) << WeightDTypeName(dtype) << " element " << i;
    }
    for (int64_t m : {1, 2, 3, 4, 6}) {
      const std::vector<float> x = Random(m * k, 40 + m);
      std::vector<float> want(m * n), got(m * n);
      ASSERT_TRUE(Linear({.input = x.data(), .weight = dq.data(), .output = want.data(),
                          .num_tokens = m, .in_features = k, .out_features = n})
                      .ok());
      ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .output = got.data(),
                               .num_tokens = m})
                      .ok());
      for (int64_t i = 0; i < m * n; ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-5f * (1.f + std::fabs(want[i])))
            << WeightDTypeName(dtype) << " m=" << m << " i=" << i;
      }
    }
  }
  EXPECT_EQ(*ParseWeightDType("fp16"), WeightDType::kF16);
  EXPECT_EQ(*ParseWeightDType("bf16"), WeightDType::kBF16);
}

// Random bytes with each fp16 field replaced by a finite value of moderate size: any such block
// is a valid one (every bit pattern of the quantized values means something).
QuantMatrix RandomBlocks(WeightDType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  QuantMatrix m{.dtype = dtype, .rows = rows, .cols = cols};
  m.data.resize(static_cast<size_t>(rows * m.RowBytes()));
  for (uint8_t& b : m.data) b = static_cast<uint8_t>(rng());
  std::vector<int> fp16_at;
  switch (dtype) {
    case WeightDType::kQ4_1: case WeightDType::kQ5_1: case WeightDType::kQ4_K:
    case WeightDType::kQ5_K: fp16_at = {0, 2}; break;
    case WeightDType::kQ2_K: fp16_at = {80, 82}; break;
    case WeightDType::kQ3_K: fp16_at = {108}; break;
    case WeightDType::kQ6_K: fp16_at = {208}; break;
    default: fp16_at = {0};
  }
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  const int64_t bb = QuantMatrix::BlockBytes(dtype);
  for (size_t b = 0; b < m.data.size(); b += bb) {
    for (int at : fp16_at) {
      const uint16_t h = model::F32ToF16(scale(rng));
      std::memcpy(m.data.data() + b + at, &h, 2);
    }
  }
  return m;
}

TEST(QuantLinearTest, GgufFormatsMatchDequantizeThenMatmul) {
  const int64_t n = 70, k = 768;  // 3 super-blocks; k is not a multiple of the 512-weight chunk
  const std::vector<float> bias = Random(n, 8);
  for (WeightDType dtype : {WeightDType::kQ5_0, WeightDType::kQ5_1, WeightDType::kIQ4_NL,
                            WeightDType::kQ2_K, WeightDType::kQ3_K, WeightDType::kQ4_K,
                            WeightDType::kQ5_K, WeightDType::kQ6_K}) {
    const QuantMatrix q = RandomBlocks(dtype, n, k, static_cast<uint64_t>(dtype));
    const std::vector<float> dq = DequantizeMatrix(q);
    double magnitude = 0;
    for (float v : dq) magnitude += std::fabs(v);
    EXPECT_GT(magnitude, 0.0) << WeightDTypeName(dtype);
    for (int64_t m : {1, 2, 4, 9}) {
      const std::vector<float> x = Random(m * k, 20 + m);
      std::vector<float> want(m * n, 0.5f), got(m * n, 0.5f);
      ASSERT_TRUE(Linear({.input = x.data(), .weight = dq.data(), .bias = bias.data(),
                          .output = want.data(), .num_tokens = m, .in_features = k,
                          .out_features = n, .accumulate = true})
                      .ok());
      ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &q, .bias = bias.data(),
                               .output = got.data(), .num_tokens = m, .accumulate = true})
                      .ok());
      for (int64_t i = 0; i < m * n; ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-4f * (1.f + std::fabs(want[i])))
            << WeightDTypeName(dtype) << " m=" << m << " i=" << i;
      }
    }
  }
  // K-quant rows must be whole super-blocks; QuantizeMatrix does not write these formats.
  QuantMatrix bad = RandomBlocks(WeightDType::kQ4_K, 1, 256, 1);
  bad.rows = 2;
  bad.cols = 128;
  std::vector<float> x(256), y(2);
  EXPECT_EQ(QuantLinear({.input = x.data(), .weight = &bad, .output = y.data(), .num_tokens = 1})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(QuantizeMatrix(x.data(), 1, 256, WeightDType::kQ4_K).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(QuantLinearTest, SimdDecodersGiveThePortableFloats) {
  for (WeightDType dtype : {WeightDType::kQ5_0, WeightDType::kQ5_1, WeightDType::kIQ4_NL,
                            WeightDType::kQ2_K, WeightDType::kQ3_K, WeightDType::kQ4_K,
                            WeightDType::kQ5_K, WeightDType::kQ6_K}) {
    const QuantMatrix q = RandomBlocks(dtype, 3, 1024, 40 + static_cast<uint64_t>(dtype));
    const int64_t blocks = 3 * 1024 / QuantMatrix::BlockElements(dtype);
    std::vector<float> best(3 * 1024), portable(3 * 1024);
    ASSERT_TRUE(DecodeGgmlBlocks(dtype, q.data.data(), blocks, best.data()));
    ASSERT_TRUE(DecodeGgmlBlocksPortable(dtype, q.data.data(), blocks, portable.data()));
    for (size_t i = 0; i < best.size(); ++i) {
      uint32_t a, b;
      std::memcpy(&a, &best[i], 4);
      std::memcpy(&b, &portable[i], 4);
      ASSERT_EQ(a, b) << WeightDTypeName(dtype) << " element " << i << ": " << best[i] << " vs "
                      << portable[i];
    }
  }
  std::vector<float> out(32);
  const uint8_t block[34] = {};
  EXPECT_FALSE(DecodeGgmlBlocks(WeightDType::kQ8_0, block, 1, out.data()));
}

// output_stride: a matrix's product written as a column slice of a wider output, for decode
// and prefill sizes, the rest of each output row untouched; a stride below the rows refused.
TEST(QuantLinearTest, OutputStrideWritesAColumnSlice) {
  const int64_t rows = 24, cols = 64, width = 40, offset = 9;
  const std::vector<float> w = Random(rows * cols, 21);
  auto q = QuantizeMatrix(w.data(), rows, cols, WeightDType::kQ8_0);
  ASSERT_TRUE(q.ok()) << q.status();
  for (int64_t n : {1, 3, 40}) {
    const std::vector<float> x = Random(n * cols, 22 + n), bias = Random(rows, 23);
    std::vector<float> want(n * rows);
    ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                             .output = want.data(), .num_tokens = n})
                    .ok());
    std::vector<float> got(n * width, -7.f);
    ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &*q, .bias = bias.data(),
                             .output = got.data() + offset, .num_tokens = n,
                             .output_stride = width})
                    .ok());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < width; ++c) {
        const float g = got[t * width + c];
        if (c < offset || c >= offset + rows) {
          ASSERT_EQ(g, -7.f) << "n=" << n << " token " << t << " column " << c;
        } else {
          ASSERT_NEAR(g, want[t * rows + c - offset], 1e-4f) << "n=" << n << " token " << t;
        }
      }
    }
  }
  float out[64];
  EXPECT_FALSE(QuantLinear({.input = w.data(), .weight = &*q, .output = out, .num_tokens = 1,
                            .output_stride = rows - 1})
                   .ok());
}

// The embedding lookup from a table in blocks: each row DequantizeRow's; an id outside the
// vocabulary and blocks of the wrong shape are INVALID_ARGUMENT.
TEST(QuantLinearTest, EmbeddingFromBlocksDecodesTheRowsLookedUp) {
  const int64_t vocab = 10, hidden = 64;
  const std::vector<float> w = Random(vocab * hidden, 31);
  auto q = QuantizeMatrix(w.data(), vocab, hidden, WeightDType::kQ4_0);
  ASSERT_TRUE(q.ok()) << q.status();
  const std::vector<int32_t> ids = {3, 0, 9, 3};
  std::vector<float> got(ids.size() * hidden), want(hidden);
  ASSERT_TRUE(Embedding({.blocks = &*q, .ids = ids.data(), .output = got.data(), .vocab = vocab,
                         .hidden = hidden, .num_tokens = 4})
                  .ok());
  for (size_t t = 0; t < ids.size(); ++t) {
    DequantizeRow(*q, ids[t], want.data());
    for (int64_t i = 0; i < hidden; ++i) ASSERT_EQ(got[t * hidden + i], want[i]) << t;
  }
  const int32_t bad = 10;
  EXPECT_EQ(Embedding({.blocks = &*q, .ids = &bad, .output = got.data(), .vocab = vocab,
                       .hidden = hidden, .num_tokens = 1})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Embedding({.blocks = &*q, .ids = ids.data(), .output = got.data(), .vocab = vocab + 1,
                       .hidden = hidden, .num_tokens = 1})
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(QuantLinearTest, BlockSizesAreGgmls) {
  struct Case {
    WeightDType dtype;
    model::GgmlType ggml;
    int64_t elements, bytes;
  };
  for (Case c : {Case{WeightDType::kQ5_0, model::GgmlType::kQ5_0, 32, 22},
                 Case{WeightDType::kQ5_1, model::GgmlType::kQ5_1, 32, 24},
                 Case{WeightDType::kIQ4_NL, model::GgmlType::kIQ4_NL, 32, 18},
                 Case{WeightDType::kQ2_K, model::GgmlType::kQ2_K, 256, 84},
                 Case{WeightDType::kQ3_K, model::GgmlType::kQ3_K, 256, 110},
                 Case{WeightDType::kQ4_K, model::GgmlType::kQ4_K, 256, 144},
                 Case{WeightDType::kQ5_K, model::GgmlType::kQ5_K, 256, 176},
                 Case{WeightDType::kQ6_K, model::GgmlType::kQ6_K, 256, 210}}) {
    EXPECT_EQ(QuantMatrix::BlockElements(c.dtype), c.elements) << WeightDTypeName(c.dtype);
    EXPECT_EQ(QuantMatrix::BlockBytes(c.dtype), c.bytes) << WeightDTypeName(c.dtype);
    EXPECT_EQ(model::GgmlBlockElements(c.ggml), c.elements);
    EXPECT_EQ(model::GgmlBlockBytes(c.ggml), c.bytes);
    EXPECT_EQ(WeightDTypeOfGgml(c.ggml), c.dtype);
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
