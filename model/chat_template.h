// A model's chat template: the Jinja template that turns a conversation ("messages", tools,
// documents) into the prompt text the model was trained on, found where checkpoints keep it
// and rendered as Hugging Face transformers' apply_chat_template does.
//
// Where a template comes from (first found wins):
//   - a model directory: chat_template.jinja, else chat_template.json ({"chat_template": ...}),
//     else tokenizer_config.json's "chat_template";
//   - a .gguf file: the metadata key tokenizer.chat_template (and tokenizer.chat_template.<name>
//     for named ones); tokenizer_config.json beside it, when present, is read first;
//   - an explicit file (--chat-template): a .jinja file, a tokenizer_config.json, or a .gguf.
// A chat_template may be a string or a list of {"name", "template"} (named templates): "default"
// is used, and "tool_use" when the request has tools and the model defines it.
//
// The special tokens of tokenizer_config.json (bos_token, eos_token, unk_token, pad_token, and
// the rest of its *_token strings, given as strings or as {"content": ...} objects) are
// template variables, as transformers passes them.
//
// Thread-safety: immutable after construction; Render may run concurrently.
#ifndef KVGRID_MODEL_CHAT_TEMPLATE_H_
#define KVGRID_MODEL_CHAT_TEMPLATE_H_

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "model/jinja/template.h"
#include "model/jinja/value.h"

namespace kvgrid::model {

class ChatTemplate {
 public:
  // The template a model (a directory or a .gguf file) carries, or nullptr when it has none.
  // Errors: INVALID_ARGUMENT naming the file for unreadable or malformed files and for a
  // template that does not parse.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> ForModel(const std::filesystem::path& model);

  // The template in `file` (.jinja, tokenizer_config.json or any JSON with "chat_template",
  // .gguf). Errors: NOT_FOUND for a missing file; INVALID_ARGUMENT naming the file when it
  // holds no template or it does not parse.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromFile(const std::filesystem::path& file);

  // A template given as source text, with no special tokens. Errors: as jinja::Template::Parse.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromSource(std::string_view source,
                                                                  std::string_view name);

  // Replaces this template's special-token variables with those of `other` (a --chat-template
  // file given as a bare .jinja keeps the model's tokens).
  void InheritSpecialTokens(const ChatTemplate& other);
  // Replaces them with those of `model` (its tokenizer_config.json, else a .gguf file's
  // tokens), for a model that has no template of its own to inherit from. Errors: as ForModel.
  absl::Status InheritSpecialTokens(const std::filesystem::path& model);

  // Renders a conversation. `variables` is a dict holding "messages" (a list), and optionally
  // "tools", "documents", "add_generation_prompt" and any other template variable
  // (chat_template_kwargs such as "enable_thinking"); they override the special tokens of the
  // same name. Messages whose content is a list of parts keep it (templates that understand
  // parts read them); see FlattenTextParts. Errors: INVALID_ARGUMENT "chat template: ..." for
  // what the template raises or fails on, with its line and column.
  absl::StatusOr<std::string> Render(const jinja::Value& variables,
                                     const jinja::RenderLimits& limits = {}) const;

  // The special tokens the template calls bos_token and eos_token ("" when not defined).
  [[nodiscard]] const std::string& bos_token() const { return bos_token_; }
  [[nodiscard]] const std::string& eos_token() const { return eos_token_; }
  // Where the template came from (a file path, or the name given to FromSource).
  [[nodiscard]] const std::string& source() const { return source_; }
  // The names of the templates held ("default" for an unnamed one).
  [[nodiscard]] std::vector<std::string> names() const;

 private:
  ChatTemplate() = default;
  // Builds from a tokenizer_config-like JSON object's "chat_template" and *_token fields.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromConfigJson(std::string_view json_text,
                                                                       const std::string& source);
  // `dir`/tokenizer_config.json's template and special tokens; null when there is no such file.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> ReadTokenizerConfig(
      const std::filesystem::path& dir);
  // From a GGUF file's tokenizer.chat_template keys and special token ids.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> FromGguf(const std::filesystem::path& path);

  std::vector<std::pair<std::string, jinja::Template>> templates_;  // name -> template
  // Variable -> text (a list for additional_special_tokens), as transformers'
  // special_tokens_map.
  std::vector<std::pair<std::string, jinja::Value>> special_tokens_;
  std::string bos_token_;
  std::string eos_token_;
  std::string source_;
};

// For OpenAI-style messages whose "content" is a list of parts: a copy of `messages` in which
// a content made only of {"type": "text", "text": ...} parts becomes their texts joined by
// "\n" (as vLLM does for templates that expect a string). Other parts (images, ...) give
// INVALID_ARGUMENT naming the message and part, since no served model reads them.
absl::StatusOr<jinja::Value> FlattenTextParts(const jinja::Value& messages);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_CHAT_TEMPLATE_H_
