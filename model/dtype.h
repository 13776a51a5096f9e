// Element types of checkpoints and KV caches, and scalar conversions.
//
// Pure functions, thread-safe. The conversions are bit-exact round-to-nearest-even (checked
// against F16C and an independent reference in tests/unit/model/dtype_test.cc); NaNs stay NaN.
#ifndef KVGRID_MODEL_DTYPE_H_
#define KVGRID_MODEL_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvgrid::model {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kI8,
  kI32,
  kU8,
};

// Bytes per element.
size_t DTypeSize(DType dtype);

// Short lower-case name: "f32", "f16", "bf16", ...
std::string_view DTypeName(DType dtype);

inline float BF16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t F32ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    // NaNs come out quiet with their payload kept, as F16C's vcvtph2ps does, so that no
    // signalling NaN reaches fp32 arithmetic.
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN: stays a quiet NaN, payload dropped
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow -> inf
  if (abs < 0x38800000u) {                        // subnormal or zero in f16
    if (abs < 0x33000000u) return sign;           // rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(exp-150) and the f16 subnormal unit is 2^-24, so the count of units is
    // mant >> (126 - exp); exp >= 102 here, so the shift is 14..24.
    const uint32_t shift = 126 - exp;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even
  r -= 0x38000000u;                                // rebias 127 -> 15
  return sign | static_cast<uint16_t>(r >> 13);
}

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_DTYPE_H_
