// The models a coordinator serves: for each, what sizing, routing and the text API need —
// config.json (context length, vocabulary), generation_config.json (default sampling) and the
// tokenizer. No weights. A model is a Hugging Face directory or a .gguf file, whose metadata
// stands in for config.json and carries the tokenizer.
//
// Thread-safety: immutable after Load; lookups may run concurrently.
#ifndef KVGRID_COORDINATOR_MODEL_CATALOG_H_
#define KVGRID_COORDINATOR_MODEL_CATALOG_H_

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvgrid/v1/generation.pb.h"
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
};

class ModelCatalog {
 public:
  // Loads each directory or .gguf file; a model's name is its directory's (or file's) name, as
  // the workers call it. Errors: as the model/ readers (naming the file), INVALID_ARGUMENT
  // for two models with one name.
  static absl::StatusOr<ModelCatalog> Load(const std::vector<std::filesystem::path>& dirs);

  // The model named `name`; an empty name means the only model when there is one.
  // Errors: NOT_FOUND naming the model and listing those served; INVALID_ARGUMENT for an
  // empty name when several are served.
  absl::StatusOr<const ServedModel*> Find(const std::string& name) const;
  [[nodiscard]] const std::vector<std::unique_ptr<ServedModel>>& models() const {
    return models_;
  }

 private:
  std::vector<std::unique_ptr<ServedModel>> models_;
};

// Token ids of `text` with `model`'s tokenizer (which must be present), after its BOS token
// when `add_bos`. Errors: INVALID_ARGUMENT naming add_bos when the model defines no BOS.
absl::StatusOr<std::vector<int32_t>> EncodeText(const ServedModel& model, std::string_view text,
                                                bool add_bos);

// Fills the sampling fields a request left unset from the model's generation_config.json
// (as the CLI does), so the cluster samples like `kvgrid run` by default.
void ApplyGenerationDefaults(const model::GenerationConfig& generation,
                             v1::SamplingParams* sampling, v1::StoppingParams* stopping);

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_MODEL_CATALOG_H_
