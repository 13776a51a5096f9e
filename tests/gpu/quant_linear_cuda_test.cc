// CUDA quantized linear layers against cpu::QuantLinear for every block format, on the decode
// (T <= 8) and prefill paths, with and without input_perm, bias and accumulation, and the
// formats GGUF files bring (Q5_0 .. Q6_K) on random valid blocks. Skipped, with a message,
// where no GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/quant_linear.h"
#include "kernels/cuda/quant_linear.cuh"
#include "model/dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

cuda::QuantFormat FormatOf(cpu::WeightDType dtype) {
  switch (dtype) {
    case cpu::WeightDType::kQ4_0: return cuda::QuantFormat::kQ4_0;
    case cpu::WeightDType::kQ4_1: return cuda::QuantFormat::kQ4_1;
    case cpu::WeightDType::kQ4_Z: return cuda::QuantFormat::kQ4_Z;
    case cpu::WeightDType::kQ5_0: return cuda::QuantFormat::kQ5_0;
    case cpu::WeightDType::kQ5_1: return cuda::QuantFormat::kQ5_1;
    case cpu::WeightDType::kIQ4_NL: return cuda::QuantFormat::kIQ4_NL;
    case cpu::WeightDType::kQ2_K: return cuda::QuantFormat::kQ2_K;
    case cpu::WeightDType::kQ3_K: return cuda::QuantFormat::kQ3_K;
    case cpu::WeightDType::kQ4_K: return cuda::QuantFormat::kQ4_K;
    case cpu::WeightDType::kQ5_K: return cuda::QuantFormat::kQ5_K;
    case cpu::WeightDType::kQ6_K: return cuda::QuantFormat::kQ6_K;
    default: return cuda::QuantFormat::kQ8_0;
  }
}

// The formats GGUF files bring (ggml's, read as is).
constexpr cpu::WeightDType kGgufFormats[] = {
    cpu::WeightDType::kQ5_0, cpu::WeightDType::kQ5_1, cpu::WeightDType::kIQ4_NL,
    cpu::WeightDType::kQ2_K, cpu::WeightDType::kQ3_K, cpu::WeightDType::kQ4_K,
    cpu::WeightDType::kQ5_K, cpu::WeightDType::kQ6_K};

TEST(QuantLinearCudaTest, BlockBytesMatchCpu) {
  for (cpu::WeightDType dtype : {cpu::WeightDType::kQ8_0, cpu::WeightDType::kQ4_0,
                                 cpu::WeightDType::kQ4_1, cpu::WeightDType::kQ4_Z}) {
    EXPECT_EQ(cuda::QuantBlockBytes(FormatOf(dtype)), cpu::QuantMatrix::BlockBytes(dtype));
  }
  for (cpu::WeightDType dtype : kGgufFormats) {
    EXPECT_EQ(cuda::QuantBlockBytes(FormatOf(dtype)), cpu::QuantMatrix::BlockBytes(dtype));
    EXPECT_EQ(cuda::QuantBlockElements(FormatOf(dtype)), cpu::QuantMatrix::BlockElements(dtype));
  }
  EXPECT_EQ(cuda::kQuantBlockSize, cpu::kQuantBlock);
}

// Random bytes with each fp16 field (ggml's block structs) a finite value: a valid block.
cpu::QuantMatrix RandomBlocks(cpu::WeightDType dtype, int64_t rows, int64_t cols,
                              std::mt19937& rng) {
  cpu::QuantMatrix m{.dtype = dtype, .rows = rows, .cols = cols};
  m.data.resize(static_cast<size_t>(rows * m.RowBytes()));
  for (uint8_t& b : m.data) b = static_cast<uint8_t>(rng());
  std::vector<int> fp16_at = {0};
  if (dtype == cpu::WeightDType::kQ5_1 || dtype == cpu::WeightDType::kQ4_K ||
      dtype == cpu::WeightDType::kQ5_K) {
    fp16_at = {0, 2};
  } else if (dtype == cpu::WeightDType::kQ2_K) {
    fp16_at = {80, 82};
  } else if (dtype == cpu::WeightDType::kQ3_K) {
    fp16_at = {108};
  } else if (dtype == cpu::WeightDType::kQ6_K) {
    fp16_at = {208};
  }
  std::uniform_real_distribution<float> scale(-0.01f, 0.01f);
  const int64_t bb = cpu::QuantMatrix::BlockBytes(dtype);
  for (size_t b = 0; b < m.data.size(); b += static_cast<size_t>(bb)) {
    for (int at : fp16_at) {
      const uint16_t h = model::F32ToF16(scale(rng));
      std::memcpy(m.data.data() + b + at, &h, sizeof(h));
    }
  }
  return m;
}

// The GGUF formats on both paths (decode T = 1 and 5, prefill T = 70) with a bias and
// accumulation, against cpu::QuantLinear, with the tolerance argued above. n = 67: a partial
// decode block and tile; k = 512: two super-blocks, 16 groups of 32 (two per lane slot).
TEST(QuantLinearCudaTest, GgufFormatsMatchCpuQuantLinear) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t n = 67, k = 512;
  for (cpu::WeightDType dtype : kGgufFormats) {
    std::mt19937 rng(static_cast<uint32_t>(dtype) * 31 + 3);
    std::normal_distribution<float> normal(0.f, 1.f);
    const cpu::QuantMatrix m = RandomBlocks(dtype, n, k, rng);
    const std::vector<float> dense = cpu::DequantizeMatrix(m);
    DeviceBuffer<uint8_t> dw(m.data);
    for (int64_t t : {1, 5, 70}) {
      std::vector<float> x(t * k), bias(n), prev(t * n);
      for (float& v : x) v = normal(rng);
      for (float& v : bias) v = normal(rng);
      for (float& v : prev) v = normal(rng);
      std::vector<float> ref = prev;
      ASSERT_TRUE(cpu::QuantLinear({.input = x.data(), .weight = &m, .bias = bias.data(),
                                    .output = ref.data(), .num_tokens = t, .accumulate = true,
                                    .precision = cpu::LinearPrecision::kExact})
                      .ok());
      DeviceBuffer<float> dx(x), dbias(bias), dout(prev);
      const absl::Status s = cuda::LaunchQuantLinear(
          {.input = dx.get(), .weight = dw.get(), .bias = dbias.get(), .output = dout.get(),
           .format = FormatOf(dtype), .num_tokens = t, .in_features = k, .out_features = n,
           .accumulate = true},
          nullptr);
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<float> got = dout.Download();
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double mag = std::fabs(bias[j]) + std::fabs(prev[i * n + j]);
          for (int64_t c = 0; c < k; ++c) mag += std::fabs(dense[j * k + c] * x[i * k + c]);
          ASSERT_NEAR(got[i * n + j], ref[i * n + j], 1e-5 * mag + 1e-6)
              << cpu::WeightDTypeName(dtype) << " t=" << t << " at [" << i << ", " << j << "]";
        }
      }
    }
  }
  // A K-quant row must be whole super-blocks.
  cuda::QuantLinearParams p{.format = cuda::QuantFormat::kQ4_K, .num_tokens = 1,
                            .in_features = 288, .out_features = 1};
  alignas(4) uint8_t block[144] = {};
  float io[288] = {};
  p.input = io;
  p.output = io;
  p.weight = block;
  EXPECT_NE(std::string(p.Validate().message()).find("in_features"), std::string::npos);
}

// A fused projection held as parts of different formats: each part written into its columns
// of a wider output (output_stride) equals the part's own product, the other columns untouched.
TEST(QuantLinearCudaTest, OutputStrideWritesAColumnSlice) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t k = 256, rows_a = 40, rows_b = 24, n = rows_a + rows_b;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  const cpu::QuantMatrix a = RandomBlocks(cpu::WeightDType::kQ4_K, rows_a, k, rng);
  const cpu::QuantMatrix b = RandomBlocks(cpu::WeightDType::kQ6_K, rows_b, k, rng);
  DeviceBuffer<uint8_t> da(a.data), db(b.data);
  for (int64_t t : {1, 3, 70}) {
    std::vector<float> x(t * k), bias(n);
    for (float& v : x) v = normal(rng);
    for (float& v : bias) v = normal(rng);
    std::vector<float> want(t * n);
    ASSERT_TRUE(cpu::QuantLinear({.input = x.data(), .weight = &a, .bias = bias.data(),
                                  .output = want.data(), .num_tokens = t, .output_stride = n,
                                  .precision = cpu::LinearPrecision::kExact})
                    .ok());
    ASSERT_TRUE(cpu::QuantLinear({.input = x.data(), .weight = &b, .bias = bias.data() + rows_a,
                                  .output = want.data() + rows_a, .num_tokens = t,
                                  .output_stride = n,
                                  .precision = cpu::LinearPrecision::kExact})
                    .ok());
    DeviceBuffer<float> dx(x), dbias(bias), dout(std::vector<float>(t * n, 0.f));
    for (auto [w, f, r0, rows] :
         {std::tuple{da.get(), cuda::QuantFormat::kQ4_K, int64_t{0}, rows_a},
          std::tuple{db.get(), cuda::QuantFormat::kQ6_K, rows_a, rows_b}}) {
      const absl::Status s = cuda::LaunchQuantLinear(
          {.input = dx.get(), .weight = w, .bias = dbias.get() + r0, .output = dout.get() + r0,
           .format = f, .num_tokens = t, .in_features = k, .out_features = rows,
           .output_stride = n},
          nullptr);
      ASSERT_TRUE(s.ok()) << s;
    }
    const std::vector<float> got = dout.Download();
    for (int64_t i = 0; i < t * n; ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << "t=" << t << " at " << i;
    }
  }
  cuda::QuantLinearParams p{.format = cuda::QuantFormat::kQ8_0, .num_tokens = 1,
                            .in_features = 32, .out_features = 8, .output_stride = 4};
  alignas(4) uint8_t block[34 * 8] = {};
  float io[32] = {};
  p.input = io;
  p.output = io;
  p.weight = block;
  EXPECT_NE(std::string(p.Validate().message()).find("output_stride"), std::string::npos);
}

// The lookup from a table in blocks, for every format: each row the CPU's DequantizeRow, a
// vocabulary slice's other rows and invalid ids zeros, invalid ids flagged.
TEST(QuantLinearCudaTest, EmbeddingLookupDecodesTheCpuRows) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t rows = 9, hidden = 512, vocab = 12, begin = 2;  // the table: rows [2, 11)
  const std::vector<int32_t> ids = {2, 10, 5, 0, 11, 7, -1, 2};
  for (cpu::WeightDType dtype : kGgufFormats) {
    std::mt19937 rng(static_cast<uint32_t>(dtype) + 5);
    const cpu::QuantMatrix m = RandomBlocks(dtype, rows, hidden, rng);
    DeviceBuffer<uint8_t> table(m.data);
    DeviceBuffer<int32_t> dids(ids), flag(std::vector<int32_t>{0});
    DeviceBuffer<float> out(std::vector<float>(ids.size() * hidden, -1.f));
    const absl::Status s = cuda::LaunchQuantEmbedding(
        {.table = table.get(), .ids = dids.get(), .output = out.get(),
         .invalid_id_flag = flag.get(), .format = FormatOf(dtype), .vocab = vocab,
         .vocab_begin = begin, .table_rows = rows, .hidden = hidden,
         .num_tokens = static_cast<int64_t>(ids.size())},
        nullptr);
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> got = out.Download();
    std::vector<float> want(hidden);
    for (size_t t = 0; t < ids.size(); ++t) {
      const int64_t local = ids[t] - begin;
      if (local >= 0 && local < rows) {
        cpu::DequantizeRow(m, local, want.data());
      } else {
        std::fill(want.begin(), want.end(), 0.f);
      }
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(got[t * hidden + i], want[i])
            << cpu::WeightDTypeName(dtype) << " token " << t << " column " << i;
      }
    }
    EXPECT_EQ(flag.Download()[0], 1) << cpu::WeightDTypeName(dtype);
  }
  cuda::QuantEmbeddingParams p{.format = cuda::QuantFormat::kQ4_K, .vocab = 4, .hidden = 288};
  alignas(4) uint8_t block[144] = {};
  float out[288] = {};
  p.table = block;
  p.output = out;
  EXPECT_NE(std::string(p.Validate().message()).find("hidden"), std::string::npos);
}

// Tolerance. Both sides multiply the same dequantized weights (the device decodes each weight
// with the CPU's arithmetic) by the same inputs in fp32 (the CPU's kExact precision: the device
// has no 8-bit input path); only the order of the sums differs
// (OpenBLAS / AVX2 lanes on the CPU, lanes, warps and tiles on the device). Each ordering is
// within about 2^-24 * sqrt(K) * S of the exact sum for random data, S = sum_k |w_k x_k|
// (plus the bias and the previous output when accumulating); 1e-5 * S + 1e-6 is a generous
// bound that a wrong weight, column or permutation would still break by orders of magnitude.
TEST(QuantLinearCudaTest, MatchesCpuQuantLinear) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  struct Shape {
    int64_t n, k;
  };
  // 203 rows: a partial 4-row decode block and a partial 64-row tile. k = 96: fewer blocks than
  // a warp's 8 block slots; k = 1024: several steps of both kernels.
  for (Shape shape : {Shape{203, 96}, Shape{203, 1024}}) {
    const int64_t n = shape.n, k = shape.k;
    for (cpu::WeightDType dtype : {cpu::WeightDType::kQ8_0, cpu::WeightDType::kQ4_0,
                                   cpu::WeightDType::kQ4_1, cpu::WeightDType::kQ4_Z}) {
      std::mt19937 rng(static_cast<uint32_t>(k) * 7 + static_cast<uint32_t>(dtype));
      std::normal_distribution<float> normal(0.f, 1.f);
      std::vector<float> w(n * k);
      for (size_t i = 0; i < w.size(); ++i) {
        // Per-row offsets, so Q4_1's and Q4_Z's offsets and zero points vary.
        w[i] = 0.05f * normal(rng) + 0.02f * static_cast<float>(i / k % 5) - 0.04f;
      }
      absl::StatusOr<cpu::QuantMatrix> m = cpu::QuantizeMatrix(w.data(), n, k, dtype);
      ASSERT_TRUE(m.ok()) << m.status();
      std::vector<int32_t> perm(k);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      DeviceBuffer<uint8_t> dw(m->data);
      DeviceBuffer<int32_t> dperm(perm);
      for (bool use_perm : {false, true}) {
        m->input_perm = use_perm ? perm : std::vector<int32_t>{};
        const std::vector<float> dense = cpu::DequantizeMatrix(*m);  // input order
        for (int64_t t : {1, 3, 8, 33, 130}) {
          for (int variant = 0; variant < 4; ++variant) {
            const bool use_bias = variant & 1, accumulate = variant & 2;
            std::vector<float> x(t * k), bias(n), prev(t * n);
            for (float& v : x) v = normal(rng);
            for (float& v : bias) v = normal(rng);
            for (float& v : prev) v = normal(rng);
            std::vector<float> ref = prev;
            ASSERT_TRUE(cpu::QuantLinear({.input = x.data(), .weight = &*m,
                                          .bias = use_bias ? bias.data() : nullptr,
                                          .output = ref.data(), .num_tokens = t,
                                          .accumulate = accumulate,
                                          .precision = cpu::LinearPrecision::kExact})
                            .ok());
            DeviceBuffer<float> dx(x), dbias(bias), dout(prev);
            const absl::Status s = cuda::LaunchQuantLinear(
                {.input = dx.get(), .weight = dw.get(),
                 .input_perm = use_perm ? dperm.get() : nullptr,
                 .bias = use_bias ? dbias.get() : nullptr, .output = dout.get(),
                 .format = FormatOf(dtype), .num_tokens = t, .in_features = k,
                 .out_features = n, .accumulate = accumulate},
                nullptr);
            ASSERT_TRUE(s.ok()) << s;
            const std::vector<float> got = dout.Download();
            for (int64_t i = 0; i < t; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double mag = (use_bias ? std::fabs(bias[j]) : 0.0) +
                             (accumulate ? std::fabs(prev[i * n + j]) : 0.0);
                for (int64_t c = 0; c < k; ++c) mag += std::fabs(dense[j * k + c] * x[i * k + c]);
                ASSERT_NEAR(got[i * n + j], ref[i * n + j], 1e-5 * mag + 1e-6)
                    << cpu::WeightDTypeName(dtype) << " k=" << k << " t=" << t
                    << " perm=" << use_perm << " bias=" << use_bias
                    << " accumulate=" << accumulate << " at [" << i << ", " << j << "]";
              }
            }
          }
        }
      }
    }
  }
}

// A permutation entry outside [0, in_features) reads 0 instead of memory outside the input.
TEST(QuantLinearCudaTest, OutOfRangePermutationEntriesReadZero) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t n = 5, k = 64;
  std::vector<float> w(n * k, 0.5f);
  absl::StatusOr<cpu::QuantMatrix> m =
      cpu::QuantizeMatrix(w.data(), n, k, cpu::WeightDType::kQ8_0);
  ASSERT_TRUE(m.ok());
  const float stored = cpu::DequantizeMatrix(*m)[0];  // 0.5 as Q8_0 holds it
  std::vector<int32_t> perm(k);
  std::iota(perm.begin(), perm.end(), 0);
  perm[3] = -1;
  perm[10] = static_cast<int32_t>(k);
  perm[40] = INT32_MAX;
  for (int64_t t : {2, 20}) {  // both paths
    std::vector<float> x(t * k, 1.f);
    DeviceBuffer<float> dx(x), dout(t * n);
    DeviceBuffer<uint8_t> dw(m->data);
    DeviceBuffer<int32_t> dperm(perm);
    ASSERT_TRUE(cuda::LaunchQuantLinear({.input = dx.get(), .weight = dw.get(),
                                         .input_perm = dperm.get(), .output = dout.get(),
                                         .format = cuda::QuantFormat::kQ8_0, .num_tokens = t,
                                         .in_features = k, .out_features = n},
                                        nullptr)
                    .ok());
    for (float v : dout.Download()) EXPECT_NEAR(v, stored * (k - 3), 1e-4) << "t=" << t;
  }
}

TEST(QuantLinearCudaTest, ValidateNamesTheField) {
  cuda::QuantLinearParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("weight"), std::string::npos);
  alignas(4) uint8_t block[34] = {};
  float x[2];
  p.weight = block;
  p.output = x;
  p.num_tokens = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("input"), std::string::npos);
  p.input = x;
  p.in_features = 48;
  p.out_features = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("in_features"), std::string::npos);
  p.in_features = 32;
  EXPECT_TRUE(p.Validate().ok());
  p.weight = block + 1;
  EXPECT_NE(std::string(p.Validate().message()).find("weight"), std::string::npos);
  p.weight = block;
  p.num_tokens = cuda::kQuantLinearMaxTokens + 1;
  EXPECT_NE(std::string(p.Validate().message()).find("num_tokens"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::kernels
