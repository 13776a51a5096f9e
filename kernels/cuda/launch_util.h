// Launch-configuration helpers shared by the kernels in this folder. Host code only.
#ifndef KVGRID_KERNELS_CUDA_LAUNCH_UTIL_H_
#define KVGRID_KERNELS_CUDA_LAUNCH_UTIL_H_

#include <cstdint>

namespace kvgrid::kernels::cuda {

// Blocks for a grid-stride loop over `items` work items of `per_block` items each (items > 0):
// one block per chunk up to 2^20 blocks, which fills any current GPU many times over; beyond
// that the kernels loop, so gridDim.x never nears its 2^31 - 1 limit and 64-bit item counts
// are fine.
inline unsigned GridStrideBlocks(int64_t items, int64_t per_block) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// True when `p` is a multiple of `alignment` bytes (a power of two).
inline bool IsAligned(const void* p, uintptr_t alignment) {
  return (reinterpret_cast<uintptr_t>(p) & (alignment - 1)) == 0;
}

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_LAUNCH_UTIL_H_
