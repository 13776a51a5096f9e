#include "coordinator/model_catalog.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/gguf.h"
#include "model/gguf_config.h"
#include "model/gguf_tokenizer.h"
#include "model/json_util.h"
#include "model/model_config.h"
#include "model/special_tokens.h"
#include "model/status_macros.h"

namespace kvgrid::coordinator {
namespace {

// Applies one --chat-template entry ("FILE" or "NAME=FILE") to `models`.
absl::Status ApplyChatTemplateFlag(const std::string& entry,
                                   const std::vector<std::unique_ptr<ServedModel>>& models,
                                   std::vector<const ServedModel*>* overridden) {
  ServedModel* target = nullptr;
  std::string file = entry;
  if (const size_t eq = entry.find('='); eq != std::string::npos) {
    for (const auto& m : models) {
      if (m->name == entry.substr(0, eq)) {
        target = m.get();
        file = entry.substr(eq + 1);
      }
    }
  }
  std::error_code ec;
  if (target == nullptr && entry.find('=') != std::string::npos &&
      !std::filesystem::exists(entry, ec)) {
    std::vector<std::string> names;
    for (const auto& m : models) names.push_back(m->name);
    return absl::InvalidArgumentError(absl::StrCat(
        "--chat-template: '", entry.substr(0, entry.find('=')),
        "' is not a model served here (served: ", absl::StrJoin(names, ", "), ")"));
  }
  if (target == nullptr) {
    if (models.size() != 1) {
      std::vector<std::string> names;
      for (const auto& m : models) names.push_back(m->name);
      return absl::InvalidArgumentError(absl::StrCat(
          "--chat-template: '", entry, "' does not say which model it is for; this "
          "coordinator serves several (", absl::StrJoin(names, ", "), "): give NAME=FILE, "
          "e.g. --chat-template ", names.front(), "=chat_template.jinja"));
    }
    target = models.front().get();
  }
  for (const ServedModel* done : *overridden) {
    if (done == target) {
      return absl::InvalidArgumentError(
          absl::StrCat("--chat-template: two templates for model '", target->name, "'"));
    }
  }
  overridden->push_back(target);
  absl::StatusOr<std::unique_ptr<model::ChatTemplate>> tpl = model::ChatTemplate::FromFile(file);
  if (!tpl.ok()) {
    return absl::Status(tpl.status().code(),
                        absl::StrCat("--chat-template: ", tpl.status().message()));
  }
  // A bare template has no special tokens: it renders with the model's.
  if (std::filesystem::path(file).extension() == ".jinja") {
    if (target->chat_template) {
      (*tpl)->InheritSpecialTokens(*target->chat_template);
    } else if (absl::Status s = (*tpl)->InheritSpecialTokens(target->dir); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("--chat-template: ", s.message()));
    }
  }
  target->chat_template = *std::move(tpl);
  target->chat_template_error.clear();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelCatalog> ModelCatalog::Load(const std::vector<std::filesystem::path>& dirs,
                                                const std::vector<std::string>& chat_templates) {
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
      KVGRID_ASSIGN_OR_RETURN(m->generation, model::LoadGenerationConfig(dir.parent_path(),
                                                                         m->config.vocab_size));
    } else {
      const std::filesystem::path config =
          std::filesystem::is_directory(dir, ec) ? dir : dir / "config.json";
      KVGRID_ASSIGN_OR_RETURN(m->config, model::LoadModelConfig(config));
      KVGRID_ASSIGN_OR_RETURN(m->generation,
                              model::LoadGenerationConfig(dir, m->config.vocab_size));
    }
    KVGRID_ASSIGN_OR_RETURN(m->tokenizer, model::LoadModelTokenizer(dir));
    if (m->tokenizer) {
      KVGRID_RETURN_IF_ERROR(model::CheckTokenizerFitsVocabulary(
          *m->tokenizer, m->config.vocab_size, dir.string()));
    }
    if (!m->tokenizer) {
      // Served, but only for prompts of token ids: say so once, at startup, not per request.
      const bool gguf = dir.extension() == ".gguf";
      const bool spm_only =
          std::filesystem::exists((gguf ? dir.parent_path() : dir) / "tokenizer.model", ec);
      std::fprintf(stderr,
                   "kvgrid-coordinator: model '%s' has no tokenizer (no tokenizer.json%s): only "
                   "prompts of token ids are served%s\n",
                   m->name.c_str(), gguf ? " beside it, none embedded" : " in its directory",
                   spm_only ? "; tokenizer.model (SentencePiece) is not read, save the model's "
                              "tokenizer.json with transformers (tokenizer.save_pretrained)"
                            : "");
    }
    m->bos_token_id = model::ResolveBosTokenId(m->tokenizer.get(), m->generation, m->config);
    m->eos_token_ids = model::ResolveEosTokenIds(m->generation, m->config);
    // A template the interpreter cannot load leaves the model serving prompts; chat requests
    // are told why (and --chat-template can replace it).
    if (absl::StatusOr<std::unique_ptr<model::ChatTemplate>> tpl =
            model::ChatTemplate::ForModel(dir);
        tpl.ok()) {
      m->chat_template = *std::move(tpl);
    } else {
      m->chat_template_error = std::string(tpl.status().message());
    }
    for (const auto& other : catalog.models_) {
      if (other->name == m->name) {
        return absl::InvalidArgumentError(absl::StrCat("--model: two models are named '",
                                                       m->name, "' (", other->dir.string(),
                                                       ", ", dir.string(), ")"));
      }
    }
    catalog.models_.push_back(std::move(m));
  }
  std::vector<const ServedModel*> overridden;
  for (const std::string& entry : chat_templates) {
    KVGRID_RETURN_IF_ERROR(ApplyChatTemplateFlag(entry, catalog.models_, &overridden));
  }
  for (const auto& m : catalog.models_) {
    if (!m->chat_template_error.empty()) {
      std::fprintf(stderr, "kvgrid-coordinator: model '%s': its chat template is not used: %s\n",
                   m->name.c_str(), m->chat_template_error.c_str());
    }
    if (!m->chat_template || !m->tokenizer) continue;
    const std::string& eos = m->chat_template->eos_token();
    if (!eos.empty()) m->end_of_turn_token_id = m->tokenizer->TokenToId(eos);
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

absl::StatusOr<const ServedModel*> ModelCatalog::FindWithTokenizer(const std::string& name) const {
  absl::StatusOr<const ServedModel*> m = Find(name);
  if (!m.ok()) return m.status();
  if (!(*m)->tokenizer) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", (*m)->name, "' has no tokenizer (tokenizer.json or GGUF)"));
  }
  return m;
}

absl::StatusOr<std::vector<int32_t>> EncodeText(const ServedModel& m, std::string_view text,
                                                bool add_bos, bool add_special_tokens) {
  std::vector<int32_t> ids = m.tokenizer->Encode(text, add_special_tokens);
  if (add_bos) {
    if (!m.bos_token_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("add_bos: model '", m.name, "' defines no BOS token"));
    }
    if (!add_special_tokens || ids.empty() || ids.front() != *m.bos_token_id) {
      ids.insert(ids.begin(), *m.bos_token_id);
    }
  }
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
