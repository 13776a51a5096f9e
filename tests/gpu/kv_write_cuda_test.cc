// CUDA KV write against the CPU reference: the arena bytes must be identical for every dtype.
//
// HostEncodersMatchCpuQuantizeRow runs everywhere: it encodes rows on the host with the very
// functions the device kernel uses (kernels/cuda/numeric.cuh), combined the way the kernel
// combines them, and compares with cpu::QuantizeRow. The device tests are skipped, with a
// message, where no GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/cpu/kv_write.h"
#include "kernels/cuda/kv_write.cuh"
#include "kernels/cuda/numeric.cuh"
#include "kernels/kv_dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

constexpr KvDType kAllDTypes[] = {KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,
                                  KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3};

void Store16(uint8_t* p, uint16_t w) { std::memcpy(p, &w, sizeof(w)); }

// The device kernel's EncodeRow, one lane after another: the reductions take the values in a
// different order than the warp does, which cannot matter (max, min and max |x| are exact).
void HostEncodeRow(KvDType dtype, const float* x, int64_t n, uint8_t* values, uint8_t* meta) {
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(values, x, sizeof(float) * n);
      return;
    case KvDType::kF16:
      for (int64_t i = 0; i < n; ++i) Store16(values + 2 * i, cuda::F32ToF16Bits(x[i]));
      return;
    case KvDType::kBF16:
      for (int64_t i = 0; i < n; ++i) Store16(values + 2 * i, cuda::F32ToBF16Bits(x[i]));
      return;
    case KvDType::kInt8:
    case KvDType::kFp8E4m3: {
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
      const bool fp8 = dtype == KvDType::kFp8E4m3;
      const uint16_t s16 = fp8 ? cuda::KvFp8ScaleBits(amax) : cuda::KvInt8ScaleBits(amax);
      Store16(meta, s16);
      const float s = cuda::F16BitsToF32(s16);
      for (int64_t i = 0; i < n; ++i) {
        values[i] =
            fp8 ? cuda::KvFp8Code(x[i], s) : static_cast<uint8_t>(cuda::KvInt8Code(x[i], s));
      }
      return;
    }
    case KvDType::kInt4:
      for (int64_t g0 = 0; g0 < n; g0 += kInt4GroupSize) {
        const int64_t end = std::min(n, g0 + kInt4GroupSize);
        float lo = 0.f, hi = 0.f;
        for (int64_t i = g0; i < end; ++i) {
          lo = fminf(lo, x[i]);
          hi = fmaxf(hi, x[i]);
        }
        const uint16_t s16 = cuda::KvInt4ScaleBits(lo, hi);
        const float s = cuda::F16BitsToF32(s16);
        const int z = cuda::KvInt4Zero(lo, s);
        Store16(meta + 2 * (g0 / kInt4GroupSize), cuda::KvInt4MetaWord(s16, z));
        for (int64_t i = g0; i < end; i += 2) {
          values[i / 2] = static_cast<uint8_t>(cuda::KvInt4Code(x[i], s, z) |
                                               cuda::KvInt4Code(x[i + 1], s, z) << 4);
        }
      }
      return;
  }
}

// Row `r` of a family of rows that exercise each encoder's corners: ordinary values at many
// magnitudes (fp16-subnormal and zero scales, scales that overflow fp16), all-zero rows and
// groups, one-signed rows, a lone non-zero, and exact rounding ties under power-of-two scales.
std::vector<float> TestRow(int r, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> small_int(-254, 254);
  std::vector<float> x(n);
  const float magnitudes[] = {1.f, 3e-3f, 2e-5f, 1e-7f, 1e-30f, 40.f, 1e5f, 1e7f};
  switch (r % 12) {
    case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7:
      for (float& v : x) v = magnitudes[r % 8] * normal(rng);
      break;
    case 8:  // zeros, and a group of zeros between non-zero groups
      for (int64_t i = 0; i < n; ++i) x[i] = ((r / 12) % 2 == 0 || i / 32 == 1) ? 0.f : normal(rng);
      break;
    case 9:  // one sign only (int4: the range is stretched to hold 0)
      for (float& v : x) v = ((r / 12) % 2 == 0 ? 1.f : -1.f) * (2.f + std::fabs(normal(rng)));
      break;
    case 10:  // a lone non-zero value
      x[static_cast<size_t>(r) % n] = normal(rng);
      break;
    default:  // ties: int8 scale 0.0625 (amax 7.9375) and int4 scale 1 (range [-7.5, 7.5])
      if ((r / 12) % 2 == 0) {
        for (float& v : x) v = static_cast<float>(small_int(rng)) * 0.03125f;
        x[0] = 7.9375f;
      } else {
        for (float& v : x) v = static_cast<float>(small_int(rng) % 16) * 0.5f;
        for (int64_t g0 = 0; g0 + 1 < n; g0 += 32) {
          x[g0] = -7.5f;
          x[g0 + 1] = 7.5f;
        }
      }
  }
  return x;
}

TEST(KvWriteCudaTest, HostEncodersMatchCpuQuantizeRow) {
  std::mt19937 rng(11);
  for (int64_t n : {2, 30, 48, 64, 80, 128, 256}) {
    for (KvDType dtype : kAllDTypes) {
      const KvRowLayout l = KvRowLayoutFor(dtype, n);
      for (int r = 0; r < 240; ++r) {
        std::vector<float> x = TestRow(r, n, rng);
        if (r == 239 && KvRowLayoutFor(dtype, n).meta_bytes > 0) {
          // Non-finite inputs: "unspecified (but valid) codes" on the CPU; the port gives the
          // same ones.
          x[0] = std::numeric_limits<float>::quiet_NaN();
          x[n - 1] = std::numeric_limits<float>::infinity();
        }
        std::vector<uint8_t> want_v(l.value_bytes, 0xa5), want_m(l.meta_bytes, 0xa5);
        std::vector<uint8_t> got_v(l.value_bytes, 0x5a), got_m(l.meta_bytes, 0x5a);
        cpu::QuantizeRow(dtype, x.data(), n, want_v.data(), want_m.data());
        HostEncodeRow(dtype, x.data(), n, got_v.data(), got_m.data());
        ASSERT_EQ(got_v, want_v) << KvDTypeName(dtype) << " n=" << n << " row " << r;
        ASSERT_EQ(got_m, want_m) << KvDTypeName(dtype) << " n=" << n << " row " << r;
      }
    }
  }
}

TEST(KvWriteCudaTest, HostFp8ConversionsMatchCpu) {
  for (int code = 0; code < 256; ++code) {
    const float want = cpu::Fp8E4m3ToF32(static_cast<uint8_t>(code));
    const float got = cuda::Fp8E4m3BitsToF32(static_cast<uint8_t>(code));
    ASSERT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << code;
  }
  std::mt19937 rng(12);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    // Every float bit pattern is fair game, with most draws in E4M3's range.
    uint32_t b = bits(rng);
    if (i % 4 != 0) b = (b & 0x807fffffu) | ((112u + b % 26u) << 23);
    float x;
    std::memcpy(&x, &b, sizeof(x));
    ASSERT_EQ(cuda::F32ToFp8E4m3Bits(x), cpu::F32ToFp8E4m3(x)) << x;
  }
}

// "" when equal, else where the first differing byte is (gtest would print whole arenas).
std::string FirstDifference(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      return "byte " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " +
             std::to_string(want[i]);
    }
  }
  return "";
}

struct Arenas {
  std::vector<uint8_t> k_values, v_values, k_meta, v_meta;
};

TEST(KvWriteCudaTest, ArenaBytesMatchCpuForEveryDtype) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t num_blocks = 7, kv_heads = 3, block_size = 16, n = 60;
  std::vector<std::pair<KvDType, KvDType>> pairs;
  for (KvDType d : kAllDTypes) pairs.push_back({d, d});
  pairs.push_back({KvDType::kInt8, KvDType::kInt4});
  pairs.push_back({KvDType::kBF16, KvDType::kInt8});
  pairs.push_back({KvDType::kInt4, KvDType::kF16});
  pairs.push_back({KvDType::kFp8E4m3, KvDType::kInt4});
  for (int64_t head_dim : {64, 128, 80}) {
    std::mt19937 rng(static_cast<uint32_t>(head_dim));
    // Rows of every kind, token-major as [n, kv_heads, head_dim].
    std::vector<float> key, value;
    for (int64_t row = 0; row < n * kv_heads; ++row) {
      for (float v : TestRow(static_cast<int>(row), head_dim, rng)) key.push_back(v);
      for (float v : TestRow(static_cast<int>(row) + 5, head_dim, rng)) value.push_back(v);
    }
    // Distinct slots scattered over all blocks, and a few tokens that skip (-1).
    std::vector<int64_t> all(num_blocks * block_size);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> slots(all.begin(), all.begin() + n);
    slots[3] = slots[17] = slots[40] = -1;
    for (auto [k_dtype, v_dtype] : pairs) {
      const KvRowLayout kl = KvRowLayoutFor(k_dtype, head_dim);
      const KvRowLayout vl = KvRowLayoutFor(v_dtype, head_dim);
      const int64_t rows = num_blocks * kv_heads * block_size;
      // Both sides start from the same garbage, so untouched bytes are compared too.
      std::uniform_int_distribution<int> byte(0, 255);
      auto garbage = [&](int64_t size) {
        std::vector<uint8_t> v(size);
        for (uint8_t& b : v) b = static_cast<uint8_t>(byte(rng));
        return v;
      };
      Arenas cpu_arenas{garbage(rows * kl.value_bytes), garbage(rows * vl.value_bytes),
                        garbage(rows * kl.meta_bytes), garbage(rows * vl.meta_bytes)};
      DeviceBuffer<uint8_t> dkv(cpu_arenas.k_values), dvv(cpu_arenas.v_values);
      DeviceBuffer<uint8_t> dkm(cpu_arenas.k_meta), dvm(cpu_arenas.v_meta);
      DeviceBuffer<float> dkey(key), dvalue(value);
      DeviceBuffer<int64_t> dslots(slots);
      DeviceBuffer<int32_t> dflag(std::vector<int32_t>{0});
      ASSERT_TRUE(cpu::KvWrite({.key = key.data(), .value = value.data(), .slots = slots.data(),
                                .k_cache = cpu_arenas.k_values.data(),
                                .v_cache = cpu_arenas.v_values.data(),
                                .k_meta = kl.meta_bytes ? cpu_arenas.k_meta.data() : nullptr,
                                .v_meta = vl.meta_bytes ? cpu_arenas.v_meta.data() : nullptr,
                                .k_dtype = k_dtype, .v_dtype = v_dtype, .num_tokens = n,
                                .num_blocks = num_blocks, .num_kv_heads = kv_heads,
                                .block_size = block_size, .head_dim = head_dim})
                      .ok());
      absl::Status s = cuda::LaunchKvWrite(
          {.key = dkey.get(), .value = dvalue.get(), .slots = dslots.get(),
           .k_cache = dkv.get(), .v_cache = dvv.get(),
           .k_meta = kl.meta_bytes ? dkm.get() : nullptr,
           .v_meta = vl.meta_bytes ? dvm.get() : nullptr, .invalid_slot_flag = dflag.get(),
           .k_dtype = k_dtype, .v_dtype = v_dtype, .num_tokens = n, .num_blocks = num_blocks,
           .num_kv_heads = kv_heads, .block_size = block_size, .head_dim = head_dim},
          nullptr);
      ASSERT_TRUE(s.ok()) << s;
      const std::string what = std::string(KvDTypeName(k_dtype)) + "/" +
                               std::string(KvDTypeName(v_dtype)) +
                               " head_dim=" + std::to_string(head_dim);
      EXPECT_EQ(FirstDifference(dkv.Download(), cpu_arenas.k_values), "") << "K values " << what;
      EXPECT_EQ(FirstDifference(dvv.Download(), cpu_arenas.v_values), "") << "V values " << what;
      EXPECT_EQ(FirstDifference(dkm.Download(), cpu_arenas.k_meta), "") << "K meta " << what;
      EXPECT_EQ(FirstDifference(dvm.Download(), cpu_arenas.v_meta), "") << "V meta " << what;
      EXPECT_EQ(dflag.Download()[0], 0) << what;
    }
  }
}

// The CPU reference refuses a batch with a slot outside the arena; the device skips such
// tokens (as it does -1), writes the others, and raises the flag.
TEST(KvWriteCudaTest, OutOfRangeSlotsAreSkippedAndFlagged) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t num_blocks = 2, kv_heads = 1, block_size = 8, head_dim = 64, n = 4;
  std::vector<float> key(n * head_dim, 1.5f), value(n * head_dim, -2.f);
  const std::vector<int64_t> bad_slots = {5, 16, -2, 0};  // 16 and -2 are outside the arena
  EXPECT_EQ(cpu::KvWrite({.key = key.data(), .value = value.data(), .slots = bad_slots.data(),
                          .k_cache = key.data(), .v_cache = value.data(), .num_tokens = n,
                          .num_blocks = num_blocks, .num_kv_heads = kv_heads,
                          .block_size = block_size, .head_dim = head_dim})
                .code(),
            absl::StatusCode::kInvalidArgument);
  const int64_t plane = num_blocks * kv_heads * block_size * head_dim;
  DeviceBuffer<float> dkey(key), dvalue(value);
  DeviceBuffer<float> dk(std::vector<float>(plane, 0.f)), dv(std::vector<float>(plane, 0.f));
  DeviceBuffer<int64_t> dslots(bad_slots);
  DeviceBuffer<int32_t> dflag(std::vector<int32_t>{0});
  ASSERT_TRUE(cuda::LaunchKvWrite({.key = dkey.get(), .value = dvalue.get(),
                                   .slots = dslots.get(), .k_cache = dk.get(),
                                   .v_cache = dv.get(), .invalid_slot_flag = dflag.get(),
                                   .num_tokens = n, .num_blocks = num_blocks,
                                   .num_kv_heads = kv_heads, .block_size = block_size,
                                   .head_dim = head_dim},
                                  nullptr)
                  .ok());
  const std::vector<float> k = dk.Download(), v = dv.Download();
  for (int64_t slot = 0; slot < num_blocks * block_size; ++slot) {
    const bool written = slot == 5 || slot == 0;
    for (int64_t i = 0; i < head_dim; ++i) {
      ASSERT_EQ(k[slot * head_dim + i], written ? 1.5f : 0.f) << "slot " << slot;
      ASSERT_EQ(v[slot * head_dim + i], written ? -2.f : 0.f) << "slot " << slot;
    }
  }
  EXPECT_EQ(dflag.Download()[0], 1);
}

TEST(KvWriteCudaTest, ValidateNamesTheField) {
  cuda::KvWriteParams p;
  p.num_tokens = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("key"), std::string::npos);
  float x[4];
  int64_t slot = 0;
  alignas(4) uint8_t bytes[4];
  p.key = p.value = x;
  p.slots = &slot;
  p.k_cache = p.v_cache = bytes;
  p.num_blocks = p.num_kv_heads = p.block_size = 1;
  p.head_dim = 3;
  EXPECT_NE(std::string(p.Validate().message()).find("head_dim"), std::string::npos);
  p.head_dim = 2;
  p.k_dtype = KvDType::kInt8;
  p.v_dtype = KvDType::kInt8;
  EXPECT_NE(std::string(p.Validate().message()).find("k_meta"), std::string::npos);
  p.k_meta = bytes;
  EXPECT_NE(std::string(p.Validate().message()).find("v_meta"), std::string::npos);
  p.v_meta = bytes;
  EXPECT_TRUE(p.Validate().ok());
}

}  // namespace
}  // namespace kvgrid::kernels
