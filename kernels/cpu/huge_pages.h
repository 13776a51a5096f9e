// Weights on transparent huge pages. A decode step streams every weight once, and on 4 KiB
// pages each 4 KiB of them costs a TLB miss and a page walk: on 2 MiB pages a Q8_0 decode of
// a Qwen2-0.5B-shaped model ran 13% faster (bench/RESULTS.md). Linux backs anonymous memory
// with huge pages where the process asks (the common `madvise` setting of
// /sys/kernel/mm/transparent_hugepage/enabled); under `never` nothing here changes them.
//
// Thread-safety: as the vector's own.
#ifndef KVGRID_KERNELS_CPU_HUGE_PAGES_H_
#define KVGRID_KERNELS_CPU_HUGE_PAGES_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvgrid::kernels::cpu {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;  // x86-64's PMD-sized page

// Asks for huge pages over the whole 2 MiB pages inside [p, p + bytes), before they are
// touched (advice already faulted in as small pages is kept only when the kernel collapses
// them later).
void AdviseHugePages(void* p, size_t bytes);

// Backs [p, p + bytes) with huge pages now, whatever pages are there already: the 2 MiB pages
// that hold any of it are copied onto huge pages (MADV_COLLAPSE, Linux 6.1 and later). The
// advice above shapes only pages still to be faulted in, and an allocator hands out heap
// memory that earlier buffers touched: on one Q4_0 model about 130 of its 195 MB of layer
// weights sat on small pages after the advice (bench/RESULTS.md). The whole pages inside the
// range, the one it starts in and the one it ends in are asked for apart, so that a failure
// on a page shared with a neighbour (or past the heap's end) leaves the rest collapsed; a
// neighbour in a shared page moves too, its contents unchanged. Nothing is done where the
// machine's THP setting is `never` or unreadable (FAILED_PRECONDITION; the kernel itself
// would collapse regardless). Errors: UNIMPLEMENTED where the kernel has no MADV_COLLAPSE
// (before 6.1), RESOURCE_EXHAUSTED where no huge page could be had or part of the range is
// unmapped, UNAVAILABLE where pages stayed busy after a second try; the first error is
// returned and the other parts are still asked for. The memory's contents never change.
absl::Status CollapseToHugePages(const void* p, size_t bytes);

// The machine's THP setting as /sys/kernel/mm/transparent_hugepage/enabled selects it
// (`always`, `madvise` or `never`; empty where it cannot be read), read once.
const std::string& TransparentHugePageMode();

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
