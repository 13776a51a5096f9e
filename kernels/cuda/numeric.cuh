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

// The fp16 scale bits of a row whose largest |x| is `amax` (NaNs skipped), for codes up to
// `qmax`, as kv_quant.cc's RowScaleF16: amax / qmax rounded to nearest, stepped up where a
// subnormal scale would put amax / s past `limit`, at least the smallest subnormal when
// amax > 0 and at most the largest finite fp16.
KVGRID_HOST_DEVICE uint16_t KvRowScaleBits(float amax, float qmax, float limit) {
  uint16_t s16 = F32ToF16Bits(amax / qmax);
  if (s16 == 0 && amax > 0.f) s16 = kF16MinSubnormalBits;
  if (s16 < kF16MaxFiniteBits && amax / F16BitsToF32(s16) > limit) ++s16;
  if (s16 > kF16MaxFiniteBits) s16 = kF16MaxFiniteBits;
  return s16;
}

// The int8 row scale: amax / 127, stepped up past 127.5.
KVGRID_HOST_DEVICE uint16_t KvInt8ScaleBits(float amax) {
  return KvRowScaleBits(amax, 127.f, 127.5f);
}

// The code of x under the row's scale s (the fp16 scale as a float).
KVGRID_HOST_DEVICE int8_t KvInt8Code(float x, float s) {
  return static_cast<int8_t>(s > 0.f ? RoundHalfEvenClamped(x / s, -127, 127) : 0);
}

// --- fp8_e4m3 KV rows: one fp16 scale per row, E4M3 codes ---

inline constexpr float kFp8E4m3Max = 448.f;

// The fp8 row scale: amax / 448, stepped up past 464 (the rounding limit above 448).
KVGRID_HOST_DEVICE uint16_t KvFp8ScaleBits(float amax) {
  return KvRowScaleBits(amax, kFp8E4m3Max, 464.f);
}

// kv_quant.h's F32ToFp8E4m3: nearest E4M3 value, half to even, saturating at +-448, a NaN
// giving -448's code. (Not cuda_fp8.h's conversion: that one writes NaN codes, and has no host
// twin to test against.)
KVGRID_HOST_DEVICE uint8_t F32ToFp8E4m3Bits(float x) {
  x = fminf(fmaxf(x, -kFp8E4m3Max), kFp8E4m3Max);
  const uint32_t bits = FloatToBits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs < 0x3c800000u) {  // below 2^-6: subnormal steps of 2^-9 (exact scaling by 512)
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(
                                           RoundHalfEvenClamped(BitsToFloat(abs) * 512.f, 0, 8)));
  }
  const uint32_t r = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;  // 3 mantissa bits, to even
  return static_cast<uint8_t>(sign | (r - (120u << 3)));            // rebias 127 -> 7
}

// The code of x under the row's scale s (the fp16 scale as a float).
KVGRID_HOST_DEVICE uint8_t KvFp8Code(float x, float s) {
  return s > 0.f ? F32ToFp8E4m3Bits(x / s) : 0;
}

// The fp16 bits of an E4M3 code's value / 256: the code's sign in place, its exponent and
// mantissa one bit lower (an E4M3 subnormal lands on an fp16 subnormal). Exact.
KVGRID_HOST_DEVICE uint16_t Fp8E4m3ToF16BitsOver256(uint8_t code) {
  return static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7fu) << 7));
}

KVGRID_HOST_DEVICE float Fp8E4m3BitsToF32(uint8_t code) {
  return F16BitsToF32(Fp8E4m3ToF16BitsOver256(code)) * 256.f;
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
