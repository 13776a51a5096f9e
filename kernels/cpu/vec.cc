#include "kernels/cpu/vec.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

float DotPortable(const float* a, const float* b, int64_t n) {
  // Four partial sums so the compiler can keep several multiplies in flight.
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

void AxpyPortable(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void F16ToF32Portable(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = model::F16ToF32(src[i]);
}

void F32ToF16Portable(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = model::F32ToF16(src[i]);
}

float ExpSumPortable(float* x, int64_t n, float scale, float shift) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] * scale - shift));
  return sum;
}

float MaxPortable(const float* x, int64_t n) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) top = x[i] > top ? x[i] : top;  // false for NaN
  return top;
}

int64_t ArgmaxPortable(const float* x, int64_t n) {
  int64_t best = 0;
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] > top) {  // strict, and false for NaN
      top = x[i];
      best = i;
    }
  }
  return best;
}

#if defined(__x86_64__)
#define KVGRID_AVX2 __attribute__((target("avx2,fma,f16c")))

KVGRID_AVX2 float DotAvx2(const float* a, const float* b, int64_t n) {
  // Four independent accumulators hide the FMA latency when the rows sit in cache.
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  __m256 acc2 = _mm256_setzero_ps();
  __m256 acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float s = HorizontalSum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

KVGRID_AVX2 void AxpyAvx2(float alpha, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

KVGRID_AVX2 void F16ToF32Avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = model::F16ToF32(src[i]);
}

KVGRID_AVX2 void F32ToF16Avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = model::F32ToF16(src[i]);
}

KVGRID_AVX2 float ExpSumAvx2(float* x, int64_t n, float scale, float shift) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 vshift = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8Avx2(_mm256_fmsub_ps(_mm256_loadu_ps(x + i), vs, vshift));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {  // the tail through the same polynomial, so every element is computed alike
    alignas(32) float tail[8] = {};
    std::memcpy(tail, x + i, sizeof(float) * (n - i));
    const __m256 e = Exp8Avx2(_mm256_fmsub_ps(_mm256_load_ps(tail), vs, vshift));
    _mm256_store_ps(tail, e);
    for (int64_t j = 0; j < n - i; ++j) x[i + j] = tail[j];
    const __m256 mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(n - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    acc = _mm256_add_ps(acc, _mm256_and_ps(e, mask));
  }
  return HorizontalSum(acc);
}

// ExpSumAvx2 16 lanes wide; the tail through a masked load.
__attribute__((target("avx512f,avx2,fma"))) float ExpSumAvx512(float* x, int64_t n, float scale,
                                                              float shift) {
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = LaneMask16(n - i);
    const __m512 e = Exp16Avx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, x + i), vs, vshift));
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return HorizontalSum16(acc);
}

// NaN is skipped because each running maximum is vmaxps' second operand, which it returns
// when either is NaN (a running maximum never is). Four of them, so that the loop is bound by
// loads, not by vmaxps' latency.
KVGRID_AVX2 float MaxAvx2(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
    m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float top = -INFINITY;
  for (float v : lanes) top = v > top ? v : top;
  for (; i < n; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

// Two passes, both streaming: the maximum, then the first index holding it (NaN never
// compares equal).
KVGRID_AVX2 int64_t ArgmaxAvx2(const float* x, int64_t n) {
  const float top = MaxAvx2(x, n);
  if (top == -INFINITY) return 0;
  const __m256 vt = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; i < n; ++i) {
    if (x[i] == top) return i;
  }
  return 0;  // not reached: top is one of the elements
}
#endif

constexpr VecOps kPortable = {DotPortable,    AxpyPortable,   F16ToF32Portable, F32ToF16Portable,
                              ExpSumPortable, MaxPortable,    ArgmaxPortable,   "portable"};

}  // namespace

const VecOps& PortableVec() { return kPortable; }

const VecOps& Vec() {
#if defined(__x86_64__)
  static const VecOps ops =
      HaveAvx2Fma() ? VecOps{DotAvx2,      AxpyAvx2,
                             F16ToF32Avx2, F32ToF16Avx2,
                             HaveAvx512() ? ExpSumAvx512 : ExpSumAvx2,
                             MaxAvx2,      ArgmaxAvx2,
                             "avx2"}
                    : kPortable;
  return ops;
#else
  return kPortable;
#endif
}

}  // namespace kvgrid::kernels::cpu
