// libFuzzer target for the chat-template interpreter (model/jinja): the input is a template,
// parsed and rendered against a fixed chat-like context under tight limits. The properties
// checked: parsing and rendering return a Status (never crash, hang or leak), and a render
// that succeeds stays within the output limit.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "model/jinja/template.h"
#include "model/jinja/value.h"

namespace {

using kvgrid::model::jinja::RenderLimits;
using kvgrid::model::jinja::Template;
using kvgrid::model::jinja::Value;

const Value& Context() {
  static const Value* const context = [] {
    auto v = Value::FromJson(R"({
      "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi \u00e9 <think>x</think>"},
        {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null]}}}]},
        {"role": "tool", "content": "{\"r\": 2}"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>",
      "n": 3, "f": 1.5, "s": "a,b,c", "none": null})",
                             "fuzz context");
    if (!v.ok()) std::abort();
    return new Value(*std::move(v));
  }();
  return *context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  auto t = Template::Parse(source, "fuzz");
  if (!t.ok()) return 0;
  // Limits far below the server's: a runaway loop costs the fuzzer 20,000 steps, not
  // millions, so its time goes to new inputs; every limit is still reached and checked.
  RenderLimits limits;
  limits.max_steps = 20000;
  limits.max_output_bytes = 256 << 10;
  limits.max_depth = 64;
  auto out = t->Render(Context(), limits);
  if (out.ok() && static_cast<int64_t>(out->size()) > limits.max_output_bytes) std::abort();
  return 0;
}
