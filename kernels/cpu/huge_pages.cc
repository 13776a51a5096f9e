#include "kernels/cpu/huge_pages.h"

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvgrid::kernels::cpu {

void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  // Advice only: a failure (THP off, an old kernel) leaves small pages.
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

bool CollapseToHugePages(const void* p, size_t bytes) {
#if defined(__linux__)
  if (bytes == 0) return true;
  constexpr int kMadvCollapse = 25;  // <linux/mman.h>, Linux 6.1; glibc 2.36 lacks the name
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = begin & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes + kHuge - 1) & ~(kHuge - 1);
  return madvise(reinterpret_cast<void*>(first), last - first, kMadvCollapse) == 0;
#else
  (void)p, (void)bytes;
  return false;
#endif
}

}  // namespace kvgrid::kernels::cpu
