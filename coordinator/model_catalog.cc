#include "coordinator/model_catalog.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/gguf.h"
#include "model/gguf_config.h"
#include "model/gguf_tokenizer.h"
#include "model/model_config.h"
#include "model/special_tokens.h"
#include "model/status_macros.h"

namespace kvgrid::coordinator {

absl::StatusOr<ModelCatalog> ModelCatalog::Load(const std::vector<std::filesystem::path>& dirs) {
  ModelCatalog catalog;
  for (const std::filesystem::path& dir : dirs) {
    auto m = std::make_unique<ServedModel>();
    m->dir = dir;
    m->name = model::ServedModelName(dir);
    // A .gguf file describes itself in its metadata; its optional generation_config.json
    // (and a tokenizer.json that overrides the embedded tokenizer) sit beside it.
    std::error_code ec;
    if (dir.extension() == ".gguf" && std::filesystem::is_regular_file(dir, ec)) {
      KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<model::GgufFile> gguf, model::GgufFile::Open(dir));
      KVGRID_ASSIGN_OR_RETURN(m->config, model::ModelConfigFromGguf(*gguf));
      KVGRID_ASSIGN_OR_RETURN(m->generation, model::LoadGenerationConfig(dir.parent_path()));
    } else {
      KVGRID_ASSIGN_OR_RETURN(m->config, model::LoadModelConfig(dir / "config.json"));
      KVGRID_ASSIGN_OR_RETURN(m->generation, model::LoadGenerationConfig(dir));
    }
    KVGRID_ASSIGN_OR_RETURN(m->tokenizer, model::LoadModelTokenizer(dir));
    m->bos_token_id = model::ResolveBosTokenId(m->tokenizer.get(), m->generation, m->config);
    for (const auto& other : catalog.models_) {
      if (other->name == m->name) {
        return absl::InvalidArgumentError(absl::StrCat("--model: two models are named '",
                                                       m->name, "' (", other->dir.string(),
                                                       ", ", dir.string(), ")"));
      }
    }
    catalog.models_.push_back(std::move(m));
  }
  return catalog;
}

absl::StatusOr<const ServedModel*> ModelCatalog::Find(const std::string& name) const {
  if (name.empty()) {
    if (models_.size() == 1) return models_.front().get();
    return absl::InvalidArgumentError("model: must be set; this cluster serves several models");
  }
  std::vector<std::string> names;
  for (const auto& m : models_) {
    if (m->name == name) return m.get();
    names.push_back(m->name);
  }
  return absl::NotFoundError(absl::StrCat("model: '", name, "' is not served here (served: ",
                                          absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<std::vector<int32_t>> EncodeText(const ServedModel& m, std::string_view text,
                                                bool add_bos) {
  std::vector<int32_t> ids;
  if (add_bos) {
    if (!m.bos_token_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("add_bos: model '", m.name, "' defines no BOS token"));
    }
    ids.push_back(*m.bos_token_id);
  }
  const std::vector<int32_t> text_ids = m.tokenizer->Encode(text);
  ids.insert(ids.end(), text_ids.begin(), text_ids.end());
  return ids;
}

void ApplyGenerationDefaults(const model::GenerationConfig& g, v1::SamplingParams* sampling,
                             v1::StoppingParams* stopping) {
  if (!sampling->has_temperature()) {
    if (g.do_sample && !*g.do_sample) {
      sampling->set_temperature(0.f);
    } else if (g.temperature) {
      sampling->set_temperature(static_cast<float>(*g.temperature));
    }
  }
  if (!sampling->has_top_p() && g.top_p) sampling->set_top_p(static_cast<float>(*g.top_p));
  if (sampling->top_k() == 0 && g.top_k) sampling->set_top_k(static_cast<int32_t>(*g.top_k));
  if (sampling->min_p() == 0 && g.min_p) sampling->set_min_p(static_cast<float>(*g.min_p));
  if (!sampling->has_repetition_penalty() && g.repetition_penalty) {
    sampling->set_repetition_penalty(static_cast<float>(*g.repetition_penalty));
  }
  if (!stopping->has_max_new_tokens() && g.max_new_tokens) {
    stopping->set_max_new_tokens(static_cast<int32_t>(*g.max_new_tokens));
  }
}

}  // namespace kvgrid::coordinator
