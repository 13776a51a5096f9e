// CUDA embedding lookup against the CPU reference. Skipped, with a message, where no GPU is
// visible.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cuda/embedding.cuh"
#include "model/dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

// A lookup copies (or, for 16-bit tables, widens exactly), so results are compared bit for bit.
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

TEST(EmbeddingCudaTest, F32TableMatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (int64_t hidden : {64, 1000, 4096}) {
    const int64_t vocab = 517, n = 300;
    std::mt19937 rng(static_cast<uint32_t>(hidden));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
    std::vector<float> table(vocab * hidden), ref(n * hidden);
    std::vector<int32_t> ids(n);
    for (float& v : table) v = normal(rng);
    for (int32_t& v : ids) v = id(rng);
    ids[0] = 0;
    ids[1] = static_cast<int32_t>(vocab - 1);
    ASSERT_TRUE(cpu::Embedding({.table = table.data(), .ids = ids.data(), .output = ref.data(),
                                .vocab = vocab, .hidden = hidden, .num_tokens = n})
                    .ok());
    DeviceBuffer<float> dtable(table), dout(n * hidden);
    DeviceBuffer<int32_t> dids(ids), dflag(std::vector<int32_t>{0});
    ASSERT_TRUE(cuda::LaunchEmbedding({.table = dtable.get(), .ids = dids.get(),
                                       .output = dout.get(), .invalid_id_flag = dflag.get(),
                                       .table_dtype = model::DType::kF32, .vocab = vocab,
                                       .hidden = hidden, .num_tokens = n},
                                      nullptr)
                    .ok());
    ExpectSameBits(dout.Download(), ref);
    EXPECT_EQ(dflag.Download()[0], 0);
  }
}

TEST(EmbeddingCudaTest, SixteenBitTablesMatchCpuReferenceOnTheWidenedTable) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t vocab = 300, hidden = 896, n = 65;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(n);
  for (int32_t& v : ids) v = id(rng);
  for (model::DType dtype : {model::DType::kF16, model::DType::kBF16}) {
    std::vector<uint16_t> table16(vocab * hidden);
    std::vector<float> widened(vocab * hidden), ref(n * hidden);
    for (size_t i = 0; i < table16.size(); ++i) {
      // Include fp16 subnormals, which widening must keep.
      const float v = i % 97 == 0 ? 3e-6f * normal(rng) : normal(rng);
      table16[i] = dtype == model::DType::kF16 ? model::F32ToF16(v) : model::F32ToBF16(v);
      widened[i] = dtype == model::DType::kF16 ? model::F16ToF32(table16[i])
                                               : model::BF16ToF32(table16[i]);
    }
    ASSERT_TRUE(cpu::Embedding({.table = widened.data(), .ids = ids.data(), .output = ref.data(),
                                .vocab = vocab, .hidden = hidden, .num_tokens = n})
                    .ok());
    DeviceBuffer<uint16_t> dtable(table16);
    DeviceBuffer<float> dout(n * hidden);
    DeviceBuffer<int32_t> dids(ids);
    ASSERT_TRUE(cuda::LaunchEmbedding({.table = dtable.get(), .ids = dids.get(),
                                       .output = dout.get(), .table_dtype = dtype,
                                       .vocab = vocab, .hidden = hidden, .num_tokens = n},
                                      nullptr)
                    .ok());
    ExpectSameBits(dout.Download(), ref);
  }
}

// The CPU reference refuses the batch; the device cannot see the ids before launching, so it
// writes zeros for the bad tokens, copies the good ones, and raises the flag.
TEST(EmbeddingCudaTest, OutOfRangeIdsGiveZeroRowsAndRaiseTheFlag) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t vocab = 10, hidden = 33;
  std::vector<float> table(vocab * hidden);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<float>(i) + 1.f;
  const std::vector<int32_t> ids = {3, -1, 10, 9, INT32_MAX, INT32_MIN, 0};
  const auto n = static_cast<int64_t>(ids.size());
  std::vector<float> ref(n * hidden);
  EXPECT_EQ(cpu::Embedding({.table = table.data(), .ids = ids.data(), .output = ref.data(),
                            .vocab = vocab, .hidden = hidden, .num_tokens = n})
                .code(),
            absl::StatusCode::kInvalidArgument);
  DeviceBuffer<float> dtable(table), dout(std::vector<float>(n * hidden, -7.f));
  DeviceBuffer<int32_t> dids(ids), dflag(std::vector<int32_t>{0});
  ASSERT_TRUE(cuda::LaunchEmbedding({.table = dtable.get(), .ids = dids.get(),
                                     .output = dout.get(), .invalid_id_flag = dflag.get(),
                                     .vocab = vocab, .hidden = hidden, .num_tokens = n},
                                    nullptr)
                  .ok());
  const std::vector<float> got = dout.Download();
  for (int64_t t = 0; t < n; ++t) {
    const bool valid = ids[t] >= 0 && ids[t] < vocab;
    for (int64_t i = 0; i < hidden; ++i) {
      const float want = valid ? table[ids[t] * hidden + i] : 0.f;
      ASSERT_EQ(got[t * hidden + i], want) << "token " << t << " column " << i;
    }
  }
  EXPECT_EQ(dflag.Download()[0], 1);
}

TEST(EmbeddingCudaTest, ValidateNamesTheField) {
  cuda::EmbeddingParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("table"), std::string::npos);
  float f[2];
  int32_t id = 0;
  p.table = f;
  p.output = f;
  p.num_tokens = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("ids"), std::string::npos);
  p.ids = &id;
  p.vocab = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("hidden"), std::string::npos);
  p.hidden = 2;
  p.table_dtype = model::DType::kI8;
  EXPECT_NE(std::string(p.Validate().message()).find("table_dtype"), std::string::npos);
  p.table_dtype = model::DType::kF32;
  EXPECT_TRUE(p.Validate().ok());
  p.table_rows = 2;  // past the vocabulary of 1
  EXPECT_NE(std::string(p.Validate().message()).find("table_rows"), std::string::npos);
  p.table_rows = 1;
  p.vocab_begin = -1;
  EXPECT_NE(std::string(p.Validate().message()).find("vocab_begin"), std::string::npos);
  p.table_rows = 0;  // the whole vocabulary, which starts at row 0
  p.vocab_begin = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("vocab_begin"), std::string::npos);
}

// Tensor parallelism's lookup: each rank's slice of the table gives its own rows and zeros for
// the others' valid ids; the slices' outputs sum to the whole lookup, and only ids outside the
// vocabulary raise the flag.
TEST(EmbeddingCudaTest, VocabularySlicesSumToTheWholeLookup) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t vocab = 90, hidden = 130, ranks = 3, rows = vocab / ranks;
  std::vector<float> table(vocab * hidden);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& v : table) v = normal(rng);
  const std::vector<int32_t> ids = {0, 29, 30, 59, 60, 89, 45, 90, -3, 7};
  const auto n = static_cast<int64_t>(ids.size());
  std::vector<float> sum(n * hidden, 0.f);
  DeviceBuffer<int32_t> dids(ids);
  for (int64_t r = 0; r < ranks; ++r) {
    const std::vector<float> slice(table.begin() + r * rows * hidden,
                                   table.begin() + (r + 1) * rows * hidden);
    DeviceBuffer<float> dtable(slice), dout(std::vector<float>(n * hidden, -7.f));
    DeviceBuffer<int32_t> dflag(std::vector<int32_t>{0});
    ASSERT_TRUE(cuda::LaunchEmbedding({.table = dtable.get(), .ids = dids.get(),
                                       .output = dout.get(), .invalid_id_flag = dflag.get(),
                                       .vocab = vocab, .vocab_begin = r * rows,
                                       .table_rows = rows, .hidden = hidden, .num_tokens = n},
                                      nullptr)
                    .ok());
    const std::vector<float> got = dout.Download();
    for (int64_t t = 0; t < n; ++t) {
      const bool mine = ids[t] >= r * rows && ids[t] < (r + 1) * rows;
      for (int64_t i = 0; i < hidden; ++i) {
        const float want = mine ? table[ids[t] * hidden + i] : 0.f;
        ASSERT_EQ(got[t * hidden + i], want) << "rank " << r << " token " << t;
        sum[t * hidden + i] += got[t * hidden + i];
      }
    }
    EXPECT_EQ(dflag.Download()[0], 1) << "ids 90 and -3 are outside the vocabulary";
  }
  for (int64_t t = 0; t < n; ++t) {
    const bool valid = ids[t] >= 0 && ids[t] < vocab;
    for (int64_t i = 0; i < hidden; ++i) {
      ASSERT_EQ(sum[t * hidden + i], valid ? table[ids[t] * hidden + i] : 0.f);
    }
  }
}

}  // namespace
}  // namespace kvgrid::kernels
