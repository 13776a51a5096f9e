// libFuzzer target for the GGUF reader. Each input goes into an in-memory file (memfd) opened
// through /proc/self/fd, so the real open/fstat/mmap path runs.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/gguf.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("gguf_fuzz", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) {
      close(fd);
      return 0;
    }
    written += static_cast<size_t>(n);
  }
  auto file = kvgrid::model::GgufFile::Open("/proc/self/fd/" + std::to_string(fd));
  if (file.ok()) {
    // Every accepted tensor describes bytes that exist and that its type and shape imply.
    unsigned sum = 0;
    for (const auto& [name, t] : (*file)->tensors()) {
      const auto bytes = kvgrid::model::GgmlBytes(t.type, t.NumElements());
      Check(bytes.has_value() && static_cast<size_t>(*bytes) == t.data.size());
      for (std::byte b : t.data) sum += static_cast<unsigned>(b);
    }
    volatile unsigned sink = sum;
    (void)sink;
  }
  close(fd);
  return 0;
}
