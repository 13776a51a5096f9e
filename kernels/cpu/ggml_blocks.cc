#include "kernels/cpu/ggml_blocks.h"

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

#define KVGRID_INLINE inline __attribute__((always_inline))

KVGRID_INLINE float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return model::F16ToF32(h);
}

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a non-uniform grid fitted to
// normal weights.
constexpr int8_t kIq4NlLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// The nibble of element i (0..31) of a 32-element block whose 16 bytes hold
// value i low and value i + 16 high in byte i.
KVGRID_INLINE int Nibble(const uint8_t* qs, int i) {
  return i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4;
}

KVGRID_INLINE void DecodeQ5_0(const uint8_t* b, float* y) {
  const float d = F16At(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof(qh));
  const uint8_t* qs = b + 6;
  for (int i = 0; i < 32; ++i) {
    const int q = (Nibble(qs, i) | static_cast<int>((qh >> i) & 1u) << 4) - 16;
    y[i] = static_cast<float>(q) * d;
  }
}

KVGRID_INLINE void DecodeQ5_1(const uint8_t* b, float* y) {
  const float d = F16At(b), m = F16At(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, sizeof(qh));
  const uint8_t* qs = b + 8;
  for (int i = 0; i < 32; ++i) {
    const int q = Nibble(qs, i) | static_cast<int>((qh >> i) & 1u) << 4;
    y[i] = static_cast<float>(q) * d + m;
  }
}

KVGRID_INLINE void DecodeIq4Nl(const uint8_t* b, float* y) {
  const float d = F16At(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(kIq4NlLevels[qs[i] & 0x0F]);
    y[i + 16] = d * static_cast<float>(kIq4NlLevels[qs[i] >> 4]);
  }
}

KVGRID_INLINE void DecodeQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = F16At(b + 80), dmin = F16At(b + 82);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int half = 0; half < 2; ++half) {
        const int j = 8 * h + 2 * s + half;  // sub-block of 16
        const float dl = d * static_cast<float>(scales[j] & 0x0F);
        const float ml = dmin * static_cast<float>(scales[j] >> 4);
        const uint8_t* q = qs + 32 * h + 16 * half;
        float* o = y + 16 * j;
        for (int l = 0; l < 16; ++l) {
          o[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
        }
      }
    }
  }
}

KVGRID_INLINE void DecodeQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = F16At(b + 108);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const int bit = 4 * h + s;  // of hmask, = e / 32
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * bit + half;  // sub-block of 16
        const int lo = j < 8 ? sc[j] & 0x0F : sc[j - 8] >> 4;
        const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        const float dl = d * static_cast<float>((lo | hi << 4) - 32);
        float* o = y + 16 * j;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hmask[l] >> bit) & 1) ? 0 : 4);
          o[l - 16 * half] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block g (0..7).
KVGRID_INLINE void ScaleMinK4(const uint8_t* sc, int g, int* scale, int* min) {
  if (g < 4) {
    *scale = sc[g] & 63;
    *min = sc[g + 4] & 63;
  } else {
    *scale = (sc[g + 4] & 0x0F) | (sc[g - 4] >> 6) << 4;
    *min = (sc[g + 4] >> 4) | (sc[g] >> 6) << 4;
  }
}

KVGRID_INLINE void DecodeQ4_K(const uint8_t* b, float* y) {
  const float d = F16At(b), dmin = F16At(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(sc, g, &scale, &min);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      y[32 * g + l] = d1 * static_cast<float>((q[l] >> shift) & 0x0F) - m1;
    }
  }
}

KVGRID_INLINE void DecodeQ5_K(const uint8_t* b, float* y) {
  const float d = F16At(b), dmin = F16At(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(sc, g, &scale, &min);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 0x0F) | ((qh[l] >> g) & 1) << 4;
      y[32 * g + l] = d1 * static_cast<float>(v) - m1;
    }
  }
}

KVGRID_INLINE void DecodeQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = F16At(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
      const int lo_shift = 4 * (s / 2);
      const uint8_t* hi = qh + 32 * h;
      for (int half = 0; half < 2; ++half) {
        const int j = 8 * h + 2 * s + half;  // sub-block of 16
        const float dl = d * static_cast<float>(scales[j]);
        float* o = y + 16 * j;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = (((lo[l] >> lo_shift) & 0x0F) | ((hi[l] >> (2 * s)) & 3) << 4) - 32;
          o[l - 16 * half] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

// The portable decoders, and the reference the AVX2 ones are tested against.
template <WeightDType D>
KVGRID_INLINE void DecodeBlocks(const uint8_t* src, int64_t blocks, float* out) {
  const int64_t bb = QuantMatrix::BlockBytes(D), be = QuantMatrix::BlockElements(D);
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = src + i * bb;
    float* y = out + i * be;
    if constexpr (D == WeightDType::kQ5_0) DecodeQ5_0(b, y);
    if constexpr (D == WeightDType::kQ5_1) DecodeQ5_1(b, y);
    if constexpr (D == WeightDType::kIQ4_NL) DecodeIq4Nl(b, y);
    if constexpr (D == WeightDType::kQ2_K) DecodeQ2_K(b, y);
    if constexpr (D == WeightDType::kQ3_K) DecodeQ3_K(b, y);
    if constexpr (D == WeightDType::kQ4_K) DecodeQ4_K(b, y);
    if constexpr (D == WeightDType::kQ5_K) DecodeQ5_K(b, y);
    if constexpr (D == WeightDType::kQ6_K) DecodeQ6_K(b, y);
  }
}

template <WeightDType D>
void DecodePortable(const uint8_t* src, int64_t blocks, float* out) {
  DecodeBlocks<D>(src, blocks, out);
}

#if defined(__x86_64__)
// AVX2 versions of the decoders above: the same integer values and the same two float
// operations per weight (a product that is exact, then the minimum or offset), so the same
// floats, 8 at a time.
#define KVGRID_AVX2 __attribute__((target("avx2,fma,f16c"))) inline

// The decoders hand each 8 weights to a sink, sink(position in the block, weights): one that
// stores them (DecodeAvx2), or one that multiplies them into the tokens' sums (DotAvx2), so a
// dot product keeps the weights in registers.
struct StoreSink {
  float* out;
  KVGRID_AVX2 void operator()(int pos, __m256 w) const { _mm256_storeu_ps(out + pos, w); }
};

// Weights [pos, pos + 16) = scale * v[i] - offset (or + offset when kAdd), v 16 int8 values.
template <bool kAdd = false, typename Sink>
KVGRID_AVX2 void Store16(__m128i v, __m256 scale, __m256 offset, Sink& sink, int pos) {
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  if constexpr (kAdd) {
    sink(pos, _mm256_add_ps(_mm256_mul_ps(scale, a), offset));
    sink(pos + 8, _mm256_add_ps(_mm256_mul_ps(scale, b), offset));
  } else {
    sink(pos, _mm256_sub_ps(_mm256_mul_ps(scale, a), offset));
    sink(pos + 8, _mm256_sub_ps(_mm256_mul_ps(scale, b), offset));
  }
}

// 32 int8 values, one scale and offset for all.
template <bool kAdd = false, typename Sink>
KVGRID_AVX2 void Store32(__m256i v, float scale, float offset, Sink& sink, int pos) {
  const __m256 d = _mm256_set1_ps(scale), m = _mm256_set1_ps(offset);
  Store16<kAdd>(_mm256_castsi256_si128(v), d, m, sink, pos);
  Store16<kAdd>(_mm256_extracti128_si256(v, 1), d, m, sink, pos + 16);
}

// An fp16 field through F16C (exact, as model::F16ToF32, without its branches).
KVGRID_AVX2 float F16C(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

KVGRID_AVX2 __m256i Load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Byte i (0..31) = 0xFF when bit i of x is set, else 0.
KVGRID_AVX2 __m256i BitsToBytes(uint32_t x) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(x)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A 32-element block's 16 bytes of nibbles as 32 values in element order (value i low and
// value i + 16 high in byte i).
KVGRID_AVX2 __m256i Nibbles32(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_setr_m128i(_mm_and_si128(packed, mask),
                           _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
}

template <WeightDType D, typename Sink>
KVGRID_AVX2 void DecodeOneAvx2(const uint8_t* b, Sink& y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (D == WeightDType::kQ5_0 || D == WeightDType::kQ5_1) {
    constexpr int kHigh = D == WeightDType::kQ5_0 ? 2 : 4;
    uint32_t qh;
    std::memcpy(&qh, b + kHigh, sizeof(qh));
    __m256i q = _mm256_or_si256(Nibbles32(b + kHigh + 4),
                                _mm256_and_si256(BitsToBytes(qh), _mm256_set1_epi8(16)));
    if constexpr (D == WeightDType::kQ5_0) {
      Store32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), F16C(b), 0.f, y, 0);  // q d - 0 = q d
    } else {
      Store32<true>(q, F16C(b), F16C(b + 2), y, 0);
    }
  } else if constexpr (D == WeightDType::kIQ4_NL) {
    const __m256i levels = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4NlLevels)));
    Store32(_mm256_shuffle_epi8(levels, Nibbles32(b + 2)), F16C(b), 0.f, y, 0);
  } else if constexpr (D == WeightDType::kQ4_K || D == WeightDType::kQ5_K) {
    const float d = F16C(b), dmin = F16C(b + 2);
    constexpr int kQs = D == WeightDType::kQ4_K ? 16 : 48;
    const __m256i qh = D == WeightDType::kQ5_K ? Load32(b + 16) : _mm256_setzero_si256();
    for (int pair = 0; pair < 4; ++pair) {
      const __m256i packed = Load32(b + kQs + 32 * pair);
      for (int half = 0; half < 2; ++half) {
        const int g = 2 * pair + half;
        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(packed, 4) : packed, low4);
        if constexpr (D == WeightDType::kQ5_K) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << g));
          const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
          q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        int scale, min;
        ScaleMinK4(b + 4, g, &scale, &min);
        Store32(q, d * static_cast<float>(scale), dmin * static_cast<float>(min), y, 32 * g);
      }
    }
  } else if constexpr (D == WeightDType::kQ6_K) {
    const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = F16C(b + 208);
    const __m256i three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    const __m256 zero = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql[2] = {Load32(b + 64 * h), Load32(b + 64 * h + 32)};
      const __m256i qh = Load32(b + 128 + 32 * h);
      for (int s = 0; s < 4; ++s) {
        const __m256i lo =
            _mm256_and_si256(s < 2 ? ql[s % 2] : _mm256_srli_epi16(ql[s % 2], 4), low4);
        const __m256i hi = _mm256_slli_epi16(
            _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), three), 4);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias);
        const int j = 8 * h + 2 * s;
        const int o = 16 * j;
        Store16(_mm256_castsi256_si128(q), _mm256_set1_ps(d * static_cast<float>(scales[j])),
                zero, y, o);
        Store16(_mm256_extracti128_si256(q, 1),
                _mm256_set1_ps(d * static_cast<float>(scales[j + 1])), zero, y, o + 16);
      }
    }
  } else if constexpr (D == WeightDType::kQ3_K) {
    const uint8_t* sc = b + 96;
    const float d = F16C(b + 108);
    const __m256i hmask = Load32(b), three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256 zero = _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = Load32(b + 32 + 32 * h);
      for (int s = 0; s < 4; ++s) {
        const int bit = 4 * h + s;
        const __m256i m = _mm256_set1_epi8(static_cast<char>(1 << bit));
        const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, m), _mm256_setzero_si256());
        const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 2 * s), three),
                                          _mm256_and_si256(clear, four));
        float dl[2];
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * bit + half;
          const int lo = j < 8 ? sc[j] & 0x0F : sc[j - 8] >> 4;
          const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
          dl[half] = d * static_cast<float>((lo | hi << 4) - 32);
        }
        const int o = 32 * bit;
        Store16(_mm256_castsi256_si128(q), _mm256_set1_ps(dl[0]), zero, y, o);
        Store16(_mm256_extracti128_si256(q, 1), _mm256_set1_ps(dl[1]), zero, y, o + 16);
      }
    }
  } else {
    static_assert(D == WeightDType::kQ2_K, "every format decodes");
    const float d = F16C(b + 80), dmin = F16C(b + 82);
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i packed = Load32(b + 16 + 32 * h);
      for (int s = 0; s < 4; ++s) {
        const __m256i q = _mm256_and_si256(_mm256_srli_epi16(packed, 2 * s), three);
        const int j = 8 * h + 2 * s;
        const int o = 16 * j;
        Store16(_mm256_castsi256_si128(q), _mm256_set1_ps(d * static_cast<float>(b[j] & 0x0F)),
                _mm256_set1_ps(dmin * static_cast<float>(b[j] >> 4)), y, o);
        Store16(_mm256_extracti128_si256(q, 1),
                _mm256_set1_ps(d * static_cast<float>(b[j + 1] & 0x0F)),
                _mm256_set1_ps(dmin * static_cast<float>(b[j + 1] >> 4)), y, o + 16);
      }
    }
  }
}

template <WeightDType D>
__attribute__((target("avx2,fma,f16c"))) void DecodeAvx2(const uint8_t* src, int64_t blocks,
                                                      float* out) {
  const int64_t bb = QuantMatrix::BlockBytes(D), be = QuantMatrix::BlockElements(D);
  for (int64_t i = 0; i < blocks; ++i) {
    StoreSink sink{out + i * be};
    DecodeOneAvx2<D>(src + i * bb, sink);
  }
}

template <int T>
struct DotSink {
  const float* x;  // the block's first column of token 0
  int64_t stride;  // between tokens
  __m256* acc;     // [T]
  KVGRID_AVX2 void operator()(int pos, __m256 w) const {
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * stride + pos), acc[t]);
    }
  }
};

template <WeightDType D, int T>
__attribute__((target("avx2,fma,f16c"))) void DotAvx2(const uint8_t* row, int64_t blocks,
                                                       const float* x, int64_t stride, float* y) {
  const int64_t bb = QuantMatrix::BlockBytes(D), be = QuantMatrix::BlockElements(D);
  // Two sets of sums, alternating by block, so consecutive blocks' FMAs do not wait on each
  // other.
  __m256 acc[2][T];
  for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    DotSink<T> sink{x + i * be, stride, acc[i % 2]};
    DecodeOneAvx2<D>(row + i * bb, sink);
  }
  for (int t = 0; t < T; ++t) {
    y[t] = HorizontalSum(_mm256_add_ps(acc[0][t], acc[1][t]));
  }
}

using DotFn = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*);

template <WeightDType D>
DotFn DotFor(int64_t tokens) {
  switch (tokens) {
    case 1: return DotAvx2<D, 1>;
    case 2: return DotAvx2<D, 2>;
    case 3: return DotAvx2<D, 3>;
    default: return DotAvx2<D, 4>;
  }
}
#endif

using DecodeFn = void (*)(const uint8_t*, int64_t, float*);

template <WeightDType D>
DecodeFn Best() {
#if defined(__x86_64__)
  if (HaveAvx2Fma()) return DecodeAvx2<D>;
#endif
  return DecodePortable<D>;
}

}  // namespace

bool IsGgmlBlockFormat(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kQ5_0:
    case WeightDType::kQ5_1:
    case WeightDType::kIQ4_NL:
    case WeightDType::kQ2_K:
    case WeightDType::kQ3_K:
    case WeightDType::kQ4_K:
    case WeightDType::kQ5_K:
    case WeightDType::kQ6_K:
      return true;
    default:
      return false;
  }
}

bool DotGgmlRow(WeightDType dtype, const uint8_t* row, int64_t cols, const float* x,
                int64_t x_stride, int64_t tokens, float* y) {
#if defined(__x86_64__)
  if (!HaveAvx2Fma() || tokens < 1 || tokens > 4) return false;
  DotFn fn = nullptr;
  switch (dtype) {
    case WeightDType::kQ5_0: fn = DotFor<WeightDType::kQ5_0>(tokens); break;
    case WeightDType::kQ5_1: fn = DotFor<WeightDType::kQ5_1>(tokens); break;
    case WeightDType::kIQ4_NL: fn = DotFor<WeightDType::kIQ4_NL>(tokens); break;
    case WeightDType::kQ2_K: fn = DotFor<WeightDType::kQ2_K>(tokens); break;
    case WeightDType::kQ3_K: fn = DotFor<WeightDType::kQ3_K>(tokens); break;
    case WeightDType::kQ4_K: fn = DotFor<WeightDType::kQ4_K>(tokens); break;
    case WeightDType::kQ5_K: fn = DotFor<WeightDType::kQ5_K>(tokens); break;
    case WeightDType::kQ6_K: fn = DotFor<WeightDType::kQ6_K>(tokens); break;
    default: return false;
  }
  fn(row, cols / QuantMatrix::BlockElements(dtype), x, x_stride, y);
  return true;
#else
  return false;
#endif
}

bool DecodeGgmlBlocksPortable(WeightDType dtype, const uint8_t* src, int64_t blocks,
                              float* out) {
  switch (dtype) {
    case WeightDType::kQ5_0: DecodePortable<WeightDType::kQ5_0>(src, blocks, out); return true;
    case WeightDType::kQ5_1: DecodePortable<WeightDType::kQ5_1>(src, blocks, out); return true;
    case WeightDType::kIQ4_NL: DecodePortable<WeightDType::kIQ4_NL>(src, blocks, out); return true;
    case WeightDType::kQ2_K: DecodePortable<WeightDType::kQ2_K>(src, blocks, out); return true;
    case WeightDType::kQ3_K: DecodePortable<WeightDType::kQ3_K>(src, blocks, out); return true;
    case WeightDType::kQ4_K: DecodePortable<WeightDType::kQ4_K>(src, blocks, out); return true;
    case WeightDType::kQ5_K: DecodePortable<WeightDType::kQ5_K>(src, blocks, out); return true;
    case WeightDType::kQ6_K: DecodePortable<WeightDType::kQ6_K>(src, blocks, out); return true;
    default: return false;
  }
}

bool DecodeGgmlBlocks(WeightDType dtype, const uint8_t* src, int64_t blocks, float* out) {
  static const DecodeFn q5_0 = Best<WeightDType::kQ5_0>(), q5_1 = Best<WeightDType::kQ5_1>(),
                        iq4_nl = Best<WeightDType::kIQ4_NL>(), q2_k = Best<WeightDType::kQ2_K>(),
                        q3_k = Best<WeightDType::kQ3_K>(), q4_k = Best<WeightDType::kQ4_K>(),
                        q5_k = Best<WeightDType::kQ5_K>(), q6_k = Best<WeightDType::kQ6_K>();
  DecodeFn fn = nullptr;
  switch (dtype) {
    case WeightDType::kQ5_0:
      fn = q5_0;
      break;
    case WeightDType::kQ5_1:
      fn = q5_1;
      break;
    case WeightDType::kIQ4_NL:
      fn = iq4_nl;
      break;
    case WeightDType::kQ2_K:
      fn = q2_k;
      break;
    case WeightDType::kQ3_K:
      fn = q3_k;
      break;
    case WeightDType::kQ4_K:
      fn = q4_k;
      break;
    case WeightDType::kQ5_K:
      fn = q5_k;
      break;
    case WeightDType::kQ6_K:
      fn = q6_k;
      break;
    default:
      return false;
  }
  fn(src, blocks, out);
  return true;
}

}  // namespace kvgrid::kernels::cpu
