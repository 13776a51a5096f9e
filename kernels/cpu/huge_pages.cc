#include "kernels/cpu/huge_pages.h"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"

#if defined(__linux__)
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // <linux/mman.h>, Linux 6.1; glibc 2.36's headers lack the name
#endif
#endif

namespace kvgrid::kernels::cpu {
namespace {

constexpr uintptr_t kHuge = kHugePageBytes;

#if defined(__linux__)
// MADV_COLLAPSE over [first, last) (2 MiB-aligned), once more if the kernel asks to try again.
absl::Status Collapse(uintptr_t first, uintptr_t last) {
  if (last <= first) return absl::OkStatus();
  int err = 0;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (madvise(reinterpret_cast<void*>(first), last - first, MADV_COLLAPSE) == 0) {
      return absl::OkStatus();
    }
    err = errno;
    if (err != EAGAIN) break;
  }
  const std::string what = absl::StrCat("MADV_COLLAPSE of ", (last - first) >> 20, " MiB: ",
                                        std::strerror(err));
  switch (err) {
    case EINVAL: return absl::UnimplementedError(what);  // before Linux 6.1, or not anonymous
    case ENOMEM: return absl::ResourceExhaustedError(what);  // no huge page, or unmapped
    case EAGAIN: return absl::UnavailableError(what);
    default: return absl::InternalError(what);
  }
}
#endif

}  // namespace

const std::string& TransparentHugePageMode() {
  static const std::string mode = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t open = s.find('['), close = s.find(']', open);
    return open == std::string::npos || close == std::string::npos
               ? std::string()
               : s.substr(open + 1, close - open - 1);
  }();
  return mode;
}

void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__)
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
  // Advice only: a failure (THP off, an old kernel) leaves small pages.
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

absl::Status CollapseToHugePages(const void* p, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
#if defined(__linux__)
  if (const std::string& mode = TransparentHugePageMode(); mode.empty() || mode == "never") {
    return absl::FailedPreconditionError("transparent huge pages are off (never)");
  }
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t head = begin & ~(kHuge - 1);
  const uintptr_t body = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t tail = (begin + bytes) & ~(kHuge - 1);
  const uintptr_t end = (begin + bytes + kHuge - 1) & ~(kHuge - 1);
  // The pages it shares with neighbours apart from the whole ones inside: madvise stops at the
  // first mapping it fails on, and those pages lie in other mappings (the advice split the
  // heap at 2 MiB) or past the heap's end.
  absl::Status status;
  if (body > tail) {  // the range sits inside one huge page
    status.Update(Collapse(head, end));
  } else {
    status.Update(Collapse(body, tail));
    if (head < body) status.Update(Collapse(head, body));
    if (tail < end) status.Update(Collapse(tail, end));
  }
  return status;
#else
  (void)p;
  return absl::UnimplementedError("MADV_COLLAPSE: not Linux");
#endif
}

}  // namespace kvgrid::kernels::cpu
