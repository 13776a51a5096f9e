#include "model/jinja/template.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "model/jinja/ast.h"
#include "model/jinja/interp.h"
#include "model/json_util.h"

namespace kvgrid::model::jinja {

struct Program {
  std::string name;
  Body body;
};

absl::StatusOr<Template> Template::Parse(std::string_view source, std::string_view name) {
  absl::StatusOr<Body> body = ParseProgram(source, name);
  if (!body.ok()) return body.status();
  auto program = std::make_shared<Program>();
  program->name = std::string(name);
  program->body = *std::move(body);
  return Template(std::move(program));
}

absl::StatusOr<std::string> Template::Render(const Value& globals, const RenderLimits& limits) const {
  std::string out;
  static const Value kNoGlobals = Value(Dict{});
  Interp interp(limits, globals.is_dict() ? globals : kNoGlobals, &out);
  try {
    interp.Run(program_->body);
  } catch (const RenderError& e) {
    return absl::InvalidArgumentError(absl::StrCat(program_->name, ":", e.pos.line, ":",
                                                   e.pos.column, ": ", e.message));
  }
  return out;
}

const std::string& Template::name() const { return program_->name; }

}  // namespace kvgrid::model::jinja
