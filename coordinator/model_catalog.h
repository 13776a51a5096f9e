// The models a coordinator serves: for each, what sizing, routing and the text API need —
// config.json (context length, vocabulary), generation_config.json (default sampling), the
// tokenizer and the chat template. No weights. A model is a Hugging Face directory or a .gguf
// file, whose metadata stands in for config.json and carries the tokenizer.
//
// Thread-safety: immutable after Load; lookups may run concurrently.
#ifndef KVGRID_COORDINATOR_MODEL_CATALOG_H_
#define KVGRID_COORDINATOR_MODEL_CATALOG_H_

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kvgrid/v1/generation.pb.h"
#include "model/chat_template.h"
#include "model/generation_config.h"
#include "model/model_config.h"
#include "model/tokenizer.h"

namespace kvgrid::coordinator {

struct ServedModel {
  std::string name;  // what clients and workers call it
  std::filesystem::path dir;
  model::ModelConfig config;
  model::GenerationConfig generation;
  std::unique_ptr<model::Tokenizer> tokenizer;  // null without one (ids only)
  std::optional<int32_t> bos_token_id;
  // EOS ids as the workers resolve them (generation_config.json, then config.json).
  std::vector<int32_t> eos_token_ids;
  // What chat requests (messages) are rendered with: the --chat-template given for the model,
  // else the model's own (model::ChatTemplate::ForModel); null when neither exists.
  std::unique_ptr<model::ChatTemplate> chat_template;
  // Why the model's own template is not used, when it has one that does not load (a parse
  // error): said to chat requests, and on stderr at startup. Empty otherwise.
  std::string chat_template_error;
  // The template's eos_token as a token id, when the tokenizer knows it: what ends an
  // assistant's turn (<|eot_id|>, <|im_end|>), which generation_config.json may not list.
  std::optional<int32_t> end_of_turn_token_id;
};

class ModelCatalog {
 public:
  // Loads each directory or .gguf file; a model's name is its directory's (or file's) name, as
  // the workers call it. `chat_templates` are the --chat-template entries: "FILE" (the
  // template of the only model) or "NAME=FILE"; each replaces the model's own template, and
  // a bare .jinja file keeps the model's special tokens. A model whose own template does not
  // load is served without one (chat_template_error says why). Errors: as the model/ readers
  // (naming the file), INVALID_ARGUMENT for two models with one name, and naming
  // --chat-template for a bare FILE with several models, a NAME not served, two templates
  // for one model, or a FILE that is missing or holds no usable template.
  static absl::StatusOr<ModelCatalog> Load(const std::vector<std::filesystem::path>& dirs,
                                           const std::vector<std::string>& chat_templates = {});

  // The model named `name`; an empty name means the only model when there is one.
  // Errors: NOT_FOUND naming the model and listing those served; INVALID_ARGUMENT for an
  // empty name when several are served.
  absl::StatusOr<const ServedModel*> Find(const std::string& name) const;
  // Find, for a model that must have a tokenizer (the text calls). Errors: as Find, and
  // FAILED_PRECONDITION without a tokenizer.
  absl::StatusOr<const ServedModel*> FindWithTokenizer(const std::string& name) const;
  [[nodiscard]] const std::vector<std::unique_ptr<ServedModel>>& models() const {
    return models_;
  }

 private:
  std::vector<std::unique_ptr<ServedModel>> models_;
};

// Token ids of `text` with `model`'s tokenizer (which must be present): with
// `add_special_tokens`, with what the tokenizer's post-processor adds (Tokenizer::Encode's
// add_special_tokens); after the model's BOS token when `add_bos` (not doubled when the
// post-processor already put it first). Errors: INVALID_ARGUMENT naming add_bos when the model
// defines no BOS.
absl::StatusOr<std::vector<int32_t>> EncodeText(const ServedModel& model, std::string_view text,
                                                bool add_bos, bool add_special_tokens = false);

// Fills the sampling fields a request left unset from the model's generation_config.json
// (as the CLI does), so the cluster samples like `kvgrid run` by default.
void ApplyGenerationDefaults(const model::GenerationConfig& generation,
                             v1::SamplingParams* sampling, v1::StoppingParams* stopping);

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_MODEL_CATALOG_H_
