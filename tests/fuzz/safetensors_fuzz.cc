// libFuzzer target for the safetensors header parser and Checkpoint::ReadF32.
//
// The reader only takes paths, so each input goes into an in-memory file (memfd) that is
// opened through /proc/self/fd: no disk traffic, and the real open/fstat/mmap path runs.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace {

using kvgrid::model::Checkpoint;
using kvgrid::model::DType;
using kvgrid::model::DTypeSize;
using kvgrid::model::SafetensorsFile;

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("safetensors_fuzz", MFD_CLOEXEC);
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
  const std::string path = "/proc/self/fd/" + std::to_string(fd);

  auto file = SafetensorsFile::Open(path);
  if (file.ok()) {
    // Every accepted tensor must describe bytes that exist: touch all of them (a view past
    // the mapping faults) and check the size arithmetic the parser promised.
    unsigned sum = 0;
    for (const auto& [name, view] : (*file)->tensors()) {
      Check(view.NumElements() >= 0);
      Check(view.data.size() == static_cast<size_t>(view.NumElements()) * DTypeSize(view.dtype));
      for (std::byte b : view.data) sum += static_cast<unsigned>(b);
    }
    volatile unsigned sink = sum;
    (void)sink;

    auto checkpoint = Checkpoint::Open(path);
    Check(checkpoint.ok());
    std::vector<float> out;
    for (const std::string& name : (*checkpoint)->Names()) {
      const auto status = (*checkpoint)->ReadF32(name, {}, &out);
      const DType dtype = (*checkpoint)->Find(name).value()->dtype;
      const bool convertible =
          dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
      Check(status.ok() == convertible);
    }
  }
  close(fd);
  return 0;
}
