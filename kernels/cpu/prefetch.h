// Software prefetches into L2.
//
// Into L2 (prefetcht1), not L1: paged attention asks for the next block's rows while it works
// on this one, and with its K/V in DRAM (attention_bench --flush-mb 256, 14 heads over 2 KV
// heads, 2,048 positions) the calls took 0.101 -> 0.094 ms (fp16) and 0.135 -> 0.123 (fp32)
// against prefetcht0 (int8 moved within the runs' noise), the same with the K/V in cache
// (bench/RESULTS.md). The line then comes from L2 when the kernel reads it, a few cycles that
// out-of-order execution hides.
//
// On x86 each is an asm statement, which the compiler keeps: GCC 12 deletes calls to a function
// made only of __builtin_prefetch (its mod-ref analysis finds no side effect) when that function
// is not inlined first, as happened to a lambda around one in attention.cc, so that no prefetch
// ran. Elsewhere they are __builtin_prefetch, open to that deletion. A prefetch never faults.
#ifndef KVGRID_KERNELS_CPU_PREFETCH_H_
#define KVGRID_KERNELS_CPU_PREFETCH_H_

#include <cstdint>

namespace kvgrid::kernels::cpu {

inline constexpr int64_t kCacheLineBytes = 64;

// Asks for the cache line holding `p`.
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for the cache lines that hold [p, p + bytes).
inline void PrefetchLines(const void* p, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  for (uintptr_t a = begin / kCacheLineBytes * kCacheLineBytes; a < end; a += kCacheLineBytes) {
    PrefetchLine(reinterpret_cast<const void*>(a));
  }
}

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_PREFETCH_H_
