// What `run` and `logits` share: resolving the model directory (the embedded default when
// --model is absent), loading its parts, and turning KV/engine flags into EngineOptions.
#ifndef KVGRID_TOOLS_KVGRID_MODEL_SETUP_H_
#define KVGRID_TOOLS_KVGRID_MODEL_SETUP_H_

#include <filesystem>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "kernels/cpu/quant_linear.h"
#include "kernels/kv_dtype.h"
#include "model/generation_config.h"
#include "model/model_config.h"
#include "model/tokenizer.h"
#include "tools/kvgrid/args.h"
#include "worker/engine/engine.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::cli {

// --model, else $KVGRID_MODEL, else the model shipped in the source tree.
std::filesystem::path ResolveModelDir(Args& args);

struct LoadedModel {
  std::filesystem::path dir;
  std::unique_ptr<worker::LlamaModel> model;
  // tokenizer.json, else the one a .gguf file embeds; null when there is neither
  // (model::LoadModelTokenizer).
  std::unique_ptr<model::Tokenizer> tokenizer;
  model::GenerationConfig generation;
};

// Where the weights come from (--load-format, as vLLM names it).
enum class LoadFormat {
  kAuto,   // the checkpoint: safetensors in a directory, or a .gguf file
  kDummy,  // random weights (LlamaModel::RandomWeights, fixed seed) in the shape config.json
           // gives: benchmarks of a model's shape without its checkpoint
  kDummyOnDevice,  // as kDummy, but the model holds no weights (LlamaModel::WithoutWeights):
                   // the device executor makes them on the card
};

// --load-format auto (default) | dummy; `on_device`: dummy's weights are made by the device
// executor. Errors: INVALID_ARGUMENT naming the flag.
absl::StatusOr<LoadFormat> LoadFormatFromArgs(Args& args, bool on_device);

// The seed of dummy weights: every rank of a group and every run get the same model.
inline constexpr uint64_t kDummyWeightSeed = 0x6b7667726964;

// Errors name the file and field (config.json, model.safetensors, tokenizer.json, ...).
// `tp`: this rank's shard of the weights (default: the whole model). `weight_dtype`: Q8_0 or
// Q4_0 quantizes the layers' linear weights at load (round to nearest). When stderr is a
// terminal, the weights' loading progress is shown there (worker::TerminalLoadProgress).
// `format` kDummy/kDummyOnDevice read config.json, the tokenizer and generation_config.json
// only (a directory without weights will do): INVALID_ARGUMENT for a .gguf file, which has
// no config.json; kDummyOnDevice with a weight_dtype other than fp32 is INVALID_ARGUMENT.
absl::StatusOr<LoadedModel> LoadModelDir(
    const std::filesystem::path& dir, worker::TensorParallel tp = {},
    kernels::cpu::WeightDType weight_dtype = kernels::cpu::WeightDType::kF32,
    LoadFormat format = LoadFormat::kAuto);

// --weight-dtype fp32 (default) | q8_0 | q4_0. Errors: INVALID_ARGUMENT naming the flag.
absl::StatusOr<kernels::cpu::WeightDType> WeightDTypeFromArgs(Args& args);

// Reads --kv-cache-memory (bytes, with KiB/MiB/GiB or KB/MB/GB suffixes), --block-size,
// --max-num-seqs, --max-num-batched-tokens, --max-model-len, --swap-space (bytes),
// --preemption-mode (auto, swap, recompute), --watermark (share of the pool kept free when
// admitting, in [0, 1)) and --enable-prefix-caching (true/false). The KV dtypes stay at their
// defaults: they come from KvDTypesFromArgs, which may need the model's config.
absl::StatusOr<worker::EngineOptions> EngineOptionsFromArgs(Args& args);

// The KV cache dtypes the flags ask for. nullopt is "auto": the model's torch_dtype
// (bfloat16 -> bf16, float16 -> fp16, anything else -> fp32), known once the model is loaded.
struct KvDTypeFlags {
  std::optional<kernels::KvDType> k = kernels::KvDType::kF32;
  std::optional<kernels::KvDType> v = kernels::KvDType::kF32;

  // Sets options->k_dtype and v_dtype, resolving "auto" against `config`.
  void ApplyTo(const model::ModelConfig& config, worker::EngineOptions* options) const;
};

// Reads --kv-cache-dtype (K and V), then --k-cache-dtype / --v-cache-dtype overrides; each
// takes fp32, fp16, bf16, int8, int4, fp8_e4m3 (or an alias ParseKvDType accepts) or auto.
// Default fp32.
// Errors: INVALID_ARGUMENT naming the flag.
absl::StatusOr<KvDTypeFlags> KvDTypesFromArgs(Args& args);

// "512MiB" -> 536870912. Errors: INVALID_ARGUMENT naming `flag`.
absl::StatusOr<int64_t> ParseBytes(std::string_view text, std::string_view flag);

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_MODEL_SETUP_H_
