#include "model/special_tokens.h"

#include <algorithm>

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

}  // namespace kvgrid::model
