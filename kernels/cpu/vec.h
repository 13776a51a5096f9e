// Vector primitives the CPU kernels are built from, with an AVX2/FMA/F16C path chosen once at
// run time when the CPU has it and a portable fallback otherwise. Thread-safe.
#ifndef KVGRID_KERNELS_CPU_VEC_H_
#define KVGRID_KERNELS_CPU_VEC_H_

#include <cstdint>

namespace kvgrid::kernels::cpu {

struct VecOps {
  // sum_i a[i] * b[i]
  float (*dot)(const float* a, const float* b, int64_t n);
  // y[i] += alpha * x[i]
  void (*axpy)(float alpha, const float* x, float* y, int64_t n);
  // dst[i] = float(src[i]) for IEEE half `src`
  void (*f16_to_f32)(const uint16_t* src, float* dst, int64_t n);
  // dst[i] = half(src[i]), round to nearest even
  void (*f32_to_f16)(const float* src, uint16_t* dst, int64_t n);
  // x[i] = exp(x[i] * scale - shift); returns the sum of the new x[i]. For softmax, so that
  // arguments are <= 0 (shift = scale * max): the AVX2 version is within 2 ulp of expf for
  // arguments down to -87 and flushes smaller ones to about 1e-38.
  float (*exp_sum)(float* x, int64_t n, float scale, float shift);
  // The largest x[i], NaN skipped; -inf when no element is above -inf (or n == 0). Softmax's
  // shift.
  float (*max)(const float* x, int64_t n);
  // The index of the largest x[i], NaN counting as -inf; ties go to the lowest index (+0 and
  // -0 tie), and 0 when no element is above -inf (n >= 1). Greedy sampling over a vocabulary.
  int64_t (*argmax)(const float* x, int64_t n);
  const char* name;  // "avx2" or "portable"
};

// The best implementation for this CPU.
const VecOps& Vec();
// The portable implementation (for tests comparing the two).
const VecOps& PortableVec();

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_VEC_H_
