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
__attribute__((target("avx2,fma"))) void SiluRowAvx2(const float* gate, const float* up,
                                                     float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Exp8Avx2(_mm256_xor_ps(g, sign));  // exp(-g); NaN stays NaN
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
