// Included first by every kernels/cuda/*.cu source compiled for the CUDA emulator (see
// transform.cmake): CUDA's device-side language, built-in variables and intrinsics for a host
// C++ compiler. Only what kvgrid's kernels use is here; a kernel that needs more fails to
// compile in the emulator build rather than running wrongly.
#ifndef KVGRID_TESTS_CUDA_EMU_DEVICE_H_
#define KVGRID_TESTS_CUDA_EMU_DEVICE_H_

// Blocks run one at a time, so a function-local static is one block's shared memory
// (transform.cmake has each block poison it first). Defined before the CUDA headers, which keep
// a definition they find.
#define __shared__ static
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "tests/cuda_emu/kernel_api.h"

#define threadIdx (::kvgrid::cuda_emu::Place().thread_idx)
#define blockIdx (::kvgrid::cuda_emu::Place().block_idx)
#define blockDim (::kvgrid::cuda_emu::Place().block_dim)
#define gridDim (::kvgrid::cuda_emu::Place().grid_dim)

// nvcc's cuda_runtime.h offers this for kernels; the host compiler sees only the C function.
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

inline void __syncthreads() { ::kvgrid::cuda_emu::BlockBarrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::kvgrid::cuda_emu::WarpBarrier(mask); }

namespace kvgrid::cuda_emu {

template <typename T>
T Shuffle(unsigned mask, T value, int src_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = WarpExchange(mask, bits, src_lane);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// The lane a shuffle reads, or -1 for the caller's own value; `width` splits the warp into
// segments as CUDA's does.
inline int Lane() {
  const ThreadPlace& p = Place();
  const unsigned linear =
      p.thread_idx.x + p.block_dim.x * (p.thread_idx.y + p.block_dim.y * p.thread_idx.z);
  return static_cast<int>(linear % 32);
}

}  // namespace kvgrid::cuda_emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = ::kvgrid::cuda_emu::Lane();
  const int segment = lane & ~(width - 1);
  const int src = lane ^ lane_mask;
  // A source beyond the caller's segment reads the caller's own value.
  return ::kvgrid::cuda_emu::Shuffle(mask, value,
                                     (src & ~(width - 1)) == segment ? src : -1);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = ::kvgrid::cuda_emu::Lane();
  const int in_segment = lane & (width - 1);
  const int src = in_segment + static_cast<int>(delta) < width ? lane + static_cast<int>(delta)
                                                               : -1;
  return ::kvgrid::cuda_emu::Shuffle(mask, value, src);
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

inline float __uint_as_float(unsigned int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

// The _rn arithmetic intrinsics are never contracted into an FMA, although the emulator, like
// nvcc, contracts other products and sums: the volatile keeps the rounded product apart.
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}

// cvt.rni.s32.f32: round half to even, saturating, NaN to 0.
inline int __float2int_rn(float x) {
  if (std::isnan(x)) return 0;
  if (x >= 2147483647.f) return std::numeric_limits<int>::max();
  if (x <= -2147483648.f) return std::numeric_limits<int>::min();
  return static_cast<int>(std::nearbyint(x));
}

// prmt in its default mode: byte n of the result is byte (selector nibble n & 7) of the eight
// bytes {y, x} (x the low four); a nibble with its high bit set replicates that byte's sign.
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned int out = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned nibble = (s >> (4 * n)) & 0xFu;
    unsigned b = static_cast<unsigned>((bytes >> (8 * (nibble & 7u))) & 0xFFu);
    if (nibble & 8u) b = (b & 0x80u) ? 0xFFu : 0u;
    out |= b << (8 * n);
  }
  return out;
}

// Atomics: emulated threads switch only at barriers, so a plain read-modify-write is atomic.
inline int atomicExch(int* p, int value) {
  const int old = *p;
  *p = value;
  return old;
}

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

using std::max;
using std::min;

#endif  // KVGRID_TESTS_CUDA_EMU_DEVICE_H_
