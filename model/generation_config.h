// Default sampling parameters and stop ids from Hugging Face's generation_config.json.
#ifndef KVGRID_MODEL_GENERATION_CONFIG_H_
#define KVGRID_MODEL_GENERATION_CONFIG_H_

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::model {

// Every field is optional: absent keys leave the server defaults in place.
struct GenerationConfig {
  std::vector<int64_t> eos_token_ids;  // int or list in the file
  std::optional<int64_t> bos_token_id;
  std::optional<bool> do_sample;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<int64_t> max_new_tokens;
};

// With `vocab_size` > 0, eos_token_id, bos_token_id and pad_token_id must lie below it.
// Errors: INVALID_ARGUMENT naming `source` and the field.
absl::StatusOr<GenerationConfig> ParseGenerationConfig(std::string_view json_text,
                                                       std::string_view source,
                                                       int64_t vocab_size = 0);

// Reads `dir`/generation_config.json (which must not link outside `dir`, see model_dir.h),
// checking its ids against `vocab_size` as ParseGenerationConfig. A missing file gives an
// empty GenerationConfig.
absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::filesystem::path& dir,
                                                      int64_t vocab_size = 0);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_GENERATION_CONFIG_H_
