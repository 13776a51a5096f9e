// Software prefetches into L1 that the compiler keeps.
//
// On x86 each is an asm statement: GCC 12 deletes calls to a function made only of
// __builtin_prefetch (its mod-ref analysis finds no side effect) when that function is not
// inlined first, as happened to a lambda around one in attention.cc, so that no prefetch ran.
// A prefetch never faults, so the address may be anything.
#ifndef KVGRID_KERNELS_CPU_PREFETCH_H_
#define KVGRID_KERNELS_CPU_PREFETCH_H_

#include <cstdint>

namespace kvgrid::kernels::cpu {

inline constexpr int64_t kCacheLineBytes = 64;

// Asks for the cache line holding `p`.
inline void PrefetchLine(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Asks for the cache lines of [p, p + bytes), one request per 64 bytes from p.
inline void PrefetchLines(const void* p, int64_t bytes) {
  const auto* b = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += kCacheLineBytes) PrefetchLine(b + i);
}

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_PREFETCH_H_
