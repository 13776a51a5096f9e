// Rows interleaved 16 at a time (kernels/cpu/interleaved_linear.h), Q8_0, Q4_0, Q4_1 and Q4_Z:
// the layout round-trips to
// the row-major blocks byte for byte and decodes every row as the row-major blocks do; the
// AVX-512 VNNI kernel gives the exact integer block sums, scaled, for 1 to 70 tokens (tiles
// of 8, chunks of 64), with bias, accumulation and a wider output; and QuantLinear on an
// interleaved matrix agrees with the row-major int8 path and with kExact.
#include "kernels/cpu/interleaved_linear.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/q8_activations.h"
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

QuantMatrix Quantized(WeightDType dtype, int64_t rows, int64_t cols, uint64_t seed) {
  const std::vector<float> w = Random(rows * cols, seed);
  absl::StatusOr<QuantMatrix> m = QuantizeMatrix(w.data(), rows, cols, dtype);
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

// Bytes before a block's values: the fp16 scale, and Q4_1's offset or Q4_Z's zero point.
int64_t Header(WeightDType dtype) {
  return dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z ? 4 : 2;
}

constexpr WeightDType kFormats[] = {WeightDType::kQ8_0, WeightDType::kQ4_0, WeightDType::kQ4_1,
                                    WeightDType::kQ4_Z};

TEST(InterleavedLinearTest, LayoutRoundTripsAndDecodesEveryRow) {
  for (WeightDType dtype : kFormats) {
    QuantMatrix m = Quantized(dtype, 48, 96, 3);
    // Every byte pattern, -128 weights included: the layout must carry all of them.
    std::mt19937 rng(5);
    for (int64_t i = 0; i < static_cast<int64_t>(m.data.size()); ++i) {
      if (i % QuantMatrix::BlockBytes(dtype) >= Header(dtype)) m.data[i] = static_cast<uint8_t>(rng());
    }
    const QuantMatrix original = m;
    ASSERT_TRUE(CanInterleave(m));
    InterleaveRows(&m);
    EXPECT_TRUE(m.interleaved);
    EXPECT_FALSE(CanInterleave(m));
    EXPECT_EQ(m.data.size(), original.data.size());
    EXPECT_NE(m.data, original.data);
    const QuantMatrix back = RowMajor(m);
    EXPECT_FALSE(back.interleaved);
    EXPECT_EQ(back.data, original.data) << WeightDTypeName(dtype);
    std::vector<float> a(m.cols), b(m.cols);
    for (int64_t r = 0; r < m.rows; ++r) {
      DequantizeRow(original, r, a.data());
      DequantizeRow(m, r, b.data());
      ASSERT_EQ(a, b) << WeightDTypeName(dtype) << " row " << r;
    }
    EXPECT_EQ(DequantizeMatrix(m), DequantizeMatrix(original));
  }
}

TEST(InterleavedLinearTest, OnlyWholeGroupsOfTheFourFormats) {
  EXPECT_FALSE(CanInterleave(Quantized(WeightDType::kQ8_0, 40, 64, 1)));  // 40 % 16 != 0
  EXPECT_FALSE(CanInterleave(Quantized(WeightDType::kF16, 32, 64, 1)));
  QuantMatrix m = Quantized(WeightDType::kF16, 32, 64, 1);
  const std::vector<uint8_t> before = m.data;
  InterleaveRows(&m);  // a no-op
  EXPECT_FALSE(m.interleaved);
  EXPECT_EQ(m.data, before);
}

// The exact value the kernel approximates: sum over blocks of d_w d_x (integer dot), in double.
double Reference(const QuantMatrix& rowmajor, int64_t row, const Q8Activations& a, int64_t t,
                 double* magnitude) {
  const int64_t blocks = a.cols / 32, bb = QuantMatrix::BlockBytes(rowmajor.dtype);
  double sum = 0;
  *magnitude = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = rowmajor.data.data() + row * rowmajor.RowBytes() + b * bb;
    uint16_t h;
    std::memcpy(&h, block, 2);
    const double dw = model::F16ToF32(h);
    const WeightDType dtype = rowmajor.dtype;
    const uint8_t* values = block + Header(dtype);
    int64_t dot = 0, xsum = 0;
    for (int i = 0; i < 32; ++i) {
      int w;
      if (dtype == WeightDType::kQ8_0) {
        w = static_cast<int8_t>(values[i]);
      } else {
        w = (i < 16 ? values[i] & 0x0F : values[i - 16] >> 4) - (dtype == WeightDType::kQ4_0 ? 8 : 0);
      }
      dot += static_cast<int64_t>(w) * a.q[t * a.cols + b * 32 + i];
      xsum += a.q[t * a.cols + b * 32 + i];
    }
    const double dx = a.scale[t * blocks + b];
    double term = dw * dx * static_cast<double>(dot);
    if (dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z) {  // + m d_x sum(q_x)
      std::memcpy(&h, block + 2, 2);
      const double second = model::F16ToF32(h);
      const double m = dtype == WeightDType::kQ4_1 ? second : -dw * second;
      const double offset = m * dx * static_cast<double>(xsum);
      *magnitude += std::fabs(offset);
      term += offset;
    }
    sum += term;
    *magnitude += std::fabs(dw * dx * static_cast<double>(dot));
  }
  return sum;
}

TEST(InterleavedLinearTest, KernelGivesTheIntegerBlockSums) {
  if (!HaveInterleavedInt8()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU";
  for (WeightDType dtype : kFormats) {
    const int64_t rows = 64, cols = 160, ldo = 80;
    QuantMatrix m = Quantized(dtype, rows, cols, 7);
    std::mt19937 rng(9);
    for (int64_t i = 0; i < static_cast<int64_t>(m.data.size()); ++i) {
      if (i % QuantMatrix::BlockBytes(dtype) >= Header(dtype)) m.data[i] = static_cast<uint8_t>(rng());
    }
    const QuantMatrix rowmajor = m;
    InterleaveRows(&m);
    const std::vector<float> bias = Random(rows, 11);
    for (int64_t tokens : {1, 2, 5, 8, 9, 16, 17, 70}) {
      std::vector<float> x = Random(tokens * cols, 13 + tokens);
      x[5] = 40.f;  // an outlier: activations of +-127
      Q8Activations a;
      QuantizeActivations(x.data(), tokens, cols, &a);
      for (bool accumulate : {false, true}) {
        std::vector<float> out(tokens * ldo, 0.25f);
        InterleavedInt8Linear(m, a, accumulate ? bias.data() : nullptr, out.data(), ldo,
                              accumulate);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t r = 0; r < ldo; ++r) {
            const float y = out[t * ldo + r];
            if (r >= rows) {
              ASSERT_EQ(y, 0.25f) << "column " << r << " past the rows was written";
              continue;
            }
            double magnitude;
            double want = Reference(rowmajor, r, a, t, &magnitude);
            if (accumulate) want += 0.25 + bias[r];
            ASSERT_NEAR(y, want, 1e-5 * (magnitude + 1.0))
                << WeightDTypeName(dtype) << " tokens " << tokens << " token " << t << " row "
                << r;
          }
        }
      }
    }
  }
}

// The tile unit only moves the integer sums: every output equals the VNNI kernel's, bit for
// bit, for whole tiles of 16 tokens, a remainder after them, and tiles in a second chunk of 64.
TEST(InterleavedLinearTest, AmxTilesMatchTheVnniKernelBitForBit) {
  if (!HaveAmxInt8()) GTEST_SKIP() << "no AMX-INT8 on this CPU (or not granted by the kernel)";
  // 1, 2, 7, 32 and 35 blocks a row: one tile set alone, the last block on either set, part
  // of one stage of unpacked Q4_* blocks (kAmxStage, 8), four whole ones, and a part after.
  for (WeightDType dtype : kFormats) {
    for (int64_t cols : {32, 64, 224, 1024, 1120}) {
      const int64_t rows = 48;
      QuantMatrix m = Quantized(dtype, rows, cols, 41);
      std::mt19937 rng(43);
      for (int64_t i = 0; i < static_cast<int64_t>(m.data.size()); ++i) {
        if (i % QuantMatrix::BlockBytes(dtype) >= Header(dtype)) {
          m.data[i] = static_cast<uint8_t>(rng());
        }
      }
      InterleaveRows(&m);
      const std::vector<float> bias = Random(rows, 45);
      for (int64_t tokens : {16, 21, 32, 100}) {
        std::vector<float> x = Random(tokens * cols, 47 + tokens);
        x[3] = -50.f;
        Q8Activations a;
        QuantizeActivations(x.data(), tokens, cols, &a);
        for (bool accumulate : {false, true}) {
          std::vector<float> vnni(tokens * rows, 0.5f), amx(tokens * rows, 0.5f);
          InterleavedInt8LinearOn(Int8TileUnit::kVnni, m, a, accumulate ? bias.data() : nullptr,
                                  vnni.data(), rows, accumulate);
          InterleavedInt8LinearOn(Int8TileUnit::kAmx, m, a, accumulate ? bias.data() : nullptr,
                                  amx.data(), rows, accumulate);
          for (int64_t i = 0; i < tokens * rows; ++i) {
            ASSERT_EQ(amx[i], vnni[i]) << WeightDTypeName(dtype) << " cols " << cols
                                       << " tokens " << tokens << " token " << i / rows
                                       << " row " << i % rows;
          }
        }
      }
    }
  }
}

TEST(InterleavedLinearTest, QuantLinearAgreesWithTheRowMajorPaths) {
  for (WeightDType dtype : kFormats) {
    const int64_t rows = 96, cols = 256;
    const QuantMatrix rowmajor = Quantized(dtype, rows, cols, 21);
    QuantMatrix m = rowmajor;
    InterleaveRows(&m);
    for (int64_t tokens : {1, 3, 4, 12, 40}) {
      const std::vector<float> x = Random(tokens * cols, 23 + tokens);
      for (LinearPrecision precision : {LinearPrecision::kFast, LinearPrecision::kExact}) {
        std::vector<float> want(tokens * rows), got(tokens * rows);
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &rowmajor, .output = want.data(),
                                 .num_tokens = tokens, .precision = precision})
                        .ok());
        ASSERT_TRUE(QuantLinear({.input = x.data(), .weight = &m, .output = got.data(),
                                 .num_tokens = tokens, .precision = precision})
                        .ok());
        std::vector<float> w(cols);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t r = 0; r < rows; ++r) {
            DequantizeRow(rowmajor, r, w.data());
            // Where both run on 8-bit inputs they differ only in the order of fp32 sums;
            // against fp32 inputs, by the input rounding (Int8DotErrorBound).
            const double bound =
                Int8DotErrorBound(w.data(), x.data() + t * cols, cols) * 1.01 + 1e-4;
            ASSERT_NEAR(got[t * rows + r], want[t * rows + r], bound)
                << WeightDTypeName(dtype) << " tokens " << tokens << " row " << r;
          }
        }
        if (precision == LinearPrecision::kExact) {
          for (int64_t i = 0; i < tokens * rows; ++i) {
            ASSERT_NEAR(got[i], want[i], 1e-4) << "kExact reads the same weights";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
