// kvgrid chat-template: renders a chat template as the server does, for checking a template
// against what a model expects (and against transformers' apply_chat_template).
//
//   --template FILE --request REQUEST.json: prints exactly the rendered text.
//   --batch CASES.jsonl: one {"template", "variables"} object a line in, one
//                        {"ok", "text" | "error"} line out (for bulk checks).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "model/chat_template.h"
#include "model/jinja/template.h"
#include "model/jinja/value.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"

namespace kvgrid::cli {
namespace {

namespace jinja = model::jinja;

constexpr char kHelp[] =
    "usage: kvgrid chat-template --template FILE --request REQUEST.json\n"
    "       kvgrid chat-template --batch CASES.jsonl\n"
    "\n"
    "Renders a chat template with Hugging Face transformers' semantics and prints exactly the\n"
    "rendered text (no newline added). FILE is a .jinja file, a tokenizer_config.json (or any\n"
    "JSON with \"chat_template\"), or a .gguf file. REQUEST.json is an object with \"messages\",\n"
    "optional \"tools\", \"documents\", \"add_generation_prompt\", and any other template\n"
    "variable at top level (e.g. \"bos_token\", \"enable_thinking\"), which override the\n"
    "file's special tokens. A template that raises or fails exits 1 with the message on\n"
    "stderr.\n"
    "\n"
    "--batch reads JSON lines {\"template\": SOURCE, \"variables\": {...}} and writes one JSON\n"
    "line per input: {\"ok\": true, \"text\": ...} or {\"ok\": false, \"error\": ...}. The\n"
    "variables are the template's globals as given.\n";

int Fail(const std::string& message, int code = 1) {
  std::fflush(stdout);
  std::fprintf(stderr, "kvgrid chat-template: %s\n", message.c_str());
  return code;
}

std::string Dump(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

int Batch(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Fail(absl::StrCat(path, ": cannot open"));
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    nlohmann::ordered_json out;
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("template") || !j["template"].is_string()) {
      return Fail(absl::StrCat(path, ":", n, ": expected {\"template\": ..., \"variables\": ...}"));
    }
    jinja::Value vars = jinja::Value(jinja::Dict{});
    if (j.contains("variables")) {
      absl::StatusOr<jinja::Value> v =
          jinja::Value::FromJson(Dump(j["variables"]), absl::StrCat(path, ":", n));
      if (!v.ok()) return Fail(std::string(v.status().message()));
      vars = *std::move(v);
    }
    absl::StatusOr<jinja::Template> t =
        jinja::Template::Parse(j["template"].get<std::string>(), "template");
    absl::StatusOr<std::string> text = t.ok() ? t->Render(vars) : t.status();
    if (text.ok()) {
      out = {{"ok", true}, {"text", *text}};
    } else {
      out = {{"ok", false}, {"error", std::string(text.status().message())}};
    }
    std::fputs(Dump(out).c_str(), stdout);
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int ChatTemplateCommand(Args& args) {
  if (args.Has("help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  const std::optional<std::string> file = args.GetString("template");
  const std::optional<std::string> request = args.GetString("request");
  const std::optional<std::string> batch = args.GetString("batch");
  if (absl::Status s = args.Finish(); !s.ok()) return Fail(std::string(s.message()), 2);
  if (batch) {
    if (file || request) return Fail("--batch takes no --template or --request", 2);
    return Batch(*batch);
  }
  if (!file || !request) return Fail("--template FILE and --request REQUEST.json are required", 2);
  absl::StatusOr<std::unique_ptr<model::ChatTemplate>> tmpl = model::ChatTemplate::FromFile(*file);
  if (!tmpl.ok()) return Fail(std::string(tmpl.status().message()));
  absl::StatusOr<std::string> text = model::ReadSmallFile(*request, std::uintmax_t{64} << 20);
  if (!text.ok()) return Fail(absl::StrCat(*request, ": ", text.status().message()));
  absl::StatusOr<jinja::Value> vars = jinja::Value::FromJson(*text, *request);
  if (!vars.ok()) return Fail(std::string(vars.status().message()));
  if (!vars->is_dict()) return Fail(absl::StrCat(*request, ": expected a JSON object"));
  absl::StatusOr<std::string> rendered = (*tmpl)->Render(*vars);
  if (!rendered.ok()) return Fail(std::string(rendered.status().message()));
  std::fwrite(rendered->data(), 1, rendered->size(), stdout);
  std::fflush(stdout);
  return 0;
}

}  // namespace kvgrid::cli
