#include "model/json_util.h"

#include <fstream>
#include <sstream>
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

absl::StatusOr<nlohmann::json> ParseJsonObject(std::string_view text, std::string_view source) {
  if (absl::Status s = CheckJsonDepth(text, source); !s.ok()) return s;
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    // e.what() carries "parse error at line L, column C: ...", which is what a user needs.
    return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": malformed JSON: ", e.what()));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Sv(source), ": expected a JSON object at the top level, got ", root.type_name()));
  }
  return root;
}

absl::StatusOr<std::string> ReadSmallFile(const std::filesystem::path& path,
                                          std::uintmax_t limit) {
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return absl::ErrnoToStatus(ec.value(), absl::StrCat("cannot read ", path.string()));
  if (size > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": ", size, " bytes is larger than the limit of ", limit));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) {
    return absl::PermissionDeniedError(absl::StrCat(path.string(), ": cannot be opened"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
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
