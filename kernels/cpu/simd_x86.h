// What the CPU kernels' AVX2 paths share: the one check that selects them (AVX2, FMA and F16C,
// which every AVX2 kernel assumes together) and the sum of a vector's lanes.
#ifndef KVGRID_KERNELS_CPU_SIMD_X86_H_
#define KVGRID_KERNELS_CPU_SIMD_X86_H_

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvgrid::kernels::cpu {

// Whether this CPU runs the AVX2 kernels (false off x86-64). Checked once.
inline bool HaveAvx2Fma() {
#if defined(__x86_64__)
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return have;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// The sum of the 8 lanes, pairwise (lane i + lane i+4, then halves). Needs only AVX, so every
// AVX2 kernel can inline it.
__attribute__((target("avx"))) inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_SIMD_X86_H_
