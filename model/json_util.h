// Helpers shared by the JSON readers of model/ (config.json, generation_config.json,
// safetensors headers and indexes, tokenizer.json): a nesting guard run before parsing
// untrusted text, short renderings of values for error messages, and the bridge to Debian's
// abseil, whose absl::string_view is its own type rather than std::string_view.
#ifndef KVGRID_MODEL_JSON_LIMITS_H_
#define KVGRID_MODEL_JSON_LIMITS_H_

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model {

inline constexpr int kMaxJsonDepth = 64;

// INVALID_ARGUMENT "<source>: JSON nested deeper than <max_depth> levels (at byte N)" when
// arrays/objects nest deeper than `max_depth`. Brackets inside strings do not count. Does not
// otherwise validate the text (the parser does that).
absl::Status CheckJsonDepth(std::string_view text, std::string_view source,
                            int max_depth = kMaxJsonDepth);

// CheckJsonDepth, then parse, then require an object at the top level. Errors:
// INVALID_ARGUMENT "<source>: malformed JSON: <parser message with line and column>" or
// "<source>: expected a JSON object at the top level, got <type>".
absl::StatusOr<nlohmann::json> ParseJsonObject(std::string_view text, std::string_view source);

// The whole of a file that should be small (a config, an index). Errors: the errno status of
// stat (NOT_FOUND for a missing file), INVALID_ARGUMENT "<path>: N bytes is larger than the
// limit of L" (a wrong path such as a checkpoint or /dev/zero is not slurped), or
// PERMISSION_DENIED when it cannot be opened.
absl::StatusOr<std::string> ReadSmallFile(const std::filesystem::path& path,
                                          std::uintmax_t limit);

// std::string_view -> absl::string_view (for absl::StrCat and friends).
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// "<type> <value>" for error messages, e.g. `string "abc"`, `number 1.5`; arrays and objects
// longer than a line are cut after 60 characters without printing the rest.
std::string DescribeJson(const nlohmann::json& value);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_JSON_LIMITS_H_
