// Weights on transparent huge pages. A decode step streams every weight once, and on 4 KiB
// pages each 4 KiB of them costs a TLB miss and a page walk: on 2 MiB pages a Q8_0 decode of
// a Qwen2-0.5B-shaped model ran 13% faster (bench/RESULTS.md). Linux backs anonymous memory
// with huge pages where the process asks (the common `madvise` setting of
// /sys/kernel/mm/transparent_hugepage/enabled); elsewhere the advice is ignored and nothing
// changes.
//
// Thread-safety: as the vector's own.
#ifndef KVGRID_KERNELS_CPU_HUGE_PAGES_H_
#define KVGRID_KERNELS_CPU_HUGE_PAGES_H_

#include <cstddef>
#include <vector>

namespace kvgrid::kernels::cpu {

// Asks for huge pages over the whole 2 MiB pages inside [p, p + bytes), before they are
// touched (advice already faulted in as small pages is kept only when the kernel collapses
// them later).
void AdviseHugePages(void* p, size_t bytes);

// Backs [p, p + bytes) with huge pages now, whatever pages are there already: each 2 MiB
// page that holds any of the range is copied onto one huge page (MADV_COLLAPSE, Linux 6.1 and
// later; not where THP is `never`). The advice above shapes only pages still to be faulted
// in, and an allocator hands out heap memory that earlier buffers touched: on one Q4_0 model
// about 130 of its 195 MB of layer weights sat on small pages after the advice
// (bench/RESULTS.md). The range is widened to whole 2 MiB pages, so neighbours that share
// them move too; their contents do not change, only the memory under them. Returns false
// where the kernel declined (some of the range may have collapsed all the same).
bool CollapseToHugePages(const void* p, size_t bytes);

// Buffers smaller than this stay where they are.
inline constexpr size_t kHugePageMinBytes = size_t{4} << 20;

// Moves `v`'s elements into a new allocation advised for huge pages (a transient second
// copy). Vectors under kHugePageMinBytes are left alone.
template <typename T>
void MoveToHugePages(std::vector<T>* v) {
  const size_t bytes = v->size() * sizeof(T);
  if (bytes < kHugePageMinBytes) return;
  std::vector<T> moved;
  moved.reserve(v->size());
  AdviseHugePages(moved.data(), bytes);
  moved.assign(v->begin(), v->end());
  v->swap(moved);
}

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_HUGE_PAGES_H_
