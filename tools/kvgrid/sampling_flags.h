// The sampling, stopping and length flags `kvgrid run` and `kvgrid generate` share: read once
// here so both accept the same flags with the same checks.
#ifndef KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_
#define KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/kvgrid/args.h"

namespace kvgrid::cli {

// Absent flags stay unset: the caller's defaults (generation_config.json) apply.
struct SamplingFlags {
  std::optional<double> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k, seed, max_new_tokens, min_tokens;
  bool ignore_eos = false;
  std::optional<std::vector<int32_t>> stop_token_ids;
  std::optional<std::string> stop;
  bool include_stop_str_in_output = false;
};

// Reads --temperature --top-p --top-k --min-p --repetition-penalty --seed --max-new-tokens
// --min-tokens --ignore-eos --stop-token-ids --stop --include-stop-str-in-output.
// Errors: INVALID_ARGUMENT naming a flag whose value does not parse.
absl::StatusOr<SamplingFlags> ReadSamplingFlags(Args& args);

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_SAMPLING_FLAGS_H_
