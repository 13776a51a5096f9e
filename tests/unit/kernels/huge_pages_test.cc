// Huge pages for weights (kernels/cpu/huge_pages.h): memory already faulted in as small pages
// (what the heap hands out again) ends on huge pages after CollapseToHugePages, the pages it
// shares with neighbours included, with every byte unchanged.
#include "kernels/cpu/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr size_t kHuge = kHugePageBytes;

// AnonHugePages (kB) of the mapping that holds `p`, from /proc/self/smaps; -1 if not found.
int64_t AnonHugeKb(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(std::strlen("AnonHugePages:")));
    }
  }
  return -1;
}

// An anonymous mapping of `huge_pages` whole huge pages, 2 MiB-aligned, unmapped at the end.
class AlignedMapping {
 public:
  explicit AlignedMapping(size_t huge_pages) : bytes_(huge_pages * kHuge + kHuge) {
    raw_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw_ == MAP_FAILED) raw_ = nullptr;
  }
  ~AlignedMapping() {
    if (raw_) munmap(raw_, bytes_);
  }
  AlignedMapping(const AlignedMapping&) = delete;
  AlignedMapping& operator=(const AlignedMapping&) = delete;
  uint8_t* base() const {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_) + kHuge - 1) &
                                      ~(kHuge - 1));
  }
  bool ok() const { return raw_ != nullptr; }

 private:
  size_t bytes_;
  void* raw_ = nullptr;
};

TEST(HugePages, CollapseMovesMemoryAlreadyOnSmallPages) {
  const std::string& mode = TransparentHugePageMode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' here";
  }
  const size_t pages = 8, bytes = pages * kHuge;
  AlignedMapping map(pages);
  ASSERT_TRUE(map.ok());
  uint8_t* base = map.base();
  // Under `madvise` memory without advice is faulted in as small pages, and khugepaged leaves
  // it alone; under `always` it could be huge at once, so the advice says otherwise (and
  // khugepaged may still come by: the check before is only made under `madvise`).
  const bool always = mode == "always";
  if (always) {
    ASSERT_EQ(madvise(base, bytes, MADV_NOHUGEPAGE), 0);
  }
  for (size_t i = 0; i < bytes; ++i) base[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  if (always) {
    ASSERT_EQ(madvise(base, bytes, MADV_HUGEPAGE), 0);
  } else {
    ASSERT_EQ(AnonHugeKb(base), 0);
  }

  // A "matrix" of 3 MiB from 1 MiB into the first huge page: its two huge pages collapse,
  // the neighbours' bytes in them too.
  const absl::Status s = CollapseToHugePages(base + kHuge / 2, 3 * kHuge / 2);
  if (absl::IsUnimplemented(s)) GTEST_SKIP() << "no MADV_COLLAPSE (Linux before 6.1): " << s;
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_GE(AnonHugeKb(base), 2 * 2048);  // more only if khugepaged came by meanwhile
  for (size_t i = 0; i < bytes; ++i) {
    ASSERT_EQ(base[i], static_cast<uint8_t>(i * 7 + i / 4096)) << "byte " << i;
  }
}

TEST(HugePages, CollapseWithinOneHugePageAndOfNothing) {
  EXPECT_TRUE(CollapseToHugePages(nullptr, 0).ok());
  if (TransparentHugePageMode() != "madvise") GTEST_SKIP() << "checked under THP `madvise` only";
  AlignedMapping map(2);
  ASSERT_TRUE(map.ok());
  uint8_t* base = map.base();
  std::memset(base, 1, 2 * kHuge);
  const absl::Status s = CollapseToHugePages(base + 4096, 8192);  // 8 KiB inside page 0
  if (absl::IsUnimplemented(s)) GTEST_SKIP() << "no MADV_COLLAPSE (Linux before 6.1): " << s;
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(AnonHugeKb(base), 2048);  // page 0 only
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
