// libFuzzer target for the GGUF reader and what reads its metadata (model config, embedded
// tokenizer); inputs go through an in-memory file (memfd_input.h).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/gguf.h"
#include "model/gguf_config.h"
#include "model/gguf_tokenizer.h"
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
    // What is read from the metadata (the model's shape, the embedded tokenizer) is refused
    // with a status when it is wrong, never a crash.
    (void)kvgrid::model::ModelConfigFromGguf(**file);
    if (auto tokenizer = kvgrid::model::TokenizerFromGguf(**file); tokenizer.ok()) {
      (void)(*tokenizer)->Encode("In the beginning 123 <|begin_of_text|>", true);
    }
  }
  return 0;
}
