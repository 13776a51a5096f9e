// libFuzzer target for the tokenizer: the first byte picks the mode.
//   0: the rest is a tokenizer.json to load (must fail cleanly or load).
//   otherwise: the rest is text for the real Llama-3 tokenizer; the property checked is
//   DecodeBytes(Encode(text)) == text, and that the streaming detokenizer emits valid UTF-8
//   that adds up to the same text whenever the text itself is valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "model/tokenizer.h"

namespace {

using kvgrid::model::IncrementalDetokenizer;
using kvgrid::model::Tokenizer;

void Check(bool condition) {
  if (!condition) std::abort();
}

const Tokenizer* Llama3() {
  static const Tokenizer* tokenizer = [] {
    auto t = Tokenizer::FromFile(std::string(KVGRID_SOURCE_DIR) +
                                 "/tests/data/tokenizers/llama3/tokenizer.json");
    Check(t.ok());
    return t->release();
  }();
  return tokenizer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] == 0) {
    auto t = Tokenizer::FromJson(rest, "fuzz.json");
    if (t.ok()) (void)(*t)->Encode("fuzz input \xF0\x9F\x98\x80 123", true);
    return 0;
  }
  const Tokenizer* tokenizer = Llama3();
  const std::vector<int32_t> ids = tokenizer->Encode(rest);
  auto bytes = tokenizer->DecodeBytes(ids);
  Check(bytes.ok() && *bytes == rest);
  IncrementalDetokenizer detok(tokenizer, /*skip_special_tokens=*/false);
  std::string streamed;
  for (int32_t id : ids) {
    auto delta = detok.Push(id);
    Check(delta.ok());
    streamed += *delta;
  }
  streamed += detok.Finish();
  auto text = tokenizer->Decode(ids);
  Check(text.ok() && *text == streamed);
  return 0;
}
