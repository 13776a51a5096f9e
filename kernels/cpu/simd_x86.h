// What the CPU kernels' AVX2 paths share: the one check that selects them (AVX2, FMA and F16C,
// which every AVX2 kernel assumes together), the sums of a vector's lanes and exp.
#ifndef KVGRID_KERNELS_CPU_SIMD_X86_H_
#define KVGRID_KERNELS_CPU_SIMD_X86_H_

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
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

// Whether this CPU runs the AVX-512 kernels (F, BW and VL, with the AVX2 set). Checked once.
inline bool HaveAvx512() {
#if defined(__x86_64__)
  static const bool have = HaveAvx2Fma() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl");
  return have;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// How far ahead of what they read the weight-streaming kernels prefetch, and into which level.
// Measured on a 2-vCPU Sapphire Rapids-class VM (bench/RESULTS.md, "Prefetching into L2"): one
// core's demand misses and L1 prefetches reach about half the machine's read bandwidth, and
// its hardware prefetch did not keep such a stream ahead of the arithmetic. Prefetching into
// L2 (which does not hold one of L1's few fill buffers for the whole trip to memory) 3 KiB
// ahead beat prefetching into L1 2 KiB ahead in batch-1 decode: fp32 rows 12.0 -> 16.3
// tokens/s, F16 25 -> 30.7, Q4_0 74 -> 79, Q8_0 52 -> 54 (1, 2, 4 and 6 KiB were each slower).
inline constexpr int64_t kStreamPrefetchBytes = 3072;

// Prefetches the cache line `bytes` past `p` into L2. An address, not a pointer: it may lie
// past the end of the array (a prefetch never faults).
inline void PrefetchAhead(const void* p, int64_t bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + bytes), _MM_HINT_T1);
}

// The sum of the 8 lanes, pairwise (lane i + lane i+4, then halves). Needs only AVX, so every
// AVX2 kernel can inline it.
__attribute__((target("avx"))) inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Lanes [0, n) of a 16-lane vector (all of them from n = 16 on).
__attribute__((target("avx512f"))) inline __mmask16 LaneMask16(int64_t n) {
  return n >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << n) - 1);
}

// The sum of the 16 lanes: the halves added (a swap by shuffle: GCC 12 warns that the
// extracts _mm512_reduce_add_ps uses read an undefined vector), then as HorizontalSum.
__attribute__((target("avx512f"))) inline float HorizontalSum16(__m512 v) {
  const __m512 halves = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return HorizontalSum(_mm512_castps512_ps256(halves));
}

// The constants of Exp8Avx2 and Exp16Avx512: the clamp, log2(e), ln 2 in two parts (Cody and
// Waite) and Cephes' polynomial for e^r, highest degree first.
namespace exp_poly {
inline constexpr float kHi = 88.72283905206835f, kLo = -87.3365478515625f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
inline constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

// exp(x) for 8 floats within a few ulp of std::exp (ops_test checks 4 through SiLU): x =
// n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' polynomial, 2^n put into the exponent in two
// factors. Overflow gives +inf as expf does; below -87.34 (where expf goes subnormal) it gives
// 0, and NaN gives exp(-87.34) (callers keep a NaN visible through their other operands).
// Needs only AVX2 and FMA, so every AVX2 kernel can inline it.
__attribute__((target("avx2,fma"))) inline __m256 Exp8Avx2(__m256 x) {
  const __m256 hi = _mm256_set1_ps(exp_poly::kHi), lo = _mm256_set1_ps(exp_poly::kLo);
  const __m256 overflow = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(exp_poly::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(exp_poly::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(exp_poly::kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly::kP[i]));
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

// Exp8Avx2 for 16 floats, the same operations in the same order (so the same results).
__attribute__((target("avx512f"))) inline __m512 Exp16Avx512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(exp_poly::kHi), lo = _mm512_set1_ps(exp_poly::kLo);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(exp_poly::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(exp_poly::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(exp_poly::kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(exp_poly::kP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i half = _mm512_srai_epi32(ni, 1);
  const __m512 s1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23));
  const __m512 s2 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), _mm512_set1_epi32(127)), 23));
  __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  e = _mm512_mask_blend_ps(overflow, e, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(underflow, e, _mm512_setzero_ps());
}
#endif

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_SIMD_X86_H_
