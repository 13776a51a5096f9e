#include "model/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/json_util.h"
#include "model/model_dir.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model {
namespace {

using Json = nlohmann::json;


// config.json is a few KB; the cap only stops a wrong path (a checkpoint, /dev/zero) from
// being slurped into memory.
constexpr std::uintmax_t kMaxConfigBytes = 16ull << 20;


// Reads typed fields of one JSON object and phrases every failure as
// "<source>: <field>: <problem>". A JSON null counts as absent, because Hugging Face writes
// null for "use the default" (head_dim, rope_scaling, sliding_window, eos_token_id, ...).
class FieldReader {
 public:
  FieldReader(const Json& object, std::string_view source, std::string prefix = "")
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  std::string FieldName(std::string_view key) const { return absl::StrCat(prefix_, Sv(key)); }

  absl::Status Error(std::string_view key, std::string_view problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat(Sv(source_), ": ", FieldName(key), ": ", Sv(problem)));
  }

  // nullptr when the key is absent or null.
  const Json* Find(std::string_view key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  bool Has(std::string_view key) const { return Find(key) != nullptr; }

  absl::StatusOr<std::optional<int64_t>> Int(std::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    return ToInt(key, *value);
  }

  absl::StatusOr<int64_t> ToInt(std::string_view key, const Json& value) const {
    if (value.is_number_unsigned()) {
      const uint64_t v = value.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Error(key, absl::StrCat(v, " is out of range"));
      }
      return static_cast<int64_t>(v);
    }
    if (value.is_number_integer()) return value.get<int64_t>();
    // Some exporters write integers as 4096.0; accept them when they are exact.
    if (value.is_number_float()) {
      const double d = value.get<double>();
      if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.0e18) {
        return static_cast<int64_t>(d);
      }
    }
    return Error(key, absl::StrCat("expected an integer, got ", DescribeJson(value)));
  }

  absl::StatusOr<std::optional<double>> Number(std::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_number()) {
      return Error(key, absl::StrCat("expected a number, got ", DescribeJson(*value)));
    }
    return value->get<double>();
  }

  absl::StatusOr<std::optional<bool>> Bool(std::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_boolean()) {
      return Error(key, absl::StrCat("expected true or false, got ", DescribeJson(*value)));
    }
    return value->get<bool>();
  }

  absl::StatusOr<std::optional<std::string>> String(std::string_view key) const {
    const Json* value = Find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_string()) {
      return Error(key, absl::StrCat("expected a string, got ", DescribeJson(*value)));
    }
    return value->get<std::string>();
  }

  // A required integer > 0.
  absl::StatusOr<int64_t> PositiveInt(std::string_view key) const {
    absl::StatusOr<std::optional<int64_t>> value = Int(key);
    if (!value.ok()) return value.status();
    if (!value->has_value()) return Error(key, "missing");
    if (**value <= 0) return Error(key, absl::StrCat(**value, " must be positive"));
    return **value;
  }

  // An optional number that must be finite and > 0 when present.
  absl::StatusOr<double> PositiveNumber(std::string_view key, double fallback) const {
    absl::StatusOr<std::optional<double>> value = Number(key);
    if (!value.ok()) return value.status();
    if (!value->has_value()) return fallback;
    if (!(**value > 0.0) || !std::isfinite(**value)) {
      return Error(key, absl::StrCat(**value, " must be positive"));
    }
    return **value;
  }

  // An int or a list of ints (eos_token_id); absent or null gives an empty list.
  absl::StatusOr<std::vector<int64_t>> TokenIds(std::string_view key) const {
    std::vector<int64_t> ids;
    const Json* value = Find(key);
    if (value == nullptr) return ids;
    if (value->is_array()) {
      for (const Json& item : *value) {
        absl::StatusOr<int64_t> id = ToInt(key, item);
        if (!id.ok()) return id.status();
        ids.push_back(*id);
      }
    } else {
      absl::StatusOr<int64_t> id = ToInt(key, *value);
      if (!id.ok()) return id.status();
      ids.push_back(*id);
    }
    for (int64_t id : ids) {
      if (id < 0) return Error(key, absl::StrCat("token id ", id, " is negative"));
    }
    return ids;
  }

 private:
  const Json& object_;
  std::string_view source_;
  std::string prefix_;
};

// Defaults for keys a config.json may leave out, as Hugging Face's config classes fill them.
struct ModelTypeDefaults {
  int64_t max_position_embeddings;
};

std::optional<ModelTypeDefaults> DefaultsFor(std::string_view model_type) {
  if (model_type == "llama") return ModelTypeDefaults{2048};
  if (model_type == "qwen2") return ModelTypeDefaults{32768};
  if (model_type == "qwen3") return ModelTypeDefaults{32768};
  if (model_type == "mistral") return ModelTypeDefaults{4096 * 32};
  return std::nullopt;
}

// Older exports sometimes omit model_type; the architecture class name says the same thing.
std::optional<std::string> ModelTypeFromArchitecture(std::string_view architecture) {
  if (architecture == "LlamaForCausalLM") return "llama";
  if (architecture == "Qwen2ForCausalLM") return "qwen2";
  if (architecture == "Qwen3ForCausalLM") return "qwen3";
  if (architecture == "MistralForCausalLM") return "mistral";
  return std::nullopt;
}

// Parses one rope scaling description: the legacy `rope_scaling` object or the newer
// `rope_parameters` object (which adds rope_theta, read by the caller). `rope_type` wins over
// the legacy `type` key, as in transformers. `max_position_embeddings` (config.json's) is the
// original context of yarn and dynamic scaling when the object names none.
absl::Status ParseRopeScaling(const FieldReader& reader, bool type_required,
                              int64_t max_position_embeddings, RopeScaling* out) {
  std::optional<std::string> type;
  std::string type_key = "rope_type";
  KVGRID_ASSIGN_OR_RETURN(type, reader.String("rope_type"));
  if (!type.has_value()) {
    type_key = "type";
    KVGRID_ASSIGN_OR_RETURN(type, reader.String("type"));
  }
  if (!type.has_value()) {
    if (type_required)
      return reader.Error("rope_type", "missing (neither rope_type nor type is set)");
    type = "default";
  }

  *out = RopeScaling{};
  if (*type == "default" || *type == "none") {
    out->type = RopeScalingType::kNone;
    return absl::OkStatus();
  }
  if (*type == "linear") {
    out->type = RopeScalingType::kLinear;
    if (!reader.Has("factor"))
      return reader.Error("factor", "missing (required by linear scaling)");
    KVGRID_ASSIGN_OR_RETURN(out->factor, reader.PositiveNumber("factor", 1.0));
    return absl::OkStatus();
  }
  if (*type == "llama3") {
    out->type = RopeScalingType::kLlama3;
    for (const char* key :
         {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
      if (!reader.Has(key)) return reader.Error(key, "missing (required by llama3 scaling)");
    }
    KVGRID_ASSIGN_OR_RETURN(out->factor, reader.PositiveNumber("factor", 1.0));
    KVGRID_ASSIGN_OR_RETURN(out->low_freq_factor, reader.PositiveNumber("low_freq_factor", 1.0));
    KVGRID_ASSIGN_OR_RETURN(out->high_freq_factor, reader.PositiveNumber("high_freq_factor", 4.0));
    KVGRID_ASSIGN_OR_RETURN(out->original_max_position_embeddings,
                     reader.PositiveInt("original_max_position_embeddings"));
    // The llama3 formula interpolates between the two wavelengths over
    // (high_freq_factor - low_freq_factor); equal factors would divide by zero.
    if (!(out->high_freq_factor > out->low_freq_factor)) {
      return reader.Error("high_freq_factor", absl::StrCat(out->high_freq_factor,
                                                           " must be greater than low_freq_factor ",
                                                           out->low_freq_factor));
    }
    return absl::OkStatus();
  }
  if (*type == "dynamic" || *type == "yarn") {
    const bool yarn = *type == "yarn";
    out->type = yarn ? RopeScalingType::kYarn : RopeScalingType::kDynamic;
    if (!reader.Has("factor")) {
      return reader.Error("factor", absl::StrCat("missing (required by ", *type, " scaling)"));
    }
    KVGRID_ASSIGN_OR_RETURN(out->factor, reader.PositiveNumber("factor", 1.0));
    out->original_max_position_embeddings = max_position_embeddings;
    if (reader.Has("original_max_position_embeddings")) {
      KVGRID_ASSIGN_OR_RETURN(out->original_max_position_embeddings,
                              reader.PositiveInt("original_max_position_embeddings"));
    }
    if (!yarn) return absl::OkStatus();
    // transformers treats a null or 0 beta as "use the default".
    KVGRID_ASSIGN_OR_RETURN(std::optional<double> beta, reader.Number("beta_fast"));
    if (beta.has_value() && *beta != 0) {
      KVGRID_ASSIGN_OR_RETURN(out->beta_fast, reader.PositiveNumber("beta_fast", 32.0));
    }
    KVGRID_ASSIGN_OR_RETURN(beta, reader.Number("beta_slow"));
    if (beta.has_value() && *beta != 0) {
      KVGRID_ASSIGN_OR_RETURN(out->beta_slow, reader.PositiveNumber("beta_slow", 1.0));
    }
    KVGRID_ASSIGN_OR_RETURN(out->attention_factor, reader.PositiveNumber("attention_factor", 0.0));
    KVGRID_ASSIGN_OR_RETURN(out->mscale, reader.PositiveNumber("mscale", 0.0));
    KVGRID_ASSIGN_OR_RETURN(out->mscale_all_dim, reader.PositiveNumber("mscale_all_dim", 0.0));
    KVGRID_ASSIGN_OR_RETURN(std::optional<bool> truncate, reader.Bool("truncate"));
    out->truncate = truncate.value_or(true);
    // The ramp runs from the beta_fast dimension up to the beta_slow one.
    if (!(out->beta_fast > out->beta_slow)) {
      return reader.Error("beta_fast", absl::StrCat(out->beta_fast,
                                                    " must be greater than beta_slow ",
                                                    out->beta_slow));
    }
    return absl::OkStatus();
  }
  return reader.Error(type_key,
                      absl::StrCat("unsupported RoPE scaling type \"", *type,
                                   "\" (supported: default, linear, dynamic, yarn, llama3)"));
}


// `quantization_config` as transformers writes it for AWQ (AutoAWQ's keys w_bit/q_group_size
// are accepted too) and GPTQ checkpoints.
absl::Status ParseQuantization(const FieldReader& r, QuantizationConfig* out) {
  std::optional<std::string> method;
  KVGRID_ASSIGN_OR_RETURN(method, r.String("quant_method"));
  if (method == "awq") {
    out->method = QuantMethod::kAwq;
  } else if (method == "gptq") {
    out->method = QuantMethod::kGptq;
  } else {
    return r.Error("quant_method",
                   absl::StrCat(method.has_value() ? absl::StrCat("\"", *method, "\"") : "missing",
                                " (supported: awq, gptq)"));
  }
  std::optional<int64_t> value;
  // Messages name the transformers key unless the file uses AutoAWQ's.
  const std::string bits_key = r.Has("w_bit") && !r.Has("bits") ? "w_bit" : "bits";
  KVGRID_ASSIGN_OR_RETURN(value, r.Int(bits_key));
  if (value != 4) {
    return r.Error(bits_key, value.has_value() ? absl::StrCat(*value, ": only 4-bit is supported")
                                               : "missing");
  }
  out->bits = 4;
  const std::string group_key =
      r.Has("q_group_size") && !r.Has("group_size") ? "q_group_size" : "group_size";
  KVGRID_ASSIGN_OR_RETURN(value, r.Int(group_key));
  if (!value.has_value()) return r.Error(group_key, "missing");
  const bool per_row = *value == -1 && out->method == QuantMethod::kGptq;
  if (!per_row && (*value <= 0 || *value % 32 != 0)) {
    return r.Error(group_key, absl::StrCat(*value, ": kvgrid needs a positive multiple of 32",
                                           out->method == QuantMethod::kGptq ? " or -1" : ""));
  }
  out->group_size = *value;
  std::optional<bool> flag;
  std::optional<std::string> text;
  if (out->method == QuantMethod::kAwq) {
    KVGRID_ASSIGN_OR_RETURN(text, r.String("version"));
    if (text.has_value() && *text != "gemm" && *text != "GEMM") {
      return r.Error("version", absl::StrCat("\"", *text, "\" (supported: gemm)"));
    }
    KVGRID_ASSIGN_OR_RETURN(flag, r.Bool("zero_point"));
    if (flag == false) return r.Error("zero_point", "false is not supported");
    return absl::OkStatus();
  }
  KVGRID_ASSIGN_OR_RETURN(flag, r.Bool("desc_act"));
  out->desc_act = flag.value_or(false);
  KVGRID_ASSIGN_OR_RETURN(text, r.String("checkpoint_format"));
  if (text.has_value() && *text != "gptq" && *text != "gptq_v2") {
    return r.Error("checkpoint_format", absl::StrCat("\"", *text, "\" (supported: gptq, gptq_v2)"));
  }
  out->zeros_minus_one = text.value_or("gptq") == "gptq";
  return absl::OkStatus();
}

// Which layers use the sliding window, as transformers decides: Qwen2-family configs carry a
// sliding_window that use_sliding_window (default false there) switches on for layers
// >= max_window_layers (default 28), newer ones a layer_types list that wins; Mistral's (and
// any other config's) sliding_window applies to every layer.
absl::Status ParseSlidingLayers(const FieldReader& r, int64_t window, ModelConfig* config) {
  const int64_t layers = config->num_hidden_layers;
  const bool qwen = config->model_type.starts_with("qwen");
  std::optional<bool> use;
  KVGRID_ASSIGN_OR_RETURN(use, r.Bool("use_sliding_window"));
  config->sliding_window = 0;
  config->sliding_layers.clear();
  if (window <= 0 || !use.value_or(!qwen)) return absl::OkStatus();
  std::vector<bool> sliding(layers, true);
  if (const Json* types = r.Find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers) {
      return r.Error("layer_types", absl::StrCat("expected a list of ", layers,
                                                 " strings, got ", DescribeJson(*types)));
    }
    for (int64_t i = 0; i < layers; ++i) {
      const Json& t = (*types)[i];
      if (t == "sliding_attention") continue;
      if (t != "full_attention") {
        return r.Error(absl::StrCat("layer_types[", i, "]"),
                       absl::StrCat("expected \"sliding_attention\" or \"full_attention\", got ",
                                    DescribeJson(t)));
      }
      sliding[i] = false;
    }
  } else if (qwen || r.Has("max_window_layers")) {
    std::optional<int64_t> first;
    KVGRID_ASSIGN_OR_RETURN(first, r.Int("max_window_layers"));
    for (int64_t i = 0; i < std::min<int64_t>(first.value_or(28), layers); ++i) sliding[i] = false;
  }
  if (std::find(sliding.begin(), sliding.end(), true) == sliding.end()) return absl::OkStatus();
  config->sliding_window = window;
  config->sliding_layers = std::move(sliding);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source) {
  absl::StatusOr<Json> parsed = ParseJsonObject(json_text, source);
  if (!parsed.ok()) return parsed.status();
  const Json& root = *parsed;
  const FieldReader r(root, source);
  ModelConfig config;

  if (const Json* archs = r.Find("architectures")) {
    if (!archs->is_array()) {
      return r.Error("architectures",
                     absl::StrCat("expected a list of strings, got ", DescribeJson(*archs)));
    }
    for (const Json& arch : *archs) {
      if (!arch.is_string()) {
        return r.Error("architectures",
                       absl::StrCat("expected a list of strings, got an element ", DescribeJson(arch)));
      }
      config.architectures.push_back(arch.get<std::string>());
    }
  }

  std::optional<std::string> model_type;
  KVGRID_ASSIGN_OR_RETURN(model_type, r.String("model_type"));
  if (!model_type.has_value()) {
    for (const std::string& arch : config.architectures) {
      model_type = ModelTypeFromArchitecture(arch);
      if (model_type.has_value()) break;
    }
    if (!model_type.has_value()) {
      return r.Error("model_type", "missing, and architectures names no supported model");
    }
  }
  const std::optional<ModelTypeDefaults> defaults = DefaultsFor(*model_type);
  if (!defaults.has_value()) {
    return r.Error("model_type", absl::StrCat("unsupported model type \"", *model_type,
                                              "\" (supported: llama, qwen2, qwen3, mistral)"));
  }
  config.model_type = *model_type;

  KVGRID_ASSIGN_OR_RETURN(config.vocab_size, r.PositiveInt("vocab_size"));
  KVGRID_ASSIGN_OR_RETURN(config.hidden_size, r.PositiveInt("hidden_size"));
  KVGRID_ASSIGN_OR_RETURN(config.intermediate_size, r.PositiveInt("intermediate_size"));
  KVGRID_ASSIGN_OR_RETURN(config.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  KVGRID_ASSIGN_OR_RETURN(config.num_attention_heads, r.PositiveInt("num_attention_heads"));

  if (r.Has("num_key_value_heads")) {
    KVGRID_ASSIGN_OR_RETURN(config.num_key_value_heads, r.PositiveInt("num_key_value_heads"));
  } else {
    config.num_key_value_heads = config.num_attention_heads;
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return r.Error("num_key_value_heads",
                   absl::StrCat(config.num_key_value_heads, " does not divide num_attention_heads ",
                                config.num_attention_heads));
  }

  // head_dim is independent of hidden_size when given (Mistral-Nemo, Qwen3-style configs);
  // otherwise it is derived, which needs an exact division.
  if (r.Has("head_dim")) {
    KVGRID_ASSIGN_OR_RETURN(config.head_dim, r.PositiveInt("head_dim"));
  } else if (config.model_type == "qwen3") {
    config.head_dim = 128;  // Qwen3Config's default, whatever hidden_size is
  } else {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return r.Error("hidden_size",
                     absl::StrCat(config.hidden_size, " is not divisible by num_attention_heads ",
                                  config.num_attention_heads, " and head_dim is not given"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  // RoPE rotates channel pairs.
  if (config.head_dim % 2 != 0) {
    return r.Error("head_dim", absl::StrCat(config.head_dim, " must be even for RoPE"));
  }

  if (r.Has("max_position_embeddings")) {
    KVGRID_ASSIGN_OR_RETURN(config.max_position_embeddings, r.PositiveInt("max_position_embeddings"));
  } else {
    config.max_position_embeddings = defaults->max_position_embeddings;
  }
  KVGRID_ASSIGN_OR_RETURN(config.rms_norm_eps, r.PositiveNumber("rms_norm_eps", 1e-6));
  // The kernels compute in fp32; a smaller eps would become 0 there.
  if (config.rms_norm_eps < std::numeric_limits<float>::min()) {
    return r.Error("rms_norm_eps", absl::StrCat(config.rms_norm_eps, " is below the smallest "
                                                                     "normal float"));
  }
  // Upper bounds keep every size product far from int64 overflow and refuse what no real
  // model has (Llama-3-405B: hidden 16384, intermediate 53248, 126 layers, 128 heads).
  struct Limit {
    const char* key;
    int64_t value;
    int64_t max;
  };
  const Limit limits[] = {
      {"vocab_size", config.vocab_size, int64_t{1} << 24},
      {"hidden_size", config.hidden_size, int64_t{1} << 17},
      {"intermediate_size", config.intermediate_size, int64_t{1} << 19},
      {"num_hidden_layers", config.num_hidden_layers, 1024},
      {"num_attention_heads", config.num_attention_heads, 1024},
      {"head_dim", config.head_dim, 1024},
      {"max_position_embeddings", config.max_position_embeddings, int64_t{1} << 24},
  };
  for (const Limit& l : limits) {
    if (l.value > l.max) {
      return r.Error(l.key, absl::StrCat(l.value, " exceeds the supported maximum of ", l.max));
    }
  }

  // transformers >= 5 folds rope_theta and the scaling into `rope_parameters`; it wins over
  // the legacy keys because a file that has it was written by the newer format.
  if (const Json* params = r.Find("rope_parameters")) {
    if (!params->is_object()) {
      return r.Error("rope_parameters",
                     absl::StrCat("expected an object, got ", DescribeJson(*params)));
    }
    const FieldReader pr(*params, source, "rope_parameters.");
    KVGRID_ASSIGN_OR_RETURN(const double legacy_theta, r.PositiveNumber("rope_theta", 10000.0));
    KVGRID_ASSIGN_OR_RETURN(config.rope_theta, pr.PositiveNumber("rope_theta", legacy_theta));
    if (absl::Status s = ParseRopeScaling(pr, /*type_required=*/false,
                                          config.max_position_embeddings, &config.rope_scaling);
        !s.ok()) {
      return s;
    }
  } else {
    KVGRID_ASSIGN_OR_RETURN(config.rope_theta, r.PositiveNumber("rope_theta", 10000.0));
    if (const Json* scaling = r.Find("rope_scaling")) {
      if (!scaling->is_object()) {
        return r.Error("rope_scaling",
                       absl::StrCat("expected an object or null, got ", DescribeJson(*scaling)));
      }
      const FieldReader sr(*scaling, source, "rope_scaling.");
      if (absl::Status s = ParseRopeScaling(sr, /*type_required=*/true,
                                            config.max_position_embeddings, &config.rope_scaling);
          !s.ok()) {
        return s;
      }
    }
  }
  config.max_position_embeddings =
      ScaledContextLength(config.rope_scaling, config.max_position_embeddings);

  // The forward pass implements SwiGLU only.
  std::optional<std::string> hidden_act;
  KVGRID_ASSIGN_OR_RETURN(hidden_act, r.String("hidden_act"));
  if (hidden_act.has_value() && *hidden_act != "silu") {
    return r.Error("hidden_act",
                   absl::StrCat("unsupported activation \"", *hidden_act, "\" (supported: silu)"));
  }

  std::optional<bool> flag;
  KVGRID_ASSIGN_OR_RETURN(flag, r.Bool("tie_word_embeddings"));
  config.tie_word_embeddings = flag.value_or(false);
  KVGRID_ASSIGN_OR_RETURN(flag, r.Bool("attention_bias"));
  config.attention_bias = flag.value_or(false);
  // Qwen2's q/k/v projections always carry a bias; its config.json has no key for it.
  if (config.model_type == "qwen2") config.attention_bias = true;
  // Qwen3 always normalizes q and k per head; its config.json has no key for it either.
  config.qk_norm = config.model_type == "qwen3";
  KVGRID_ASSIGN_OR_RETURN(flag, r.Bool("mlp_bias"));
  config.mlp_bias = flag.value_or(false);

  KVGRID_ASSIGN_OR_RETURN(config.eos_token_ids, r.TokenIds("eos_token_id"));
  std::optional<int64_t> bos;
  KVGRID_ASSIGN_OR_RETURN(bos, r.Int("bos_token_id"));
  if (bos.has_value() && *bos < 0) {
    return r.Error("bos_token_id", absl::StrCat("token id ", *bos, " is negative"));
  }
  config.bos_token_id = bos.value_or(-1);
  // Ids the embedding has no row for would index past it (or never match a sampled token).
  for (int64_t id : config.eos_token_ids) {
    if (id >= config.vocab_size) {
      return r.Error("eos_token_id", absl::StrCat("token id ", id, " is outside the vocabulary (",
                                                  "vocab_size ", config.vocab_size, ")"));
    }
  }
  if (config.bos_token_id >= config.vocab_size) {
    return r.Error("bos_token_id", absl::StrCat("token id ", config.bos_token_id,
                                                " is outside the vocabulary (vocab_size ",
                                                config.vocab_size, ")"));
  }
  // pad_token_id is not used, but a broken one says the file does not belong to these weights.
  // Old conversions write -1 for "none"; that stays accepted.
  std::optional<int64_t> pad;
  KVGRID_ASSIGN_OR_RETURN(pad, r.Int("pad_token_id"));
  if (pad.has_value() && *pad >= config.vocab_size) {
    return r.Error("pad_token_id", absl::StrCat("token id ", *pad,
                                                " is outside the vocabulary (vocab_size ",
                                                config.vocab_size, ")"));
  }

  // transformers >= 4.56 writes `dtype`; older files say `torch_dtype`.
  std::optional<std::string> dtype;
  KVGRID_ASSIGN_OR_RETURN(dtype, r.String("torch_dtype"));
  if (!dtype.has_value()) {
    KVGRID_ASSIGN_OR_RETURN(dtype, r.String("dtype"));
  }
  config.torch_dtype = dtype.value_or("");

  std::optional<int64_t> window;
  KVGRID_ASSIGN_OR_RETURN(window, r.Int("sliding_window"));
  if (window.has_value() && *window < 0) {
    return r.Error("sliding_window", absl::StrCat(*window, " is negative"));
  }
  KVGRID_RETURN_IF_ERROR(ParseSlidingLayers(r, window.value_or(0), &config));

  if (const Json* q = r.Find("quantization_config")) {
    if (!q->is_object()) {
      return r.Error("quantization_config",
                     absl::StrCat("expected an object, got ", DescribeJson(*q)));
    }
    KVGRID_RETURN_IF_ERROR(
        ParseQuantization(FieldReader(*q, source, "quantization_config."), &config.quantization));
  }
  return config;
}

int64_t ScaledContextLength(const RopeScaling& s, int64_t max_position_embeddings) {
  double extended = static_cast<double>(max_position_embeddings);
  switch (s.type) {
    case RopeScalingType::kLinear:
      extended *= s.factor;
      break;
    case RopeScalingType::kDynamic:
    case RopeScalingType::kYarn:
      extended = static_cast<double>(s.original_max_position_embeddings) * s.factor;
      break;
    case RopeScalingType::kNone:
    case RopeScalingType::kLlama3:
      break;
  }
  constexpr double kMax = static_cast<double>(int64_t{1} << 24);
  return std::max(max_position_embeddings, static_cast<int64_t>(std::min(extended, kMax)));
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(path, ec)) {
    file = path / "config.json";
    KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(path, file));
  }
  if (!std::filesystem::exists(file, ec)) {
    return absl::NotFoundError(absl::StrCat(file.string(), ": no such file"));
  }
  absl::StatusOr<std::string> text = ReadSmallFile(file, kMaxConfigBytes);
  if (!text.ok()) return text.status();
  return ParseModelConfig(*text, file.string());
}

std::string ServedModelName(const std::filesystem::path& path) {
  // "models/kjv-tiny/" normalizes to an empty last component, and "." to one: the absolute
  // path names them.
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) p = path;
  p = p.lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  // The Hugging Face cache keeps a repo's files in models--ORG--NAME/snapshots/REVISION: the
  // repo's name, not the revision hash, is what a client asks for.
  const std::string parent = p.parent_path().filename().string();
  const std::string repo = p.parent_path().parent_path().filename().string();
  if (parent == "snapshots" && repo.starts_with("models--")) {
    const size_t sep = repo.rfind("--");
    if (sep + 2 < repo.size()) return repo.substr(sep + 2);
  }
  return p.filename().string();
}

}  // namespace kvgrid::model
