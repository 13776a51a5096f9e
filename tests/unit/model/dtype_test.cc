#include "model/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVGRID_TEST_HAVE_X86 1
#endif

#include "gtest/gtest.h"

namespace kvgrid::model {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// --- Slow, independent references ------------------------------------------------------

// The value of an fp16 bit pattern, from the format's definition.
double F16Value(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0x1f) {
    return mant == 0 ? sign * std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  }
  if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
  return sign * std::ldexp(static_cast<double>(mant + 1024), exp - 25);
}

// Round-to-nearest-even onto a format given as the ascending list of its non-negative finite
// values, indexed by bit pattern, plus the value the format would have next if its exponent
// were unbounded (IEEE rounds overflow as if it were, then maps it to infinity, which is the
// next bit pattern). Returns the bit pattern of the magnitude.
uint16_t RoundToTable(double magnitude, const std::vector<double>& table) {
  // First entry > magnitude.
  const auto hi_it = std::upper_bound(table.begin(), table.end(), magnitude);
  if (hi_it == table.end()) return static_cast<uint16_t>(table.size() - 1);  // >= "next" -> inf
  const size_t hi = static_cast<size_t>(hi_it - table.begin());
  const size_t lo = hi - 1;  // table[0] == 0 <= magnitude
  const double below = magnitude - table[lo];
  const double above = table[hi] - magnitude;
  if (below < above) return static_cast<uint16_t>(lo);
  if (above < below) return static_cast<uint16_t>(hi);
  return static_cast<uint16_t>((lo % 2 == 0) ? lo : hi);
}

const std::vector<double>& F16Table() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (uint32_t h = 0; h < 0x7c00; ++h) t.push_back(F16Value(static_cast<uint16_t>(h)));
    t.push_back(65536.0);  // where 0x7c00 would sit with an unbounded exponent
    return t;
  }();
  return table;
}

const std::vector<double>& BF16Table() {
  static const std::vector<double> table = [] {
    std::vector<double> t;
    for (uint32_t h = 0; h < 0x7f80; ++h) t.push_back(FromBits(h << 16));
    t.push_back(std::ldexp(1.0, 128));
    return t;
  }();
  return table;
}

uint16_t RefF32ToF16(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(f)) return sign | 0x7c00;
  return sign | RoundToTable(std::fabs(static_cast<double>(f)), F16Table());
}

uint16_t RefF32ToBF16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(f)) return sign | 0x7f80;
  return sign | RoundToTable(std::fabs(static_cast<double>(f)), BF16Table());
}

#ifdef KVGRID_TEST_HAVE_X86
// The hardware conversion, used as a second reference where the CPU has F16C.
__attribute__((target("f16c"))) uint16_t HwF32ToF16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float HwF16ToF32(uint16_t h) { return _cvtsh_ss(h); }
bool HaveF16C() { return __builtin_cpu_supports("f16c"); }
#else
uint16_t HwF32ToF16(float) { return 0; }
float HwF16ToF32(uint16_t) { return 0; }
bool HaveF16C() { return false; }
#endif

bool IsF16NaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }
bool IsBF16NaN(uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }

// Floats that stress rounding: every representable value of the 16-bit format, the midpoints
// between neighbours (ties), one float ulp either side of each midpoint, and random bits.
std::vector<float> RoundingSamples(float (*to_f32)(uint16_t), uint32_t finite_end) {
  std::vector<float> samples;
  for (uint32_t h = 0; h < finite_end; ++h) {
    const double a = to_f32(static_cast<uint16_t>(h));
    // Past the largest finite value, the next step is one more ulp of the same size.
    const double b = h + 1 < finite_end ? static_cast<double>(to_f32(static_cast<uint16_t>(h + 1)))
                                        : 2.0 * a - to_f32(static_cast<uint16_t>(h - 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact: fits in a float
    for (float v : {static_cast<float>(a), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, std::numeric_limits<float>::infinity())}) {
      samples.push_back(v);
      samples.push_back(-v);
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 1000000; ++i) samples.push_back(FromBits(rng()));
  for (float v : {0.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                  65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e-8f, 2.9802322e-8f /* 2^-25 */,
                  5.9604645e-8f /* 2^-24 */}) {
    samples.push_back(v);
    samples.push_back(-v);
  }
  return samples;
}

// --- Tests -----------------------------------------------------------------------------

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeName(DType::kF32), "f32");
  EXPECT_EQ(DTypeName(DType::kF16), "f16");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kI8), "i8");
  EXPECT_EQ(DTypeName(DType::kU8), "u8");
  EXPECT_EQ(DTypeName(DType::kI32), "i32");
}

TEST(DTypeTest, F16ToF32MatchesDefinitionForAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = F16ToF32(static_cast<uint16_t>(h));
    const double want = F16Value(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
      // The payload moves into the top of the f32 mantissa and the NaN comes out quiet.
      EXPECT_EQ(Bits(got) & 0x7fffffu, ((h & 0x3ffu) << 13) | 0x400000u) << std::hex << h;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
    }
  }
}

TEST(DTypeTest, F16RoundTripsAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = F32ToF16(F16ToF32(static_cast<uint16_t>(h)));
    if (IsF16NaN(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(IsF16NaN(back)) << std::hex << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(DTypeTest, F32ToF16RoundsToNearestEven) {
  const std::vector<float> samples = RoundingSamples(&F16ToF32, 0x7c00);
  int failures = 0;
  for (float f : samples) {
    const uint16_t got = F32ToF16(f);
    const uint16_t want = RefF32ToF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(IsF16NaN(got)) << f;
      continue;
    }
    if (got != want && ++failures <= 20) {
      ADD_FAILURE() << "F32ToF16(" << f << " = 0x" << std::hex << Bits(f) << ") = 0x" << got
                    << ", want 0x" << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(DTypeTest, F16ConversionsMatchHardware) {
  if (!HaveF16C()) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = F16ToF32(static_cast<uint16_t>(h));
    const float hw = HwF16ToF32(static_cast<uint16_t>(h));
    EXPECT_EQ(Bits(got), Bits(hw)) << std::hex << h;
  }
  const std::vector<float> samples = RoundingSamples(&F16ToF32, 0x7c00);
  int failures = 0;
  for (float f : samples) {
    if (std::isnan(f)) continue;
    const uint16_t got = F32ToF16(f);
    const uint16_t hw = HwF32ToF16(f);
    if (got != hw && ++failures <= 20) {
      ADD_FAILURE() << "F32ToF16(0x" << std::hex << Bits(f) << ") = 0x" << got << ", F16C says 0x"
                    << hw;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(DTypeTest, BF16ToF32IsExactForAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = BF16ToF32(static_cast<uint16_t>(h));
    EXPECT_EQ(Bits(got), h << 16) << std::hex << h;
  }
}

TEST(DTypeTest, BF16RoundTripsAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = F32ToBF16(BF16ToF32(static_cast<uint16_t>(h)));
    if (IsBF16NaN(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(IsBF16NaN(back)) << std::hex << h;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << h;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

TEST(DTypeTest, F32ToBF16RoundsToNearestEven) {
  const std::vector<float> samples = RoundingSamples(&BF16ToF32, 0x7f80);
  int failures = 0;
  for (float f : samples) {
    const uint16_t got = F32ToBF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(IsBF16NaN(got)) << std::hex << Bits(f);
      continue;
    }
    const uint16_t want = RefF32ToBF16(f);
    if (got != want && ++failures <= 20) {
      ADD_FAILURE() << "F32ToBF16(0x" << std::hex << Bits(f) << ") = 0x" << got << ", want 0x"
                    << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(DTypeTest, F32ToBF16KeepsEveryNaNANaN) {
  // NaNs whose payload sits only in the low 16 bits would truncate to infinity.
  for (uint32_t low : {1u, 0x7fffu, 0x8000u, 0xffffu}) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float nan = FromBits(sign | 0x7f800000u | low);
      ASSERT_TRUE(std::isnan(nan));
      const uint16_t got = F32ToBF16(nan);
      EXPECT_TRUE(IsBF16NaN(got)) << std::hex << low;
      EXPECT_EQ(got & 0x8000, sign >> 16);
    }
  }
}

TEST(DTypeTest, SpotValues) {
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // tie between max and "65536" -> inf
  EXPECT_EQ(F32ToF16(65519.996f), 0x7bff);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (zero)
  EXPECT_EQ(F32ToF16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units -> tie -> even (2)
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(F32ToBF16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBF16(FromBits(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(F32ToBF16(FromBits(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(F32ToBF16(-std::numeric_limits<float>::infinity()), 0xff80);
}

}  // namespace
}  // namespace kvgrid::model
