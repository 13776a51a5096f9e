#include "model/generation_config.h"

#include <cmath>
#include <limits>
#include <string>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/json_util.h"
#include "model/model_dir.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model {
namespace {

using Json = nlohmann::json;


constexpr std::uintmax_t kMaxGenerationConfigBytes = 16ull << 20;


absl::Status FieldError(std::string_view source, std::string_view key, std::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": ", Sv(key), ": ", Sv(problem)));
}

absl::StatusOr<int64_t> ToInt(std::string_view source, std::string_view key, const Json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(source, key, absl::StrCat(v, " is out of range"));
    }
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.0e18) {
      return static_cast<int64_t>(d);
    }
  }
  return FieldError(source, key, absl::StrCat("expected an integer, got ", DescribeJson(value)));
}

// Reads the optional fields of the top-level object. Hugging Face writes null for "unset",
// so null is treated like an absent key.
class Reader {
 public:
  Reader(const Json& root, std::string_view source) : root_(root), source_(source) {}

  const Json* Find(std::string_view key) const {
    auto it = root_.find(key);
    if (it == root_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status Int(std::string_view key, int64_t min, std::optional<int64_t>* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    absl::StatusOr<int64_t> v = ToInt(source_, key, *value);
    if (!v.ok()) return v.status();
    if (*v < min) return FieldError(source_, key, absl::StrCat(*v, " must be at least ", min));
    *out = *v;
    return absl::OkStatus();
  }

  // Accepts [lo, hi]; `lo_open` makes the lower bound exclusive.
  absl::Status Number(std::string_view key, double lo, bool lo_open, double hi,
                      std::optional<double>* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    if (!value->is_number()) {
      return FieldError(source_, key, absl::StrCat("expected a number, got ", DescribeJson(*value)));
    }
    const double v = value->get<double>();
    const bool above_lo = lo_open ? v > lo : v >= lo;
    if (!above_lo || !(v <= hi)) {
      return FieldError(source_, key,
                        absl::StrCat(v, " is outside ", lo_open ? "(" : "[", lo, ", ", hi, "]"));
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status Bool(std::string_view key, std::optional<bool>* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    if (!value->is_boolean()) {
      return FieldError(source_, key,
                        absl::StrCat("expected true or false, got ", DescribeJson(*value)));
    }
    *out = value->get<bool>();
    return absl::OkStatus();
  }

  absl::Status TokenIds(std::string_view key, std::vector<int64_t>* out) const {
    const Json* value = Find(key);
    if (value == nullptr) return absl::OkStatus();
    std::vector<int64_t> ids;
    if (value->is_array()) {
      for (const Json& item : *value) {
        absl::StatusOr<int64_t> id = ToInt(source_, key, item);
        if (!id.ok()) return id.status();
        ids.push_back(*id);
      }
    } else {
      absl::StatusOr<int64_t> id = ToInt(source_, key, *value);
      if (!id.ok()) return id.status();
      ids.push_back(*id);
    }
    for (int64_t id : ids) {
      if (id < 0) return FieldError(source_, key, absl::StrCat("token id ", id, " is negative"));
    }
    *out = std::move(ids);
    return absl::OkStatus();
  }

 private:
  const Json& root_;
  std::string_view source_;
};

}  // namespace

absl::StatusOr<GenerationConfig> ParseGenerationConfig(std::string_view json_text,
                                                       std::string_view source,
                                                       int64_t vocab_size) {
  absl::StatusOr<Json> parsed = ParseJsonObject(json_text, source);
  if (!parsed.ok()) return parsed.status();
  const Json& root = *parsed;
  const Reader r(root, source);
  GenerationConfig config;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // Ranges follow what transformers' logits processors accept; anything else is a broken file
  // rather than a preference to honour.
  for (absl::Status s : {
           r.TokenIds("eos_token_id", &config.eos_token_ids),
           r.Int("bos_token_id", 0, &config.bos_token_id),
           r.Bool("do_sample", &config.do_sample),
           r.Number("temperature", 0.0, /*lo_open=*/false, kInf, &config.temperature),
           r.Number("top_p", 0.0, /*lo_open=*/false, 1.0, &config.top_p),
           r.Int("top_k", 0, &config.top_k),
           r.Number("min_p", 0.0, /*lo_open=*/false, 1.0, &config.min_p),
           r.Number("repetition_penalty", 0.0, /*lo_open=*/true, kInf, &config.repetition_penalty),
           r.Int("max_new_tokens", 1, &config.max_new_tokens),
       }) {
    if (!s.ok()) return s;
  }
  if (vocab_size > 0) {
    std::optional<int64_t> pad;
    KVGRID_RETURN_IF_ERROR(r.Int("pad_token_id", std::numeric_limits<int64_t>::min(), &pad));
    const auto outside = [&](std::string_view key, int64_t id) {
      return FieldError(source, key, absl::StrCat("token id ", id,
                                                  " is outside the vocabulary (vocab_size ",
                                                  vocab_size, ")"));
    };
    for (int64_t id : config.eos_token_ids) {
      if (id >= vocab_size) return outside("eos_token_id", id);
    }
    if (config.bos_token_id && *config.bos_token_id >= vocab_size) {
      return outside("bos_token_id", *config.bos_token_id);
    }
    // Negative means "none" in some files; only an id past the vocabulary is wrong.
    if (pad && *pad >= vocab_size) return outside("pad_token_id", *pad);
  }
  return config;
}

absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::filesystem::path& dir,
                                                      int64_t vocab_size) {
  std::error_code ec;
  // Callers may also hand over the file itself.
  const std::filesystem::path file =
      std::filesystem::is_regular_file(dir, ec) ? dir : dir / "generation_config.json";
  if (file != dir) KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(dir, file));
  if (!std::filesystem::exists(file, ec)) return GenerationConfig{};
  absl::StatusOr<std::string> text = ReadSmallFile(file, kMaxGenerationConfigBytes);
  if (!text.ok()) return text.status();
  return ParseGenerationConfig(*text, file.string(), vocab_size);
}

}  // namespace kvgrid::model
