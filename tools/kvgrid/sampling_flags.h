// The sampling, stopping and length flags `kvgrid run` and `kvgrid generate` share: read once
// here so both accept the same flags with the same checks.
#ifndef KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_
#define KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/kvgrid/args.h"

namespace kvgrid::cli {

// Absent flags stay unset: the caller's defaults (generation_config.json) apply.
struct SamplingFlags {
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<double> presence_penalty, frequency_penalty;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias), as given
  std::optional<int64_t> top_k, seed, max_new_tokens, min_tokens;
  bool ignore_eos = false;
  std::optional<std::vector<int32_t>> stop_token_ids;
  std::optional<std::string> stop;
  bool include_stop_str_in_output = false;
};

// Reads --temperature --top-p --top-k --min-p --repetition-penalty --presence-penalty
// --frequency-penalty --logit-bias --seed --max-new-tokens --min-tokens --ignore-eos
// --stop-token-ids --stop --include-stop-str-in-output. Ranges are the server's (or the
// engine's) to check.
// Errors: INVALID_ARGUMENT naming a flag whose value does not parse.
absl::StatusOr<SamplingFlags> ReadSamplingFlags(Args& args);

// Parses --logit-bias's "ID:BIAS,ID:BIAS,..." (e.g. "13:-100,42:5.5"). Errors:
// INVALID_ARGUMENT naming --logit-bias and the entry that does not parse, or an id given twice.
absl::StatusOr<std::vector<std::pair<int32_t, float>>> ParseLogitBias(const std::string& text);

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_
