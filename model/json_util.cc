#include "model/json_util.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvgrid::model {

absl::Status CheckJsonDepth(std::string_view text, std::string_view source, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot close the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(absl::StrCat(std::string(source),
                                                       ": JSON nested deeper than ", max_depth,
                                                       " levels (at byte ", i, ")"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

std::string DescribeJson(const nlohmann::json& value) {
  std::string text;
  if (value.is_array() || value.is_object()) {
    // Render element by element and stop early: a 100 MB header must not be printed whole.
    text = value.is_array() ? "[" : "{";
    for (auto it = value.begin(); it != value.end() && text.size() <= 60; ++it) {
      if (text.size() > 1) text += ",";
      if (value.is_object()) text += nlohmann::json(it.key()).dump() + ":";
      text += it->is_primitive() ? it->dump() : (it->is_array() ? "[...]" : "{...}");
    }
    if (text.size() <= 60) text += value.is_array() ? "]" : "}";
  } else {
    text = value.dump();
  }
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return absl::StrCat(value.type_name(), " ", text);
}

}  // namespace kvgrid::model
