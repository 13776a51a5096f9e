#include "kernels/cpu/q8_activations.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return model::F16ToF32(h);
}

bool IsInt8DotFormat(WeightDType dtype) {
  return dtype == WeightDType::kQ8_0 || dtype == WeightDType::kQ4_0 ||
         dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z;
}

// The offset m of w = d q + m for Q4_1 (stored) and Q4_Z (-d z; exact in fp32).
float BlockOffset(WeightDType dtype, const uint8_t* block) {
  return dtype == WeightDType::kQ4_1 ? F16At(block + 2) : -F16At(block) * F16At(block + 2);
}

// Rounds as vcvtps2dq does under the default rounding mode (half to even), with its answer
// for NaN (the "integer indefinite", which packs saturate to -128).
int8_t RoundToInt8(float v) {
  const float r = std::nearbyint(v);
  if (!(r >= -128.f && r <= 127.f)) return r > 0.f ? int8_t{127} : int8_t{-128};
  return static_cast<int8_t>(r);
}

void QuantizeBlockPortable(const float* x, int8_t* q, float* scale, float* scaled_sum,
                           int32_t* qsum) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = RoundToInt8(x[i] * inv);
    sum += q[i];
  }
  *scale = d;
  *scaled_sum = d * static_cast<float>(sum);
  *qsum = sum;
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) inline float F16AtF16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

__attribute__((target("avx2,fma"))) void QuantizeBlockAvx2(const float* x, int8_t* q,
                                                           float* scale, float* scaled_sum,
                                                           int32_t* qsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 m = _mm256_max_ps(
      _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
      _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);
  const float d = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // Sum before packing (the values are already in [-127, 127] for finite inputs).
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                     _mm256_add_epi32(i32[2], i32[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  // packs interleave the 128-bit lanes: dword k of the result holds values of input k % 4 from
  // lane k / 4, so one permutation restores the order 0..31.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                       _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *scale = d;
  *qsum = _mm_cvtsi128_si32(s4);
  *scaled_sum = d * static_cast<float>(*qsum);
}

// The 32 weights of one block in element order: Q8_0's int8 as stored, the Q4 formats' unsigned
// nibbles 0..15 (Q4_0's q - 8 is its nibble plus an offset of -8 d, as Q4_1's d q + m).
template <WeightDType D>
__attribute__((target("avx2,fma,f16c"))) inline __m256i LoadBlockAvx2(const uint8_t* block) {
  if constexpr (D == WeightDType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    constexpr int kHeader = D == WeightDType::kQ4_0 ? 2 : 4;
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHeader));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(packed, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(hi, lo);
  }
}

// Sums of four adjacent products of unsigned bytes u and signed bytes s, in 8 int32 lanes.
// AVX-512 VNNI's vpdpbusd does it in one instruction (written as assembly so that this
// function, and the AVX2 kernels it is inlined into, need no AVX-512 target: it runs only where
// the CPU has VNNI); AVX2 takes vpmaddubsw, whose int16 pair sums cannot saturate here
// (2 * 128 * 127 < 32767), and vpmaddwd.
template <bool kVnni>
__attribute__((target("avx2,fma,f16c"))) inline __m256i DotBytes(__m256i u, __m256i s) {
  if constexpr (kVnni) {
    __m256i acc = _mm256_setzero_si256();
    asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+x"(acc) : [u] "x"(u), [s] "x"(s));
    return acc;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// One row against T tokens. Q8_0's signed weights multiply as |w| times sign(w) x; the Q4
// formats' unsigned nibbles multiply the activations directly, and their offset m (-8 d for
// Q4_0) adds m d_x sum(q_x).
template <WeightDType D, int T, bool kVnni>
__attribute__((target("avx2,fma,f16c"))) void DotRowAvx2(const uint8_t* row,
                                                         const Q8Activations& a, int64_t first,
                                                         float* y) {
  constexpr bool kSigned = D == WeightDType::kQ8_0;
  constexpr int A = T == 1 ? 2 : 1;  // accumulators per token, to hide the FMA latency
  const int64_t blocks = a.cols / kQuantBlock;
  const int64_t bb = QuantMatrix::BlockBytes(D);
  __m256 acc[T][A];
  float offset[T];
  const int8_t* xq[T];
  const float* xd[T];
  const float* xs[T];
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < A; ++i) acc[t][i] = _mm256_setzero_ps();
    offset[t] = 0.f;
    xq[t] = a.q.data() + (first + t) * a.cols;
    xd[t] = a.scale.data() + (first + t) * blocks;
    xs[t] = a.scaled_sum.data() + (first + t) * blocks;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bb;
    const __m256i w = LoadBlockAvx2<D>(block);
    const float dw = F16AtF16c(block);
    __m256i wa;
    if constexpr (kSigned) wa = _mm256_sign_epi8(w, w);
    float m = 0.f;
    if constexpr (D == WeightDType::kQ4_0) m = -8.f * dw;
    if constexpr (D == WeightDType::kQ4_1) m = F16AtF16c(block + 2);
    if constexpr (D == WeightDType::kQ4_Z) m = -dw * F16AtF16c(block + 2);
    for (int t = 0; t < T; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[t] + b * 32));
      __m256i p32;
      if constexpr (kSigned) {
        p32 = DotBytes<kVnni>(wa, _mm256_sign_epi8(x, w));
      } else {
        p32 = DotBytes<kVnni>(w, x);
      }
      __m256& c = acc[t][b % A];
      c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(dw * xd[t][b]), c);
      if constexpr (!kSigned) offset[t] += m * xs[t][b];
    }
  }
  for (int t = 0; t < T; ++t) {
    __m256 s = acc[t][0];
    for (int i = 1; i < A; ++i) s = _mm256_add_ps(s, acc[t][i]);
    y[t] = HorizontalSum(s) + offset[t];
  }
}

using DotFn = void (*)(const uint8_t*, const Q8Activations&, int64_t, float*);

template <WeightDType D, bool kVnni>
DotFn DotFor(int64_t count) {
  switch (count) {
    case 1: return DotRowAvx2<D, 1, kVnni>;
    case 2: return DotRowAvx2<D, 2, kVnni>;
    case 3: return DotRowAvx2<D, 3, kVnni>;
    default: return DotRowAvx2<D, 4, kVnni>;
  }
}

template <bool kVnni>
DotFn DotFor(WeightDType dtype, int64_t count) {
  switch (dtype) {
    case WeightDType::kQ8_0: return DotFor<WeightDType::kQ8_0, kVnni>(count);
    case WeightDType::kQ4_0: return DotFor<WeightDType::kQ4_0, kVnni>(count);
    case WeightDType::kQ4_1: return DotFor<WeightDType::kQ4_1, kVnni>(count);
    default: return DotFor<WeightDType::kQ4_Z, kVnni>(count);
  }
}
#endif  // __x86_64__

}  // namespace

void QuantizeActivations(const float* x, int64_t tokens, int64_t cols, Q8Activations* out) {
  const int64_t blocks = cols / kQuantBlock;
  out->tokens = tokens;
  out->cols = cols;
  out->q.resize(static_cast<size_t>(tokens * cols));
  out->scale.resize(static_cast<size_t>(tokens * blocks));
  out->scaled_sum.resize(static_cast<size_t>(tokens * blocks));
  out->sum.resize(static_cast<size_t>(tokens * blocks));
#if defined(__x86_64__)
  static const bool avx2 = HaveAvx2Fma();
#else
  constexpr bool avx2 = false;
#endif
  // A prefill's inputs (hundreds of tokens) are quantized by the team; a decode step's by the
  // calling thread.
#pragma omp parallel for schedule(static) if (tokens * cols >= (1 << 16))
  for (int64_t i = 0; i < tokens * blocks; ++i) {
    const int64_t t = i / blocks, b = i % blocks;
    const float* src = x + t * cols + b * kQuantBlock;
    int8_t* q = out->q.data() + t * cols + b * kQuantBlock;
#if defined(__x86_64__)
    if (avx2) {
      QuantizeBlockAvx2(src, q, &out->scale[i], &out->scaled_sum[i], &out->sum[i]);
      continue;
    }
#endif
    QuantizeBlockPortable(src, q, &out->scale[i], &out->scaled_sum[i], &out->sum[i]);
  }
}

Int8DotIsa BestInt8DotIsa() {
#if defined(__x86_64__)
  static const Int8DotIsa best =
      !HaveAvx2Fma() ? Int8DotIsa::kPortable
      : __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
          ? Int8DotIsa::kAvx512Vnni
          : Int8DotIsa::kAvx2;
  return best;
#else
  return Int8DotIsa::kPortable;
#endif
}

bool HasInt8Dot(WeightDType dtype) {
  return BestInt8DotIsa() != Int8DotIsa::kPortable && IsInt8DotFormat(dtype);
}

void Int8DotRow(WeightDType dtype, const uint8_t* row, const Q8Activations& a, int64_t first,
                int64_t count, float* y) {
  Int8DotRowOn(BestInt8DotIsa(), dtype, row, a, first, count, y);
}

void Int8DotRowOn(Int8DotIsa isa, WeightDType dtype, const uint8_t* row, const Q8Activations& a,
                  int64_t first, int64_t count, float* y) {
#if defined(__x86_64__)
  if (IsInt8DotFormat(dtype) && isa == Int8DotIsa::kAvx512Vnni) {
    return DotFor<true>(dtype, count)(row, a, first, y);
  }
  if (IsInt8DotFormat(dtype) && isa == Int8DotIsa::kAvx2) {
    return DotFor<false>(dtype, count)(row, a, first, y);
  }
#endif
  Int8DotRowPortable(dtype, row, a, first, count, y);
}

void Int8DotRowPortable(WeightDType dtype, const uint8_t* row, const Q8Activations& a,
                        int64_t first, int64_t count, float* y) {
  const int64_t blocks = a.cols / kQuantBlock;
  const int64_t bb = QuantMatrix::BlockBytes(dtype);
  const bool has_offset = dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z;
  for (int64_t t = first; t < first + count; ++t) {
    const int8_t* xq = a.q.data() + t * a.cols;
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * bb;
      const int8_t* x = xq + b * kQuantBlock;
      int32_t s = 0;
      const float dw = F16At(block);
      if (dtype == WeightDType::kQ8_0) {
        for (int i = 0; i < 32; ++i) s += static_cast<int8_t>(block[2 + i]) * x[i];
      } else {
        const uint8_t* nib = block + (dtype == WeightDType::kQ4_0 ? 2 : 4);
        for (int i = 0; i < 16; ++i) s += (nib[i] & 0x0F) * x[i] + (nib[i] >> 4) * x[i + 16];
      }
      acc += static_cast<float>(s) * (dw * a.scale[t * blocks + b]);
      if (dtype == WeightDType::kQ4_0) acc += -8.f * dw * a.scaled_sum[t * blocks + b];
      if (has_offset) acc += BlockOffset(dtype, block) * a.scaled_sum[t * blocks + b];
    }
    y[t - first] = acc;
  }
}

double Int8DotErrorBound(const float* w, const float* x_row, int64_t cols) {
  double bound = 0;
  for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
    double amax = 0, wsum = 0;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, static_cast<double>(std::fabs(x_row[b * 32 + i])));
      wsum += std::fabs(w[b * 32 + i]);
    }
    bound += 0.5 * amax / 127.0 * wsum;
  }
  return bound;
}

}  // namespace kvgrid::kernels::cpu
