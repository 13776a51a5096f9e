#include "kernels/cpu/activation.h"

#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/simd_x86.h"

namespace kvgrid::kernels::cpu {
namespace {

// One row: out[i] = g / (1 + exp(-g)) * u for g = gate[i], u = up[i].
void SiluRowPortable(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

#if defined(__x86_64__)
// exp(x) for 8 floats within 2 ulp of std::exp: x = n ln2 + r with |r| <= ln2 / 2, e^r by
// Cephes' degree-7 polynomial, 2^n put into the exponent. Overflow gives +inf and
// underflow 0, as expf (which gives subnormals below -87.3: 1 + e^x rounds to 1 either way).
__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.72283905206835f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 overflow = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n in [-126, 128]: 2^n as two factors so that n = 128 does not overflow the exponent.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), overflow);
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), underflow);
}

__attribute__((target("avx2,fma"))) void SiluRowAvx2(const float* gate, const float* up,
                                                     float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Exp8(_mm256_xor_ps(g, sign));  // exp(-g); NaN stays NaN
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  SiluRowPortable(gate + i, up + i, out + i, n - i);
}
#endif

}  // namespace

absl::Status SiluAndMulParams::Validate() const {
  if (!gate_up || !output) return absl::InvalidArgumentError("SiluAndMulParams: null pointer");
  if (num_tokens < 0 || intermediate <= 0) {
    return absl::InvalidArgumentError("SiluAndMulParams: sizes out of range");
  }
  return absl::OkStatus();
}

absl::Status SiluAndMul(const SiluAndMulParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
#if defined(__x86_64__)
  static const bool avx2 = HaveAvx2Fma();
#else
  constexpr bool avx2 = false;
#endif
  const int64_t inter = p.intermediate;
#pragma omp parallel for schedule(static) if (p.num_tokens * inter > 16384)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* gate = p.gate_up + t * 2 * inter;
    float* out = p.output + t * inter;
#if defined(__x86_64__)
    if (avx2) {
      SiluRowAvx2(gate, gate + inter, out, inter);
      continue;
    }
#endif
    SiluRowPortable(gate, gate + inter, out, inter);
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
