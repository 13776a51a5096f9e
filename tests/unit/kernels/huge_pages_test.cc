// Huge pages for weights (kernels/cpu/huge_pages.h): memory faulted in as small pages before
// any advice (what the heap hands out again) ends on huge pages after CollapseToHugePages,
// neighbours included, with its contents unchanged; the advice alone does not move it.
#include "kernels/cpu/huge_pages.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr size_t kHuge = size_t{2} << 20;

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

bool ThpOff() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return s.empty() || s.find("[never]") != std::string::npos;
}

TEST(HugePages, CollapseMovesMemoryTouchedBeforeTheAdvice) {
  if (ThpOff()) GTEST_SKIP() << "transparent huge pages are off on this machine";
  // Eight huge pages' worth, aligned, touched as small pages first (no advice yet).
  const size_t bytes = 8 * kHuge;
  void* raw = mmap(nullptr, bytes + kHuge, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  auto* base = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~(kHuge - 1));
  madvise(base, bytes, MADV_NOHUGEPAGE);  // small pages whatever THP's default
  for (size_t i = 0; i < bytes; ++i) base[i] = static_cast<uint8_t>(i * 7 + i / 4096);
  AdviseHugePages(base, bytes);  // clears NOHUGEPAGE; the pages stay small
  ASSERT_EQ(AnonHugeKb(base), 0);

  // A "matrix" of 3 MiB starting 1 MiB into the first huge page: its two huge pages collapse,
  // the neighbours' bytes in them too.
  if (!CollapseToHugePages(base + kHuge / 2, 3 * kHuge / 2)) {
    GTEST_SKIP() << "the kernel declined MADV_COLLAPSE (Linux before 6.1, or no free huge page)";
  }
  EXPECT_GE(AnonHugeKb(base), 2 * 2048);  // more only if khugepaged came by meanwhile
  for (size_t i = 0; i < bytes; ++i) {
    ASSERT_EQ(base[i], static_cast<uint8_t>(i * 7 + i / 4096)) << "byte " << i;
  }
  munmap(raw, bytes + kHuge);
}

TEST(HugePages, CollapseOfNothingIsFine) {
  EXPECT_TRUE(CollapseToHugePages(nullptr, 0));
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
