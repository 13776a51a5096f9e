// Scalar arithmetic shared by the device kernels: fp16/bf16 bit conversions and the per-value
// steps of the KV-cache encoders (formats in kernels/kv_dtype.h).
//
// Every function here is a port of model/dtype.h's conversions or of a step of
// kernels/cpu/kv_quant.cc's encoders, and compiles for the host as well as the device (a plain
// inline function under a host compiler). That is the point of the file: the tests run these
// exact functions on the host against the CPU reference, bit for bit, on machines without a
// GPU, so a device kernel built on them only adds its parallel structure — and the reductions
// it adds (max |x|, min, max) are exact in any order.
//
// Bit-identical on host and device because the functions use integer bit manipulation, IEEE
// single-precision division and round-half-to-even conversion only: nvcc compiles `/` as a
// correctly rounded division and keeps subnormals unless -prec-div=false, -ftz=true or
// --use_fast_math is given (kvgrid_kernels_cuda uses none of them), and there is no a * b + c
// for FMA contraction to change. Pure functions, thread-safe.
#ifndef KVGRID_KERNELS_CUDA_NUMERIC_CUH_
#define KVGRID_KERNELS_CUDA_NUMERIC_CUH_

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVGRID_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVGRID_HOST_DEVICE inline
#endif

namespace kvgrid::kernels::cuda {

inline constexpr uint16_t kF16MinSubnormalBits = 0x0001;
inline constexpr uint16_t kF16MaxFiniteBits = 0x7bff;
inline constexpr uint16_t kF16InfBits = 0x7c00;
// The largest finite fp16 with its 4 low mantissa bits clear: the largest int4 KV scale.
inline constexpr uint16_t kInt4MaxScaleBits = 0x7bf0;

KVGRID_HOST_DEVICE uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

KVGRID_HOST_DEVICE float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// model::F32ToF16: round to nearest even, overflow to inf, subnormals kept; a NaN becomes the
// quiet NaN sign | 0x7e00 (the hardware conversion would give 0x7fff, so it is not used).
KVGRID_HOST_DEVICE uint16_t F32ToF16Bits(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | kF16InfBits);
  if (abs < 0x38800000u) {  // an fp16 subnormal or zero
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24: fp16's subnormal unit is 2^-24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even
  r -= 0x38000000u;                                // rebias 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

// model::F32ToBF16: round to nearest even; a NaN keeps its top bits and is made quiet.
KVGRID_HOST_DEVICE uint16_t F32ToBF16Bits(float f) {
  uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// model::F16ToF32: exact; NaNs come out quiet with their payload kept.
KVGRID_HOST_DEVICE float F16BitsToF32(uint16_t h) {
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
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  return BitsToFloat(bits);
}

KVGRID_HOST_DEVICE float BF16BitsToF32(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// round-half-to-even of v clamped into [lo, hi], as kv_quant.cc's RoundClamp: clamping first
// keeps the conversion in range, and fmaxf sends a NaN to lo.
KVGRID_HOST_DEVICE int RoundHalfEvenClamped(float v, int lo, int hi) {
  const float c = fminf(fmaxf(v, static_cast<float>(lo)), static_cast<float>(hi));
#if defined(__CUDA_ARCH__)
  return __float2int_rn(c);
#else
  return static_cast<int>(lrintf(c));  // the default rounding mode: to nearest even
#endif
}

// --- int8 KV rows: symmetric, one fp16 scale per row ---

// The scale of a row whose largest |x| is `amax` (NaNs skipped), as fp16 bits: amax / 127
// rounded to nearest, stepped up where a subnormal scale would clip amax, at least the smallest
// subnormal when amax > 0 and at most the largest finite fp16.
KVGRID_HOST_DEVICE uint16_t KvInt8ScaleBits(float amax) {
  uint16_t s16 = F32ToF16Bits(amax / 127.f);
  if (s16 == 0 && amax > 0.f) s16 = kF16MinSubnormalBits;
  if (s16 < kF16MaxFiniteBits && amax / F16BitsToF32(s16) > 127.5f) ++s16;
  if (s16 > kF16MaxFiniteBits) s16 = kF16MaxFiniteBits;
  return s16;
}

// The code of x under the row's scale s (the fp16 scale as a float).
KVGRID_HOST_DEVICE int8_t KvInt8Code(float x, float s) {
  return static_cast<int8_t>(s > 0.f ? RoundHalfEvenClamped(x / s, -127, 127) : 0);
}

// --- int4 KV rows: asymmetric, groups of 32 channels, one 16-bit metadata word per group ---

// The scale of a group whose values span [lo, hi] with lo <= 0 <= hi, as fp16 bits with the 4
// low mantissa bits clear: (hi - lo) / 15 rounded up to such a value (capped at the largest
// finite one); 0 for an all-zero group.
KVGRID_HOST_DEVICE uint16_t KvInt4ScaleBits(float lo, float hi) {
  const float range = (hi - lo) / 15.f;
  if (!(range > 0.f)) return 0;
  uint32_t h = F32ToF16Bits(range);
  if (h < kF16InfBits && F16BitsToF32(static_cast<uint16_t>(h)) < range) ++h;  // nearest -> up
  h = (h + 0xfu) & ~0xfu;  // a mantissa carry moves into the exponent: still monotonic
  return static_cast<uint16_t>(h < kInt4MaxScaleBits ? h : kInt4MaxScaleBits);
}

// The zero point of a group with minimum lo (<= 0) under scale s.
KVGRID_HOST_DEVICE int KvInt4Zero(float lo, float s) {
  return s > 0.f ? RoundHalfEvenClamped(-lo / s, 0, 15) : 0;
}

// The 4-bit code of x in a group with scale s and zero point z.
KVGRID_HOST_DEVICE int KvInt4Code(float x, float s, int z) {
  if (!(s > 0.f)) return 0;
  const int q = RoundHalfEvenClamped(x / s, -15, 30) + z;
  return q < 0 ? 0 : (q > 15 ? 15 : q);
}

// The group's metadata word: the scale's fp16 bits with z in the 4 low mantissa bits.
KVGRID_HOST_DEVICE uint16_t KvInt4MetaWord(uint16_t scale_bits, int zero) {
  return static_cast<uint16_t>((scale_bits & 0xfff0u) | (static_cast<unsigned>(zero) & 0xfu));
}

// The decoders of a metadata word: x ~ scale * (q - zero).
KVGRID_HOST_DEVICE float KvInt4Scale(uint16_t word) {
  return F16BitsToF32(static_cast<uint16_t>(word & 0xfff0u));
}
KVGRID_HOST_DEVICE int KvInt4ZeroOf(uint16_t word) { return word & 0xf; }

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_NUMERIC_CUH_
