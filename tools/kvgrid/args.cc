#include "tools/kvgrid/args.h"

#include <cctype>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvgrid::cli {

absl::StatusOr<Args> Args::Parse(int argc, char** argv, int first) {
  Args args;
  for (int i = first; i < argc; ++i) {
    std::string token = argv[i];
    if (token.size() < 3 || token.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", token, "' (flags look like --name value)"));
    }
    std::string name = token.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      value = argv[++i];
    }
    if (args.values_.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " given twice"));
    }
    args.values_[name] = value;
  }
  return args;
}

std::optional<std::optional<std::string>> Args::Find(const std::string& name) const {
  if (auto it = values_.find(name); it != values_.end()) return it->second;
  if (env_prefix_.empty()) return std::nullopt;
  std::string var = env_prefix_;
  for (char c : name) var += c == '-' ? '_' : static_cast<char>(std::toupper(c));
  if (const char* v = std::getenv(var.c_str())) return std::optional<std::string>(v);
  return std::nullopt;
}

bool Args::Has(const std::string& name) {
  read_.insert(name);
  return Find(name).has_value();
}

absl::StatusOr<bool> Args::GetBool(const std::string& name, bool fallback) {
  read_.insert(name);
  const auto found = Find(name);
  if (!found) return fallback;
  if (!*found) return true;
  const std::string& v = **found;
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": expected true or false, got '", v, "'"));
}

std::optional<std::string> Args::GetString(const std::string& name) {
  read_.insert(name);
  const auto found = Find(name);
  if (!found) return std::nullopt;
  return found->value_or("");
}

absl::StatusOr<std::optional<int64_t>> Args::GetInt(const std::string& name) {
  auto s = GetString(name);
  if (!s) return std::optional<int64_t>();
  int64_t v;
  if (!absl::SimpleAtoi(*s, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected an integer, got '", *s, "'"));
  }
  return std::optional<int64_t>(v);
}

absl::StatusOr<std::optional<double>> Args::GetDouble(const std::string& name) {
  auto s = GetString(name);
  if (!s) return std::optional<double>();
  double v;
  if (!absl::SimpleAtod(*s, &v) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": expected a finite number, got '", *s, "'"));
  }
  return std::optional<double>(v);
}

absl::StatusOr<std::optional<std::vector<int32_t>>> Args::GetIntList(const std::string& name) {
  auto s = GetString(name);
  if (!s) return std::optional<std::vector<int32_t>>();
  std::vector<int32_t> out;
  for (absl::string_view part : absl::StrSplit(*s, ',', absl::SkipWhitespace())) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", part, "' is not an integer"));
    }
    out.push_back(v);
  }
  return std::optional<std::vector<int32_t>>(std::move(out));
}

absl::Status Args::Finish() const {
  std::vector<std::string> unknown;
  for (const auto& [name, value] : values_) {
    if (!read_.count(name)) unknown.push_back("--" + name);
  }
  if (unknown.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown flag(s): ", absl::StrJoin(unknown, ", ")));
}

int RunSubcommand(Args& args, const char* name, const char* help,
                  absl::Status (*body)(Args& args)) {
  if (args.Has("help")) {
    std::fputs(help, stdout);
    return 0;
  }
  const absl::Status status = body(args);
  if (status.ok()) return 0;
  std::fprintf(stderr, "kvgrid %s: %s\n", name, std::string(status.message()).c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace kvgrid::cli
