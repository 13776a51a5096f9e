// The fuzz targets' readers take paths: each input goes into an in-memory file (memfd),
// opened through /proc/self/fd, so the real open/fstat/mmap path runs without disk traffic.
#ifndef KVGRID_TESTS_FUZZ_MEMFD_INPUT_H_
#define KVGRID_TESTS_FUZZ_MEMFD_INPUT_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvgrid::fuzz {

// Holds `data` in a memfd for the lifetime of the object; path() is empty if that failed.
class MemfdInput {
 public:
  MemfdInput(const uint8_t* data, size_t size) {
    fd_ = memfd_create("kvgrid_fuzz", MFD_CLOEXEC);
    if (fd_ < 0) return;
    size_t written = 0;
    while (written < size) {
      const ssize_t n = write(fd_, data + written, size - written);
      if (n <= 0) return;
      written += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemfdInput() {
    if (fd_ >= 0) close(fd_);
  }
  MemfdInput(const MemfdInput&) = delete;
  MemfdInput& operator=(const MemfdInput&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace kvgrid::fuzz

#endif  // KVGRID_TESTS_FUZZ_MEMFD_INPUT_H_
