// A guard run before parsing untrusted JSON: nesting deeper than a real file ever has is
// refused, because printing or walking such values recursively could exhaust the stack.
#ifndef KVGRID_MODEL_JSON_LIMITS_H_
#define KVGRID_MODEL_JSON_LIMITS_H_

#include <string_view>

#include "absl/status/status.h"

namespace kvgrid::model {

inline constexpr int kMaxJsonDepth = 64;

// INVALID_ARGUMENT "<source>: JSON nested deeper than <max_depth> levels (at byte N)" when
// arrays/objects nest deeper than `max_depth`. Brackets inside strings do not count. Does not
// otherwise validate the text (the parser does that).
absl::Status CheckJsonDepth(std::string_view text, std::string_view source,
                            int max_depth = kMaxJsonDepth);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_JSON_LIMITS_H_
