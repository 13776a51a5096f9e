#include "model/special_tokens.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvgrid::model {

std::optional<int32_t> ResolveBosTokenId(const Tokenizer* tokenizer,
                                         const GenerationConfig& generation,
                                         const ModelConfig& config) {
  if (tokenizer != nullptr) {
    if (std::optional<int32_t> bos = tokenizer->bos_token_id()) return bos;
  }
  if (generation.bos_token_id) return static_cast<int32_t>(*generation.bos_token_id);
  if (config.bos_token_id >= 0) return static_cast<int32_t>(config.bos_token_id);
  return std::nullopt;
}

std::vector<int32_t> ResolveEosTokenIds(const GenerationConfig& generation,
                                        const ModelConfig& config) {
  std::vector<int32_t> ids;
  for (const std::vector<int64_t>* list : {&generation.eos_token_ids, &config.eos_token_ids}) {
    for (int64_t id : *list) {
      if (id < 0 || id >= config.vocab_size) continue;
      const auto id32 = static_cast<int32_t>(id);
      if (std::find(ids.begin(), ids.end(), id32) == ids.end()) ids.push_back(id32);
    }
  }
  return ids;
}

absl::Status CheckTokenizerFitsVocabulary(const Tokenizer& tokenizer, int64_t vocab_size,
                                          const std::string& model) {
  if (tokenizer.vocab_size() <= vocab_size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      model, ": the tokenizer has ids up to ", tokenizer.vocab_size() - 1,
      " but the model's vocab_size is ", vocab_size,
      " (the embedding has no row for the ids past it)"));
}

}  // namespace kvgrid::model
