// The BOS and EOS ids a model generates with, resolved from the places checkpoints keep them
// (tokenizer.json, generation_config.json, config.json), shared by the CLI, the worker and
// the coordinator so all three agree.
#ifndef KVGRID_MODEL_SPECIAL_TOKENS_H_
#define KVGRID_MODEL_SPECIAL_TOKENS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/generation_config.h"
#include "model/model_config.h"
#include "model/tokenizer.h"

namespace kvgrid::model {

// The tokenizer's BOS, else generation_config's, else config.json's; nullopt when none is
// defined. `tokenizer` may be null.
std::optional<int32_t> ResolveBosTokenId(const Tokenizer* tokenizer,
                                         const GenerationConfig& generation,
                                         const ModelConfig& config);

// generation_config's EOS ids followed by config.json's, those outside the vocabulary dropped
// (they can never be sampled), duplicates removed.
std::vector<int32_t> ResolveEosTokenIds(const GenerationConfig& generation,
                                        const ModelConfig& config);

// Every id `tokenizer` can produce must have a row in the embedding: its ids may stop short of
// `vocab_size` (Hugging Face checkpoints pad the embedding), never go past it.
// Errors: INVALID_ARGUMENT naming `model` (the model's path), both sizes and the largest id.
absl::Status CheckTokenizerFitsVocabulary(const Tokenizer& tokenizer, int64_t vocab_size,
                                          const std::string& model);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_SPECIAL_TOKENS_H_
