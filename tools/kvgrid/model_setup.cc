#include "tools/kvgrid/model_setup.h"

#include <cerrno>  // program_invocation_short_name
#include <cstdlib>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "model/gguf_tokenizer.h"
#include "model/special_tokens.h"
#include "model/status_macros.h"

namespace kvgrid::cli {

std::filesystem::path ResolveModelDir(Args& args) {
  if (auto m = args.GetString("model")) return *m;
  if (const char* env = std::getenv("KVGRID_MODEL"); env && *env) return env;
  return std::filesystem::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";
}

absl::StatusOr<kernels::cpu::WeightDType> WeightDTypeFromArgs(Args& args) {
  const std::optional<std::string> v = args.GetString("weight-dtype");
  if (!v) return kernels::cpu::WeightDType::kF32;
  absl::StatusOr<kernels::cpu::WeightDType> d = kernels::cpu::ParseWeightDType(*v);
  if (!d.ok()) return absl::InvalidArgumentError(absl::StrCat("--", d.status().message()));
  return d;
}

absl::StatusOr<LoadFormat> LoadFormatFromArgs(Args& args, bool on_device) {
  const std::string v = args.GetString("load-format").value_or("auto");
  if (v == "auto") return LoadFormat::kAuto;
  if (v == "dummy") return on_device ? LoadFormat::kDummyOnDevice : LoadFormat::kDummy;
  return absl::InvalidArgumentError(
      absl::StrCat("--load-format: must be auto or dummy, got '", v, "'"));
}

namespace {

// A model of config.json's shape with random weights (LoadFormat::kDummy*).
absl::StatusOr<std::unique_ptr<worker::LlamaModel>> DummyModel(
    const std::filesystem::path& dir, worker::TensorParallel tp,
    kernels::cpu::WeightDType weight_dtype, LoadFormat format) {
  if (!std::filesystem::is_directory(dir)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--load-format dummy: ", dir.string(),
        " is not a directory; dummy weights take their shape from a directory's config.json"));
  }
  KVGRID_ASSIGN_OR_RETURN(const model::ModelConfig config,
                          model::LoadModelConfig(dir / "config.json"));
  if (format == LoadFormat::kDummyOnDevice) {
    if (weight_dtype != kernels::cpu::WeightDType::kF32) {
      return absl::InvalidArgumentError(
          "--weight-dtype: the device makes dummy weights in the dense --dtype; a block "
          "format needs a checkpoint");
    }
    return worker::LlamaModel::WithoutWeights(config, tp);
  }
  worker::LlamaWeights weights = worker::LlamaModel::RandomWeights(config, kDummyWeightSeed);
  if (tp.size > 1) {
    KVGRID_ASSIGN_OR_RETURN(weights, worker::LlamaModel::ShardWeights(config, weights, tp));
  }
  return worker::LlamaModel::FromWeights(config, std::move(weights), tp);
}

}  // namespace

absl::StatusOr<LoadedModel> LoadModelDir(const std::filesystem::path& dir,
                                         worker::TensorParallel tp,
                                         kernels::cpu::WeightDType weight_dtype,
                                         LoadFormat format) {
  // A .gguf file (its tokenizer embedded, or from a tokenizer.json beside it; an optional
  // generation_config.json beside it), or a Hugging Face directory.
  const bool gguf = std::filesystem::is_regular_file(dir) && dir.extension() == ".gguf";
  if (!std::filesystem::exists(dir)) {
    return absl::NotFoundError(absl::StrCat("model ", dir.string(), " does not exist"));
  }
  if (!gguf && !std::filesystem::is_directory(dir)) {
    return absl::InvalidArgumentError(absl::StrCat("model ", dir.string(),
                                                   " is neither a directory nor a .gguf file"));
  }
  const std::filesystem::path home = gguf ? dir.parent_path() : dir;
  LoadedModel out;
  out.dir = home;
  // On a terminal, a line that counts layers, tensors and bytes as they are read.
  const worker::LoadProgressFn progress = worker::TerminalLoadProgress(program_invocation_short_name);
  if (format != LoadFormat::kAuto) {
    KVGRID_ASSIGN_OR_RETURN(out.model, DummyModel(dir, tp, weight_dtype, format));
  } else if (gguf) {
    KVGRID_ASSIGN_OR_RETURN(out.model, worker::LlamaModel::LoadGguf(dir, tp, progress));
  } else {
    KVGRID_ASSIGN_OR_RETURN(out.model, worker::LlamaModel::Load(dir, tp, progress));
  }
  KVGRID_RETURN_IF_ERROR(out.model->QuantizeWeights(weight_dtype));
  KVGRID_ASSIGN_OR_RETURN(out.tokenizer, model::LoadModelTokenizer(dir));
  if (out.tokenizer) {
    KVGRID_RETURN_IF_ERROR(model::CheckTokenizerFitsVocabulary(
        *out.tokenizer, out.model->config().vocab_size, dir.string()));
  }
  KVGRID_ASSIGN_OR_RETURN(out.generation,
                          model::LoadGenerationConfig(home, out.model->config().vocab_size));
  return out;
}

absl::StatusOr<int64_t> ParseBytes(std::string_view text, std::string_view flag) {
  std::string s = absl::AsciiStrToLower(std::string(text));
  struct Unit {
    const char* suffix;
    int64_t scale;
  };
  static constexpr Unit kUnits[] = {{"kib", 1ll << 10}, {"mib", 1ll << 20}, {"gib", 1ll << 30},
                                    {"tib", 1ll << 40}, {"kb", 1000},       {"mb", 1000000},
                                    {"gb", 1000000000}, {"tb", 1000000000000}, {"b", 1}};
  int64_t scale = 1;
  for (const Unit& u : kUnits) {
    const std::string suffix = u.suffix;
    if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
      scale = u.scale;
      s.resize(s.size() - suffix.size());
      break;
    }
  }
  double value;
  if (!absl::SimpleAtod(s, &value) || !(value > 0) || value * scale > 9e18) {
    return absl::InvalidArgumentError(absl::StrCat("--", std::string(flag),
                                                   ": expected a positive size such as 512MiB, got '",
                                                   std::string(text), "'"));
  }
  return static_cast<int64_t>(value * static_cast<double>(scale));
}

namespace {

// nullopt for "auto".
absl::StatusOr<std::optional<kernels::KvDType>> ParseKvDTypeFlag(const std::string& text,
                                                                 std::string_view flag) {
  if (text == "auto") return std::nullopt;
  absl::StatusOr<kernels::KvDType> dtype = kernels::ParseKvDType(text);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", std::string(flag), ": ", std::string(dtype.status().message()), ", or auto"));
  }
  return *dtype;
}

}  // namespace

absl::StatusOr<KvDTypeFlags> KvDTypesFromArgs(Args& args) {
  KvDTypeFlags flags;
  if (auto d = args.GetString("kv-cache-dtype")) {
    KVGRID_ASSIGN_OR_RETURN(flags.k, ParseKvDTypeFlag(*d, "kv-cache-dtype"));
    flags.v = flags.k;
  }
  if (auto d = args.GetString("k-cache-dtype")) {
    KVGRID_ASSIGN_OR_RETURN(flags.k, ParseKvDTypeFlag(*d, "k-cache-dtype"));
  }
  if (auto d = args.GetString("v-cache-dtype")) {
    KVGRID_ASSIGN_OR_RETURN(flags.v, ParseKvDTypeFlag(*d, "v-cache-dtype"));
  }
  return flags;
}

void KvDTypeFlags::ApplyTo(const model::ModelConfig& config,
                           worker::EngineOptions* options) const {
  kernels::KvDType model_dtype = kernels::KvDType::kF32;
  if (config.torch_dtype == "bfloat16") model_dtype = kernels::KvDType::kBF16;
  if (config.torch_dtype == "float16") model_dtype = kernels::KvDType::kF16;
  options->k_dtype = k.value_or(model_dtype);
  options->v_dtype = v.value_or(model_dtype);
}

absl::StatusOr<worker::EngineOptions> EngineOptionsFromArgs(Args& args) {
  worker::EngineOptions o;
  if (auto m = args.GetString("kv-cache-memory")) {
    KVGRID_ASSIGN_OR_RETURN(o.kv_cache_memory, ParseBytes(*m, "kv-cache-memory"));
  }
  KVGRID_ASSIGN_OR_RETURN(auto block_size, args.GetInt("block-size"));
  if (block_size) {
    if (*block_size != 8 && *block_size != 16 && *block_size != 32) {
      return absl::InvalidArgumentError(
          absl::StrCat("--block-size: must be 8, 16 or 32, got ", *block_size));
    }
    o.block_size = *block_size;
  }
  KVGRID_ASSIGN_OR_RETURN(auto max_num_seqs, args.GetInt("max-num-seqs"));
  if (max_num_seqs) o.max_num_seqs = *max_num_seqs;
  KVGRID_ASSIGN_OR_RETURN(auto max_batched, args.GetInt("max-num-batched-tokens"));
  if (max_batched) o.max_num_batched_tokens = *max_batched;
  if (auto m = args.GetString("swap-space")) {
    KVGRID_ASSIGN_OR_RETURN(o.swap_space, ParseBytes(*m, "swap-space"));
  }
  if (auto m = args.GetString("preemption-mode")) {
    KVGRID_ASSIGN_OR_RETURN(o.preemption_mode, worker::ParsePreemptionMode(*m));
  }
  // The range is the engine's to check (Engine::ValidateOptions).
  KVGRID_ASSIGN_OR_RETURN(auto watermark, args.GetDouble("watermark"));
  if (watermark) o.watermark = *watermark;
  KVGRID_ASSIGN_OR_RETURN(o.enable_prefix_caching, args.GetBool("enable-prefix-caching", true));
  KVGRID_ASSIGN_OR_RETURN(auto max_model_len, args.GetInt("max-model-len"));
  if (max_model_len) o.max_model_len = *max_model_len;
  return o;
}

}  // namespace kvgrid::cli
