#include "kernels/cpu/kv_quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

#include "kernels/cpu/kv_float_avx512.h"
#include "kernels/cpu/kv_int8_vnni.h"
#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/vec.h"
#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr uint16_t kF16MinSubnormal = 0x0001;
constexpr uint16_t kF16MaxFinite = 0x7bff;
constexpr uint16_t kInt4MaxScale = 0x7bf0;  // largest finite fp16 with the 4 low bits clear

inline uint16_t Load16(const uint8_t* p) {
  uint16_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

inline void Store16(uint8_t* p, uint16_t w) { std::memcpy(p, &w, sizeof(w)); }

inline float Int4Scale(uint16_t word) { return model::F16ToF32(word & 0xfff0u); }
inline int Int4Zero(uint16_t word) { return word & 0xf; }

// round-half-to-even, clamped into [lo, hi]; clamping first keeps lrint in range, and fmax
// sends NaN to lo.
inline int RoundClamp(float v, int lo, int hi) {
  return static_cast<int>(
      std::lrint(std::fmin(std::fmax(v, static_cast<float>(lo)), static_cast<float>(hi))));
}

// The smallest fp16 with its 4 low mantissa bits clear that is >= s (s > 0), capped at the
// largest such finite value.
uint16_t Int4ScaleRoundedUp(float s) {
  uint32_t h = model::F32ToF16(s);
  if (h < 0x7c00u && model::F16ToF32(static_cast<uint16_t>(h)) < s) ++h;  // nearest -> up
  h = (h + 0xfu) & ~0xfu;  // a mantissa carry moves into the exponent: still monotonic
  return static_cast<uint16_t>(std::min<uint32_t>(h, kInt4MaxScale));
}

// The fp16 scale of a row whose largest |x| is `amax` (NaNs skipped) for codes up to `qmax`:
// amax / qmax rounded to nearest, at least the smallest subnormal when amax > 0, at most the
// largest finite fp16. A subnormal scale has few bits, so it steps up where nearest rounding
// would clip amax, that is where amax / s > `limit` (qmax plus the rounding margin above it);
// normal scales are within 2^-11, below any limit.
uint16_t RowScaleF16(float amax, float qmax, float limit) {
  uint16_t s16 = model::F32ToF16(amax / qmax);
  if (s16 == 0 && amax > 0.f) s16 = kF16MinSubnormal;
  if (s16 < kF16MaxFinite && amax / model::F16ToF32(s16) > limit) ++s16;
  if (s16 > kF16MaxFinite) s16 = kF16MaxFinite;  // amax overflowed fp16 (or is infinite)
  return s16;
}

float RowAbsMax(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));  // NaNs are skipped
  return amax;
}

void QuantizeInt8(const float* x, int64_t n, int8_t* q, uint8_t* meta) {
  const uint16_t s16 = RowScaleF16(RowAbsMax(x, n), 127.f, 127.5f);
  Store16(meta, s16);
  const float s = model::F16ToF32(s16);
  for (int64_t i = 0; i < n; ++i) {
    q[i] = static_cast<int8_t>(s > 0.f ? RoundClamp(x[i] / s, -127, 127) : 0);
  }
}

void QuantizeFp8(const float* x, int64_t n, uint8_t* q, uint8_t* meta) {
  // 464 is halfway between 448 and the next E4M3 step (480, the unused NaN code): values up to
  // it round to 448 anyway.
  const uint16_t s16 = RowScaleF16(RowAbsMax(x, n), kFp8E4m3Max, 464.f);
  Store16(meta, s16);
  const float s = model::F16ToF32(s16);
  for (int64_t i = 0; i < n; ++i) q[i] = s > 0.f ? F32ToFp8E4m3(x[i] / s) : 0;
}

void QuantizeInt4(const float* x, int64_t n, uint8_t* packed, uint8_t* meta) {
  std::memset(packed, 0, static_cast<size_t>((n + 1) / 2));
  for (int64_t g0 = 0, g = 0; g0 < n; g0 += kInt4GroupSize, ++g) {
    const int64_t end = std::min(n, g0 + kInt4GroupSize);
    float lo = 0.f, hi = 0.f;
    for (int64_t i = g0; i < end; ++i) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    const float range = (hi - lo) / 15.f;
    const uint16_t s16 = range > 0.f ? Int4ScaleRoundedUp(range) : 0;
    const float s = model::F16ToF32(s16);
    const int z = s > 0.f ? RoundClamp(-lo / s, 0, 15) : 0;
    Store16(meta + 2 * g, Int4MetaWord(s16, z));
    for (int64_t i = g0; i < end; ++i) {
      const int q = s > 0.f ? std::clamp(RoundClamp(x[i] / s, -15, 30) + z, 0, 15) : 0;
      packed[i / 2] |= static_cast<uint8_t>(q << (4 * (i & 1)));
    }
  }
}

// Portable decode of channels [begin, begin + count) of one row into out[0, count).
template <KvDType D>
void DecodeRange(const uint8_t* v, const uint8_t* m, int64_t begin, int64_t count, float* out) {
  if constexpr (D == KvDType::kF32) {
    std::memcpy(out, reinterpret_cast<const float*>(v) + begin, sizeof(float) * count);
  } else if constexpr (D == KvDType::kF16) {
    for (int64_t i = 0; i < count; ++i) out[i] = model::F16ToF32(Load16(v + 2 * (begin + i)));
  } else if constexpr (D == KvDType::kBF16) {
    for (int64_t i = 0; i < count; ++i) out[i] = model::BF16ToF32(Load16(v + 2 * (begin + i)));
  } else if constexpr (D == KvDType::kInt8) {
    const float s = model::F16ToF32(Load16(m));
    const int8_t* q = reinterpret_cast<const int8_t*>(v);
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(q[begin + i]) * s;
  } else if constexpr (D == KvDType::kFp8E4m3) {
    const float s = model::F16ToF32(Load16(m));
    for (int64_t i = 0; i < count; ++i) out[i] = Fp8E4m3ToF32(v[begin + i]) * s;
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t c = begin + i;
      const uint16_t w = Load16(m + 2 * (c / kInt4GroupSize));
      const int q = (v[c / 2] >> (4 * (c & 1))) & 0xf;
      out[i] = Int4Scale(w) * static_cast<float>(q - Int4Zero(w));
    }
  }
}

inline const uint8_t* Bytes(const void* p) { return static_cast<const uint8_t*>(p); }

// --- portable kernels: decode 64 channels at a time into a stack buffer ---

constexpr int64_t kChunk = 64;

template <KvDType D>
void DotPortable(const void* values, const void* meta, int64_t n, int64_t rows, const float* q,
                 int64_t num_q, float* scores, int64_t score_stride, KvRows ahead) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  PrefetchRows(ahead, l, rows);
  const VecOps& vec = PortableVec();
  float buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* v = Bytes(values) + r * l.value_bytes;
    const uint8_t* m = meta ? Bytes(meta) + r * l.meta_bytes : nullptr;
    for (int64_t h = 0; h < num_q; ++h) scores[h * score_stride + r] = 0.f;
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t count = std::min(kChunk, n - c);
      DecodeRange<D>(v, m, c, count, buf);
      for (int64_t h = 0; h < num_q; ++h) {
        scores[h * score_stride + r] += vec.dot(q + h * n + c, buf, count);
      }
    }
  }
}

template <KvDType D>
void AxpyPortable(const void* values, const void* meta, int64_t n, int64_t rows, const float* p,
                  int64_t num_q, int64_t p_stride, float* out, KvRows ahead) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  PrefetchRows(ahead, l, rows);
  const VecOps& vec = PortableVec();
  float buf[kChunk];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* v = Bytes(values) + r * l.value_bytes;
    const uint8_t* m = meta ? Bytes(meta) + r * l.meta_bytes : nullptr;
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t count = std::min(kChunk, n - c);
      DecodeRange<D>(v, m, c, count, buf);
      for (int64_t h = 0; h < num_q; ++h) {
        vec.axpy(p[h * p_stride + r], buf, out + h * n + c, count);
      }
    }
  }
}

template <KvDType D>
void DequantizePortable(const void* values, const void* meta, int64_t n, int64_t rows,
                        float* out) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  for (int64_t r = 0; r < rows; ++r) {
    DecodeRange<D>(Bytes(values) + r * l.value_bytes,
                   meta ? Bytes(meta) + r * l.meta_bytes : nullptr, 0, n, out + r * n);
  }
}

template <KvDType D>
constexpr KvRowKernels kPortableKernels = {DotPortable<D>, AxpyPortable<D>, DequantizePortable<D>,
                                           "portable", false};

// --- AVX2/FMA/F16C kernels ---
//
// Load8<D> decodes 8 channels starting at a multiple of 8 (so an int4 load never straddles a
// group). For int8 it returns q unscaled: the row's scale is applied once per row (dot) or
// folded into the weights (axpy), so int8 costs two conversions per 8 channels.

#if defined(__x86_64__)
#define KVGRID_AVX2 __attribute__((target("avx2,fma,f16c")))

KVGRID_AVX2 inline float F16ToF32Avx2(uint16_t h) { return _cvtsh_ss(h); }

// Int4 channels i..i+7 (i a multiple of 8) as floats in [0, 15]: zero point and scale not
// applied.
KVGRID_AVX2 inline __m256 Nibbles8(const uint8_t* v, int64_t i) {
  int32_t packed;
  std::memcpy(&packed, v + i / 2, sizeof(packed));
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(packed), shifts),
                                     _mm256_set1_epi32(0xf));
  return _mm256_cvtepi32_ps(q);
}

// The scale and zero point of the int4 group holding channel i, broadcast.
KVGRID_AVX2 inline void Int4Group(const uint8_t* m, int64_t i, __m256* scale, __m256* zero) {
  const uint16_t w = Load16(m + 2 * (i / kInt4GroupSize));
  *scale = _mm256_set1_ps(F16ToF32Avx2(w & 0xfff0u));
  *zero = _mm256_set1_ps(static_cast<float>(Int4Zero(w)));
}

template <KvDType D>
KVGRID_AVX2 inline __m256 Load8(const uint8_t* v, const uint8_t* m, int64_t i) {
  if constexpr (D == KvDType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(v) + i);
  } else if constexpr (D == KvDType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 2 * i)));
  } else if constexpr (D == KvDType::kBF16) {
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (D == KvDType::kInt8) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  } else if constexpr (D == KvDType::kFp8E4m3) {
    // The fp16 with the code's bits in place (sign; exponent and mantissa one bit lower),
    // which is the value / 256; RowScale folds the 256 in.
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + i)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(-0x8000)),
                                   _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)));
    return _mm256_cvtph_ps(h);
  } else {
    __m256 scale, zero;
    Int4Group(m, i, &scale, &zero);
    return _mm256_mul_ps(_mm256_sub_ps(Nibbles8(v, i), zero), scale);  // as DecodeRange
  }
}

// The factor Load8 leaves out of row `m`'s values (int8's scale; fp8's scale times 256, which
// is exact, so the product is DecodeRange's), else 1.
template <KvDType D>
KVGRID_AVX2 inline float RowScale(const uint8_t* m) {
  if constexpr (D == KvDType::kInt8) {
    return F16ToF32Avx2(Load16(m));
  } else if constexpr (D == KvDType::kFp8E4m3) {
    return F16ToF32Avx2(Load16(m)) * 256.f;
  } else {
    return 1.f;
  }
}


// res[h * res_stride] = scale * sum_{i < n8} q[h * q_stride + i] * Load8 values, for H query
// heads.
template <KvDType D, int H>
KVGRID_AVX2 inline void DotHeads(const uint8_t* v, const uint8_t* m, int64_t n8, const float* q,
                                 int64_t q_stride, float scale, float* res, int64_t res_stride) {
  __m256 a0[H], a1[H];
  for (int h = 0; h < H; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
  // int4: the current group's scale and zero point, read once per group of 32 channels (a
  // 16-channel step never crosses a group boundary).
  __m256 gs = _mm256_setzero_ps(), gz = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n8; i += 16) {
    __m256 x0, x1;
    if constexpr (D == KvDType::kInt4) {
      if (i % kInt4GroupSize == 0) Int4Group(m, i, &gs, &gz);
      x0 = _mm256_mul_ps(_mm256_sub_ps(Nibbles8(v, i), gz), gs);
      x1 = _mm256_mul_ps(_mm256_sub_ps(Nibbles8(v, i + 8), gz), gs);
    } else {
      x0 = Load8<D>(v, m, i);
      x1 = Load8<D>(v, m, i + 8);
    }
    for (int h = 0; h < H; ++h) {
      a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * q_stride + i), x0, a0[h]);
      a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * q_stride + i + 8), x1, a1[h]);
    }
  }
  if (i < n8) {
    __m256 x0;
    if constexpr (D == KvDType::kInt4) {
      if (i % kInt4GroupSize == 0) Int4Group(m, i, &gs, &gz);
      x0 = _mm256_mul_ps(_mm256_sub_ps(Nibbles8(v, i), gz), gs);
    } else {
      x0 = Load8<D>(v, m, i);
    }
    for (int h = 0; h < H; ++h) {
      a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * q_stride + i), x0, a0[h]);
    }
  }
  if constexpr (H == 4) {  // the four horizontal sums at once
    const __m256 t01 = _mm256_hadd_ps(_mm256_add_ps(a0[0], a1[0]), _mm256_add_ps(a0[1], a1[1]));
    const __m256 t23 = _mm256_hadd_ps(_mm256_add_ps(a0[2], a1[2]), _mm256_add_ps(a0[3], a1[3]));
    const __m256 t = _mm256_hadd_ps(t01, t23);
    const __m128 sums = _mm_mul_ps(
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), _mm_set1_ps(scale));
    alignas(16) float out[4];
    _mm_store_ps(out, sums);
    for (int h = 0; h < 4; ++h) res[h * res_stride] = out[h];
  } else {
    for (int h = 0; h < H; ++h) res[h * res_stride] = HorizontalSum(_mm256_add_ps(a0[h], a1[h])) * scale;
  }
}

template <KvDType D>
KVGRID_AVX2 void DotAvx2(const void* values, const void* meta, int64_t n, int64_t rows,
                         const float* q, int64_t num_q, float* scores, int64_t score_stride,
                         KvRows ahead) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  PrefetchRows(ahead, l, rows);
  const int64_t n8 = n & ~int64_t{7};
  float tail[8];
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* v = Bytes(values) + r * l.value_bytes;
    const uint8_t* m = meta ? Bytes(meta) + r * l.meta_bytes : nullptr;
    const float s = RowScale<D>(m);
    if (n8 < n) DecodeRange<D>(v, m, n8, n - n8, tail);
    for (int64_t h0 = 0; h0 < num_q; h0 += 4) {
      const float* qh = q + h0 * n;
      float* res = scores + h0 * score_stride + r;
      switch (std::min<int64_t>(4, num_q - h0)) {
        case 1: DotHeads<D, 1>(v, m, n8, qh, n, s, res, score_stride); break;
        case 2: DotHeads<D, 2>(v, m, n8, qh, n, s, res, score_stride); break;
        case 3: DotHeads<D, 3>(v, m, n8, qh, n, s, res, score_stride); break;
        default: DotHeads<D, 4>(v, m, n8, qh, n, s, res, score_stride); break;
      }
      if (n8 < n) {
        for (int64_t h = 0; h < std::min<int64_t>(4, num_q - h0); ++h) {
          for (int64_t i = n8; i < n; ++i) res[h * score_stride] += qh[h * n + i] * tail[i - n8];
        }
      }
    }
  }
}

// out[h * n + i] += sum_r alpha[h * alpha_stride + r] * Load8 values of row r, i < n8.
template <KvDType D, int H>
KVGRID_AVX2 inline void AxpyHeads(const uint8_t* v, const uint8_t* m, const KvRowLayout& l,
                                  int64_t n8, int64_t rows, const float* alpha,
                                  int64_t alpha_stride, float* out, int64_t n) {
  int64_t i = 0;
  // 16 channels per step: each row's weight broadcast serves two vectors, and the 2H
  // accumulators are independent chains.
  for (; i + 16 <= n8; i += 16) {
    __m256 a0[H], a1[H];
    for (int h = 0; h < H; ++h) {
      a0[h] = _mm256_loadu_ps(out + h * n + i);
      a1[h] = _mm256_loadu_ps(out + h * n + i + 8);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 x0 = Load8<D>(v + r * l.value_bytes, m + r * l.meta_bytes, i);
      const __m256 x1 = Load8<D>(v + r * l.value_bytes, m + r * l.meta_bytes, i + 8);
      for (int h = 0; h < H; ++h) {
        const __m256 w = _mm256_broadcast_ss(alpha + h * alpha_stride + r);
        a0[h] = _mm256_fmadd_ps(w, x0, a0[h]);
        a1[h] = _mm256_fmadd_ps(w, x1, a1[h]);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm256_storeu_ps(out + h * n + i, a0[h]);
      _mm256_storeu_ps(out + h * n + i + 8, a1[h]);
    }
  }
  for (; i < n8; i += 8) {
    __m256 a0[H], a1[H];
    for (int h = 0; h < H; ++h) {
      a0[h] = _mm256_loadu_ps(out + h * n + i);
      a1[h] = _mm256_setzero_ps();
    }
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const __m256 x0 = Load8<D>(v + r * l.value_bytes, m + r * l.meta_bytes, i);
      const __m256 x1 = Load8<D>(v + (r + 1) * l.value_bytes, m + (r + 1) * l.meta_bytes, i);
      for (int h = 0; h < H; ++h) {
        a0[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * alpha_stride + r), x0, a0[h]);
        a1[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * alpha_stride + r + 1), x1, a1[h]);
      }
    }
    if (r < rows) {
      const __m256 x0 = Load8<D>(v + r * l.value_bytes, m + r * l.meta_bytes, i);
      for (int h = 0; h < H; ++h) {
        a0[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * alpha_stride + r), x0, a0[h]);
      }
    }
    for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + h * n + i, _mm256_add_ps(a0[h], a1[h]));
  }
}

// The int4 form of AxpyHeads, group by group: with alpha = p * s per row,
// out += sum_r alpha_r (q_r - z_r) = sum_r alpha_r q_r - sum_r alpha_r z_r, so the inner loop
// converts nibbles only and the zero points cost one subtraction per 8 channels.
// rows <= kAxpyTile.
constexpr int64_t kAxpyTile = 32;

template <int H>
KVGRID_AVX2 inline void AxpyHeadsInt4(const uint8_t* v, const uint8_t* m, const KvRowLayout& l,
                                      int64_t n8, int64_t rows, const float* p,
                                      int64_t p_stride, float* out, int64_t n) {
  float alpha[H * kAxpyTile];
  float corr[H];
  for (int64_t g0 = 0; g0 < n8; g0 += kInt4GroupSize) {
    for (int h = 0; h < H; ++h) corr[h] = 0.f;
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t w = Load16(m + r * l.meta_bytes + 2 * (g0 / kInt4GroupSize));
      const float s = F16ToF32Avx2(w & 0xfff0u);
      const float z = static_cast<float>(Int4Zero(w));
      for (int h = 0; h < H; ++h) {
        alpha[h * kAxpyTile + r] = p[h * p_stride + r] * s;
        corr[h] += alpha[h * kAxpyTile + r] * z;
      }
    }
    const int64_t end = std::min(n8, g0 + kInt4GroupSize);
    int64_t i = g0;
    for (; i + 16 <= end; i += 16) {  // as in AxpyHeads
      __m256 a0[H], a1[H];
      for (int h = 0; h < H; ++h) {
        const __m256 c = _mm256_set1_ps(corr[h]);
        a0[h] = _mm256_sub_ps(_mm256_loadu_ps(out + h * n + i), c);
        a1[h] = _mm256_sub_ps(_mm256_loadu_ps(out + h * n + i + 8), c);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m256 x0 = Nibbles8(v + r * l.value_bytes, i);
        const __m256 x1 = Nibbles8(v + r * l.value_bytes, i + 8);
        for (int h = 0; h < H; ++h) {
          const __m256 w = _mm256_broadcast_ss(alpha + h * kAxpyTile + r);
          a0[h] = _mm256_fmadd_ps(w, x0, a0[h]);
          a1[h] = _mm256_fmadd_ps(w, x1, a1[h]);
        }
      }
      for (int h = 0; h < H; ++h) {
        _mm256_storeu_ps(out + h * n + i, a0[h]);
        _mm256_storeu_ps(out + h * n + i + 8, a1[h]);
      }
    }
    for (; i < end; i += 8) {
      __m256 a0[H], a1[H];
      for (int h = 0; h < H; ++h) {
        a0[h] = _mm256_sub_ps(_mm256_loadu_ps(out + h * n + i), _mm256_set1_ps(corr[h]));
        a1[h] = _mm256_setzero_ps();
      }
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2) {
        const __m256 x0 = Nibbles8(v + r * l.value_bytes, i);
        const __m256 x1 = Nibbles8(v + (r + 1) * l.value_bytes, i);
        for (int h = 0; h < H; ++h) {
          a0[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * kAxpyTile + r), x0, a0[h]);
          a1[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * kAxpyTile + r + 1), x1, a1[h]);
        }
      }
      if (r < rows) {
        const __m256 x0 = Nibbles8(v + r * l.value_bytes, i);
        for (int h = 0; h < H; ++h) {
          a0[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(alpha + h * kAxpyTile + r), x0, a0[h]);
        }
      }
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + h * n + i, _mm256_add_ps(a0[h], a1[h]));
    }
  }
}

template <KvDType D>
KVGRID_AVX2 void AxpyAvx2(const void* values, const void* meta, int64_t n, int64_t rows,
                          const float* p, int64_t num_q, int64_t p_stride, float* out,
                          KvRows ahead) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  PrefetchRows(ahead, l, rows);
  const int64_t n8 = n & ~int64_t{7};
  // Rows in tiles, so each tile's weights (times int8's row scales) sit in a small array.
  constexpr int64_t kTile = kAxpyTile;
  float alpha[4 * kTile];
  float tail[8];
  // A null `meta` (float dtypes) is never dereferenced; offset a dummy base instead of null.
  const uint8_t* meta_base = meta ? Bytes(meta) : Bytes(values);
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t tile = std::min(kTile, rows - r0);
    const uint8_t* v = Bytes(values) + r0 * l.value_bytes;
    const uint8_t* m = meta_base + r0 * l.meta_bytes;
    float row_scale[kTile];
    for (int64_t r = 0; r < tile; ++r) row_scale[r] = RowScale<D>(m + r * l.meta_bytes);
    for (int64_t h0 = 0; h0 < num_q; h0 += 4) {
      const int64_t hn = std::min<int64_t>(4, num_q - h0);
      if constexpr (D == KvDType::kInt4) {
        const float* ph = p + h0 * p_stride + r0;
        float* oh = out + h0 * n;
        switch (hn) {
          case 1: AxpyHeadsInt4<1>(v, m, l, n8, tile, ph, p_stride, oh, n); break;
          case 2: AxpyHeadsInt4<2>(v, m, l, n8, tile, ph, p_stride, oh, n); break;
          case 3: AxpyHeadsInt4<3>(v, m, l, n8, tile, ph, p_stride, oh, n); break;
          default: AxpyHeadsInt4<4>(v, m, l, n8, tile, ph, p_stride, oh, n); break;
        }
        continue;
      }
      for (int64_t h = 0; h < hn; ++h) {
        for (int64_t r = 0; r < tile; ++r) {
          alpha[h * kTile + r] = p[(h0 + h) * p_stride + r0 + r] * row_scale[r];
        }
      }
      float* oh = out + h0 * n;
      switch (hn) {
        case 1: AxpyHeads<D, 1>(v, m, l, n8, tile, alpha, kTile, oh, n); break;
        case 2: AxpyHeads<D, 2>(v, m, l, n8, tile, alpha, kTile, oh, n); break;
        case 3: AxpyHeads<D, 3>(v, m, l, n8, tile, alpha, kTile, oh, n); break;
        default: AxpyHeads<D, 4>(v, m, l, n8, tile, alpha, kTile, oh, n); break;
      }
    }
    if (n8 < n) {
      for (int64_t r = 0; r < tile; ++r) {
        DecodeRange<D>(v + r * l.value_bytes, meta ? m + r * l.meta_bytes : nullptr, n8, n - n8,
                       tail);
        for (int64_t h = 0; h < num_q; ++h) {
          const float w = p[h * p_stride + r0 + r];
          for (int64_t i = n8; i < n; ++i) out[h * n + i] += w * tail[i - n8];
        }
      }
    }
  }
}

template <KvDType D>
KVGRID_AVX2 void DequantizeAvx2(const void* values, const void* meta, int64_t n, int64_t rows,
                                float* out) {
  const KvRowLayout l = KvRowLayoutFor(D, n);
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* v = Bytes(values) + r * l.value_bytes;
    const uint8_t* m = meta ? Bytes(meta) + r * l.meta_bytes : nullptr;
    const __m256 s = _mm256_set1_ps(RowScale<D>(m));
    float* o = out + r * n;
    for (int64_t i = 0; i < n8; i += 8) {
      __m256 x = Load8<D>(v, m, i);
      if constexpr (D == KvDType::kInt8 || D == KvDType::kFp8E4m3) {
        x = _mm256_mul_ps(x, s);  // the same product as DecodeRange
      }
      _mm256_storeu_ps(o + i, x);
    }
    if (n8 < n) DecodeRange<D>(v, m, n8, n - n8, o + n8);
  }
}

template <KvDType D>
constexpr KvRowKernels kAvx2Kernels = {DotAvx2<D>, AxpyAvx2<D>, DequantizeAvx2<D>, "avx2", false};

// Int8 on integer dot products where the shape and values allow, the AVX2 kernels elsewhere.
void DotInt8Vnni512(const void* values, const void* meta, int64_t n, int64_t rows,
                    const float* q, int64_t num_q, float* scores, int64_t score_stride,
                    KvRows ahead) {
  if (Int8VnniCovers(n) && Int8VnniRounds(q, num_q * n)) {
    DotInt8Vnni(values, meta, n, rows, q, num_q, scores, score_stride, ahead);
  } else {
    DotAvx2<KvDType::kInt8>(values, meta, n, rows, q, num_q, scores, score_stride, ahead);
  }
}
void AxpyInt8Vnni512(const void* values, const void* meta, int64_t n, int64_t rows,
                     const float* p, int64_t num_q, int64_t p_stride, float* out,
                     KvRows ahead) {
  bool rounds = Int8VnniCovers(n);
  for (int64_t h = 0; rounds && h < num_q; ++h) rounds = Int8VnniRounds(p + h * p_stride, rows);
  if (rounds) {
    AxpyInt8Vnni(values, meta, n, rows, p, num_q, p_stride, out, ahead);
  } else {
    AxpyAvx2<KvDType::kInt8>(values, meta, n, rows, p, num_q, p_stride, out, ahead);
  }
}
bool PrepareInt8Queries(const float* q, int64_t n, int64_t num_q, void* prepared) {
  if (!Int8VnniCovers(n) || !Int8VnniRounds(q, num_q * n)) return false;
  RoundQueriesInt8(q, n, num_q, static_cast<Int8Query*>(prepared));
  return true;
}
void DotInt8Prepared(const void* values, const void* meta, int64_t n, int64_t rows,
                     const void* prepared, int64_t num_q, float* scores, int64_t score_stride,
                     KvRows ahead) {
  DotInt8VnniPrepared(values, meta, n, rows, static_cast<const Int8Query*>(prepared), num_q,
                      scores, score_stride, ahead);
}
constexpr KvRowKernels kInt8VnniKernels = {DotInt8Vnni512,
                                           AxpyInt8Vnni512,
                                           DequantizeAvx2<KvDType::kInt8>,
                                           "avx512-vnni",
                                           true,
                                           PrepareInt8Queries,
                                           DotInt8Prepared,
                                           sizeof(Int8Query)};

// Float rows on AVX-512 (kernels/cpu/kv_float_avx512.h); dequantize stays the AVX2 one.
template <KvDType D>
constexpr KvRowKernels kFloatAvx512Kernels = {
    D == KvDType::kF32 ? DotF32Avx512 : D == KvDType::kF16 ? DotF16Avx512 : DotBf16Avx512,
    D == KvDType::kF32 ? AxpyF32Avx512 : D == KvDType::kF16 ? AxpyF16Avx512 : AxpyBf16Avx512,
    DequantizeAvx2<D>, "avx512", false};

#endif  // __x86_64__

template <KvDType D>
KvRowKernels Best(KvKernelPrecision precision) {
#if defined(__x86_64__)
  static const bool avx2 = std::string_view(Vec().name) == "avx2";
  if constexpr (D == KvDType::kInt8) {
    static const bool vnni = avx2 && HaveInt8Vnni();
    if (vnni && precision == KvKernelPrecision::kFast) return kInt8VnniKernels;
  }
  if constexpr (D == KvDType::kF32 || D == KvDType::kF16 || D == KvDType::kBF16) {
    static const bool avx512 = avx2 && HaveAvx512();
    if (avx512) return kFloatAvx512Kernels<D>;
  }
  if (avx2) return kAvx2Kernels<D>;
#endif
  return kPortableKernels<D>;
}

}  // namespace

void QuantizeRow(KvDType dtype, const float* x, int64_t n, void* values, void* meta) {
  uint8_t* v = static_cast<uint8_t*>(values);
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(v, x, sizeof(float) * n);
      return;
    case KvDType::kF16:
      // Bit-identical to model::F32ToF16, and F16C-fast where available.
      Vec().f32_to_f16(x, reinterpret_cast<uint16_t*>(v), n);
      return;
    case KvDType::kBF16:
      for (int64_t i = 0; i < n; ++i) Store16(v + 2 * i, model::F32ToBF16(x[i]));
      return;
    case KvDType::kInt8:
      QuantizeInt8(x, n, reinterpret_cast<int8_t*>(v), static_cast<uint8_t*>(meta));
      return;
    case KvDType::kInt4:
      QuantizeInt4(x, n, v, static_cast<uint8_t*>(meta));
      return;
    case KvDType::kFp8E4m3:
      QuantizeFp8(x, n, v, static_cast<uint8_t*>(meta));
      return;
  }
}

uint8_t F32ToFp8E4m3(float x) {
  x = std::fmin(std::fmax(x, -kFp8E4m3Max), kFp8E4m3Max);  // fmax sends NaN to -448
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs < 0x3c800000u) {  // below 2^-6: a subnormal step of 2^-9 (the code 8 is 2^-6 itself)
    return static_cast<uint8_t>(sign | std::lrint(std::fabs(x) * 512.f));
  }
  // Round the mantissa to 3 bits, half to even (a carry moves into the exponent), then rebias
  // the exponent 127 -> 7.
  const uint32_t r = (abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20;
  return static_cast<uint8_t>(sign | (r - (120u << 3)));
}

float Fp8E4m3ToF32(uint8_t code) {
  const uint16_t h = static_cast<uint16_t>(((code & 0x80u) << 8) | ((code & 0x7fu) << 7));
  return model::F16ToF32(h) * 256.f;
}

void PrefetchRows(KvRows ahead, const KvRowLayout& l, int64_t rows) {
  if (ahead.values == nullptr) return;
  PrefetchLines(ahead.values, rows * l.value_bytes);
  if (ahead.meta != nullptr) PrefetchLines(ahead.meta, rows * l.meta_bytes);
}

void DequantizeRow(KvDType dtype, const void* values, const void* meta, int64_t n, float* out) {
  PortableKvRowKernelsFor(dtype).dequantize(values, meta, n, 1, out);
}

KvRowKernels PortableKvRowKernelsFor(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32: return kPortableKernels<KvDType::kF32>;
    case KvDType::kF16: return kPortableKernels<KvDType::kF16>;
    case KvDType::kBF16: return kPortableKernels<KvDType::kBF16>;
    case KvDType::kInt8: return kPortableKernels<KvDType::kInt8>;
    case KvDType::kInt4: return kPortableKernels<KvDType::kInt4>;
    case KvDType::kFp8E4m3: return kPortableKernels<KvDType::kFp8E4m3>;
  }
  return kPortableKernels<KvDType::kF32>;
}

KvRowKernels KvRowKernelsFor(KvDType dtype, KvKernelPrecision precision) {
  switch (dtype) {
    case KvDType::kF32: return Best<KvDType::kF32>(precision);
    case KvDType::kF16: return Best<KvDType::kF16>(precision);
    case KvDType::kBF16: return Best<KvDType::kBF16>(precision);
    case KvDType::kInt8: return Best<KvDType::kInt8>(precision);
    case KvDType::kInt4: return Best<KvDType::kInt4>(precision);
    case KvDType::kFp8E4m3: return Best<KvDType::kFp8E4m3>(precision);
  }
  return Best<KvDType::kF32>(precision);
}

}  // namespace kvgrid::kernels::cpu
