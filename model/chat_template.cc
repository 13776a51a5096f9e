#include "model/chat_template.h"

#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/gguf.h"
#include "model/json_util.h"
#include "model/model_dir.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model {
namespace {

constexpr std::uintmax_t kMaxConfigBytes = 16 << 20;
constexpr std::uintmax_t kMaxTemplateBytes = 1 << 20;

// The special tokens transformers puts in special_tokens_map, in its order.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

// A token given as a string or as an AddedToken object {"content": ...}; nullopt otherwise.
std::optional<std::string> TokenText(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object()) {
    auto it = j.find("content");
    if (it != j.end() && it->is_string()) return it->get<std::string>();
  }
  return std::nullopt;
}

bool Exists(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}

// A model is a directory or a .gguf file (whose side files sit beside it).
bool IsGgufFile(const std::filesystem::path& model) {
  return model.extension() == ".gguf" && Exists(model);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromSource(std::string_view source,
                                                                       std::string_view name) {
  KVGRID_ASSIGN_OR_RETURN(jinja::Template t, jinja::Template::Parse(source, name));
  auto ct = std::unique_ptr<ChatTemplate>(new ChatTemplate());
  ct->templates_.emplace_back("default", std::move(t));
  ct->source_ = std::string(name);
  return ct;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromConfigJson(
    std::string_view json_text, const std::string& source) {
  KVGRID_ASSIGN_OR_RETURN(nlohmann::json j, ParseJsonObject(json_text, source));
  auto ct = std::unique_ptr<ChatTemplate>(new ChatTemplate());
  ct->source_ = source;
  auto it = j.find("chat_template");
  if (it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      KVGRID_ASSIGN_OR_RETURN(jinja::Template t,
                              jinja::Template::Parse(it->get<std::string>(), source));
      ct->templates_.emplace_back("default", std::move(t));
    } else if (it->is_array()) {
      for (size_t i = 0; i < it->size(); ++i) {
        const nlohmann::json& e = (*it)[i];
        const auto name = e.is_object() ? e.find("name") : e.end();
        const auto tmpl = e.is_object() ? e.find("template") : e.end();
        if (!e.is_object() || name == e.end() || !name->is_string() || tmpl == e.end() ||
            !tmpl->is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              source, ": chat_template[", i, "]: expected {\"name\": ..., \"template\": ...}"));
        }
        const std::string n = name->get<std::string>();
        KVGRID_ASSIGN_OR_RETURN(
            jinja::Template t,
            jinja::Template::Parse(tmpl->get<std::string>(), absl::StrCat(source, "[", n, "]")));
        ct->templates_.emplace_back(n, std::move(t));
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": chat_template: expected a string or a list of named templates, got ",
          DescribeJson(*it)));
    }
  }
  for (const char* name : kSpecialTokenNames) {
    auto t = j.find(name);
    if (t == j.end()) continue;
    // As special_tokens_map: an empty or null token is not a variable.
    if (std::optional<std::string> text = TokenText(*t); text && !text->empty()) {
      ct->special_tokens_.emplace_back(name, jinja::Value(*text));
      if (std::string_view(name) == "bos_token") ct->bos_token_ = *text;
      if (std::string_view(name) == "eos_token") ct->eos_token_ = *text;
    }
  }
  if (auto a = j.find("additional_special_tokens"); a != j.end() && a->is_array()) {
    jinja::List tokens;
    for (const auto& e : *a) {
      if (std::optional<std::string> text = TokenText(e)) tokens.push_back(jinja::Value(*text));
    }
    ct->special_tokens_.emplace_back("additional_special_tokens", jinja::Value(std::move(tokens)));
  }
  return ct;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromFile(
    const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    return absl::NotFoundError(absl::StrCat(file.string(), ": no such file"));
  }
  std::unique_ptr<ChatTemplate> ct;
  if (file.extension() == ".gguf") {
    KVGRID_ASSIGN_OR_RETURN(ct, FromGguf(file));
  } else {
    KVGRID_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(file, kMaxConfigBytes));
    if (file.extension() == ".json") {
      KVGRID_ASSIGN_OR_RETURN(ct, FromConfigJson(text, file.string()));
    } else {
      KVGRID_ASSIGN_OR_RETURN(ct, FromSource(text, file.string()));
    }
  }
  if (ct->templates_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.string(), ": holds no chat template (no \"chat_template\")"));
  }
  return ct;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::ForModel(
    const std::filesystem::path& model) {
  const bool is_gguf = IsGgufFile(model);
  const std::filesystem::path dir = is_gguf ? model.parent_path() : model;
  // The special tokens (and possibly the template) of tokenizer_config.json.
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<ChatTemplate> config, ReadTokenizerConfig(dir));
  std::unique_ptr<ChatTemplate> found;
  if (const auto p = dir / "chat_template.jinja"; !is_gguf && Exists(p)) {
    KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(dir, p));
    KVGRID_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(p, kMaxTemplateBytes));
    KVGRID_ASSIGN_OR_RETURN(found, FromSource(text, p.string()));
  } else if (const auto p = dir / "chat_template.json"; !is_gguf && Exists(p)) {
    KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(dir, p));
    KVGRID_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(p, kMaxConfigBytes));
    KVGRID_ASSIGN_OR_RETURN(found, FromConfigJson(text, p.string()));
    if (found->templates_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(p.string(), ": holds no \"chat_template\""));
    }
  } else if (config != nullptr && !config->templates_.empty()) {
    return config;
  } else if (is_gguf) {
    KVGRID_ASSIGN_OR_RETURN(found, FromGguf(model));
    if (found->templates_.empty()) found.reset();
  }
  if (found == nullptr) return nullptr;
  if (config != nullptr) found->InheritSpecialTokens(*config);
  return found;
}

void ChatTemplate::InheritSpecialTokens(const ChatTemplate& other) {
  special_tokens_ = other.special_tokens_;
  bos_token_ = other.bos_token_;
  eos_token_ = other.eos_token_;
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::ReadTokenizerConfig(
    const std::filesystem::path& dir) {
  const auto p = dir / "tokenizer_config.json";
  if (!Exists(p)) return nullptr;
  KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(dir, p));
  KVGRID_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(p, kMaxConfigBytes));
  return FromConfigJson(text, p.string());
}

absl::Status ChatTemplate::InheritSpecialTokens(const std::filesystem::path& model) {
  const bool is_gguf = IsGgufFile(model);
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<ChatTemplate> tokens,
                          ReadTokenizerConfig(is_gguf ? model.parent_path() : model));
  if (tokens == nullptr && is_gguf) {
    KVGRID_ASSIGN_OR_RETURN(tokens, FromGguf(model));
  }
  if (tokens != nullptr) InheritSpecialTokens(*tokens);
  return absl::OkStatus();
}

std::vector<std::string> ChatTemplate::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : templates_) out.push_back(n);
  return out;
}

absl::StatusOr<std::string> ChatTemplate::Render(const jinja::Value& variables,
                                                 const jinja::RenderLimits& limits) const {
  if (!variables.is_dict()) {
    return absl::InvalidArgumentError("chat template: the variables must be a JSON object");
  }
  const jinja::Value* tools = variables.Find("tools");
  const bool has_tools = tools != nullptr && !tools->is_none() && !tools->is_undefined();
  // transformers: "tool_use" when tools are given and the model names one, else "default".
  const jinja::Template* chosen = nullptr;
  for (const auto& [n, t] : templates_) {
    if (has_tools && n == "tool_use") chosen = &t;
  }
  if (chosen == nullptr) {
    for (const auto& [n, t] : templates_) {
      if (n == "default") chosen = &t;
    }
  }
  if (chosen == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chat template: ", source_, " has named templates (",
        absl::StrJoin(names(), ", "), ") and none is \"default\"",
        has_tools ? "" : " (\"tool_use\" is used only for requests with tools)"));
  }
  // As apply_chat_template: messages, tools, documents, add_generation_prompt, then the
  // special tokens, then the caller's other variables (which override them).
  jinja::DictBuilder vars;
  vars.Set("messages", jinja::Value(jinja::List{}));
  vars.Set("tools", jinja::Value::None());
  vars.Set("documents", jinja::Value::None());
  vars.Set("add_generation_prompt", jinja::Value(false));
  for (const auto& [n, v] : special_tokens_) vars.Set(n, v);
  for (const auto& [k, v] : variables.as_dict()) vars.Set(k, v);
  absl::StatusOr<std::string> out = chosen->Render(std::move(vars).Build(), limits);
  if (!out.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("chat template: ", out.status().message()));
  }
  return out;
}

absl::StatusOr<jinja::Value> FlattenTextParts(const jinja::Value& messages) {
  if (!messages.is_list()) return absl::InvalidArgumentError("messages: must be a list");
  jinja::List out;
  const jinja::List& in = messages.as_list();
  for (size_t i = 0; i < in.size(); ++i) {
    const jinja::Value& m = in[i];
    const jinja::Value* content = m.Find("content");
    if (content == nullptr || !content->is_list()) {
      out.push_back(m);
      continue;
    }
    std::string text;
    const jinja::List& parts = content->as_list();
    for (size_t j = 0; j < parts.size(); ++j) {
      const jinja::Value* type = parts[j].Find("type");
      const jinja::Value* part_text = parts[j].Find("text");
      if (type == nullptr || !type->is_string() || type->as_string() != "text" ||
          part_text == nullptr || !part_text->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "messages[", i, "].content[", j, "]: only {\"type\": \"text\", \"text\": ...} parts are "
            "supported",
            type != nullptr && type->is_string() ? absl::StrCat(" (got type '", type->as_string(), "')")
                                                 : std::string()));
      }
      if (j > 0) text += "\n";
      text += part_text->as_string();
    }
    jinja::DictBuilder b;
    for (const auto& [k, v] : m.as_dict()) b.Set(k, v);
    b.Set("content", jinja::Value(std::move(text)));
    out.push_back(std::move(b).Build());
  }
  return jinja::Value(std::move(out));
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromGguf(
    const std::filesystem::path& path) {
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> gguf, GgufFile::Open(path));
  // The template, named ones as tokenizer.chat_template.<name>, and the special tokens.
  nlohmann::json config = nlohmann::json::object();
  nlohmann::json named = nlohmann::json::array();
  absl::StatusOr<std::string> main = gguf->GetString("tokenizer.chat_template");
  constexpr std::string_view kPrefix = "tokenizer.chat_template.";
  for (const auto& [key, v] : gguf->metadata()) {
    if (key.rfind(kPrefix, 0) != 0) continue;
    absl::StatusOr<std::string> t = gguf->GetString(key);
    if (!t.ok()) continue;
    named.push_back({{"name", key.substr(kPrefix.size())}, {"template", *t}});
  }
  if (main.ok()) {
    if (named.empty()) {
      config["chat_template"] = *main;
    } else {
      named.insert(named.begin(), nlohmann::json{{"name", "default"}, {"template", *main}});
    }
  }
  if (!named.empty()) config["chat_template"] = named;
  absl::StatusOr<const GgufStringArray*> tokens = gguf->GetStringArray("tokenizer.ggml.tokens");
  if (tokens.ok()) {
    const auto token = [&](const char* key) -> std::optional<std::string> {
      absl::StatusOr<int64_t> id = gguf->GetInt(key);
      if (!id.ok() || *id < 0 || *id >= static_cast<int64_t>((*tokens)->size())) return std::nullopt;
      return std::string((**tokens)[static_cast<size_t>(*id)]);
    };
    if (auto t = token("tokenizer.ggml.bos_token_id")) config["bos_token"] = *t;
    if (auto t = token("tokenizer.ggml.eos_token_id")) config["eos_token"] = *t;
    if (auto t = token("tokenizer.ggml.unknown_token_id")) config["unk_token"] = *t;
    if (auto t = token("tokenizer.ggml.padding_token_id")) config["pad_token"] = *t;
  }
  return FromConfigJson(config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                        path.string());
}

}  // namespace kvgrid::model
