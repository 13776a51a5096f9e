// A Jinja2 template interpreter with the semantics Hugging Face transformers renders chat
// templates with: jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) with the loop-controls extension, its `tojson` (ensure_ascii=False),
// and the globals `raise_exception(msg)` and `strftime_now(fmt)`, plus jinja2's own
// (`range`, `dict`, `namespace`, `cycler`, `joiner`). Undefined variables behave as jinja2's
// default Undefined: empty when printed, false when tested, an error when used further.
//
// Statements: if/elif/else, for (with loop.*, else, break/continue, filters in the header),
// set (with targets, tuples, and block form), macro/call, filter blocks, raw, generation
// (transformers' assistant-mask tag, rendered transparently), comments and whitespace
// control. No include/extends/import (a chat template has no loader).
//
// Templates may come from requests, so every render is bounded: a step budget, an output
// size, and a nesting depth; exceeding one is an error, never a hang.
//
// Thread-safety: a parsed Template is immutable; Render may run concurrently.
#ifndef KVGRID_MODEL_JINJA_TEMPLATE_H_
#define KVGRID_MODEL_JINJA_TEMPLATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/jinja/value.h"

namespace kvgrid::model::jinja {

struct RenderLimits {
  // Evaluation steps (nodes evaluated, loop iterations, filter calls, and one per KiB of
  // string or 128 list elements a call, filter or operator returns), so a loop over
  // range(10**9), endless macro recursion or a loop copying a long string stops.
  int64_t max_steps = 5'000'000;
  // Bytes of any string built, the output included.
  int64_t max_output_bytes = int64_t{16} << 20;
  // Nesting of macro calls and expressions.
  int max_depth = 256;
};

struct Program;  // the parsed template (template.cc)

class Template {
 public:
  // Parses `source`. `name` prefixes error messages. Errors: INVALID_ARGUMENT
  // "<name>:<line>:<column>: <what>" for syntax errors (an unknown tag, an unclosed block, a
  // filter or test that does not exist, ...), and for sources over 1 MiB or nested deeper than
  // the parser allows.
  static absl::StatusOr<Template> Parse(std::string_view source,
                                        std::string_view name = "template");

  // Renders with `globals` (a dict; other kinds give no variables) as the template's
  // variables. Errors: INVALID_ARGUMENT "<name>:<line>:<column>: <what>" for what jinja2
  // raises at render time (a type error, an undefined value used, a call of
  // raise_exception, whose message is kept verbatim after "raise_exception: "), and when a
  // limit is exceeded.
  absl::StatusOr<std::string> Render(const Value& globals, const RenderLimits& limits = {}) const;

  [[nodiscard]] const std::string& name() const;

 private:
  explicit Template(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  std::shared_ptr<const Program> program_;
};

}  // namespace kvgrid::model::jinja

#endif  // KVGRID_MODEL_JINJA_TEMPLATE_H_
