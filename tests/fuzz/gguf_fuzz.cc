// libFuzzer target for the GGUF reader (inputs through an in-memory file: memfd_input.h).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/gguf.h"
#include "tests/fuzz/memfd_input.h"

namespace {

void Check(bool condition) {
  if (!condition) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvgrid::fuzz::MemfdInput input(data, size);
  if (input.path().empty()) return 0;
  auto file = kvgrid::model::GgufFile::Open(input.path());
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
  return 0;
}
