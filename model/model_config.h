// The architecture of a Llama-family checkpoint, read from Hugging Face's config.json.
//
// Supports Llama 2/3/3.1+ (rope_scaling type "llama3"), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head
// RMSNorm of q and k, no q/k/v bias, head_dim independent of hidden_size) and Mistral.
// Both the classic `rope_theta` / `rope_scaling` keys and the newer `rope_parameters`
// object are accepted. RoPE scaling types: default, linear, dynamic, yarn, llama3; others
// (longrope, su, mrope, ...) are refused naming the field.
//
// "dynamic" (dynamic NTK) follows vLLM, not transformers: the base is scaled once, for a
// context of original_max_position_embeddings * factor, so every position of a sequence uses
// the same frequencies and cached keys stay valid. transformers recomputes the base from each
// forward's sequence length (plain RoPE up to the original length), which a KV cache cannot
// follow; logits of the two agree only where that length reaches original * factor.
//
// Context window: max_position_embeddings is config.json's, extended as vLLM extends it for
// the scalings that stretch the trained window: linear and dynamic by `factor`, yarn to
// original_max_position_embeddings * factor (when larger). Plain value type;
// thread-compatible.
#ifndef KVGRID_MODEL_MODEL_CONFIG_H_
#define KVGRID_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::model {

enum class RopeScalingType : uint8_t {
  kNone,     // plain RoPE
  kLinear,   // positions divided by `factor`
  kLlama3,   // Llama 3.1 frequency-dependent scaling
  kDynamic,  // NTK-aware base scaling, fixed for original * factor positions (see above)
  kYarn,     // YaRN: per-frequency blend of interpolation and extrapolation, cos/sin scaled
};

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;                   // llama3
  double high_freq_factor = 4.0;                  // llama3
  // llama3, yarn, dynamic: the context the model was pretrained for. yarn and dynamic default
  // it to config.json's max_position_embeddings (before the window is extended).
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;                        // yarn: rotations where extrapolation ends
  double beta_slow = 1.0;                         // yarn: rotations where interpolation starts
  // yarn: the factor cos and sin are multiplied by (transformers' attention_factor). 0 when
  // the file gives none: then 0.1 * mscale * ln(factor) + 1 over the same with mscale_all_dim
  // (both given), else 0.1 * ln(factor) + 1.
  double attention_factor = 0.0;
  double mscale = 0.0;                            // yarn (DeepSeek-style); 0 when absent
  double mscale_all_dim = 0.0;                    // yarn; 0 when absent
  bool truncate = true;                           // yarn: round the ramp's ends to integers
  // GGUF `rope_freqs.weight` (llama.cpp's Llama 3.1 files): one divisor per frequency, the
  // final inv_freq[i] = theta^(-2i/d) / freq_divisors[i]; empty when absent. Used instead of
  // `type`'s own formula for the frequencies.
  std::vector<double> freq_divisors;
};

// A pre-quantized checkpoint's `quantization_config`: 4-bit AWQ (GEMM layout) or GPTQ.
enum class QuantMethod : uint8_t { kNone, kAwq, kGptq };

struct QuantizationConfig {
  QuantMethod method = QuantMethod::kNone;
  int64_t bits = 0;                // 4
  int64_t group_size = 0;          // input channels per scale/zero; -1: one group per row
  bool desc_act = false;           // GPTQ act-order: g_idx assigns each input channel's group
  bool zeros_minus_one = false;    // GPTQ's original format stores each zero point minus one

  [[nodiscard]] bool quantized() const { return method != QuantMethod::kNone; }
};

struct ModelConfig {
  std::string model_type;        // "llama", "qwen2", "qwen3", "mistral"
  std::vector<std::string> architectures;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;   // defaults to num_attention_heads
  int64_t head_dim = 0;              // defaults to hidden_size / num_attention_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;       // q/k/v projections carry a bias (Qwen2: always)
  // Qwen3: q and k are RMS-normalized per head (weights [head_dim], eps rms_norm_eps) after
  // the projection and before RoPE.
  bool qk_norm = false;
  bool mlp_bias = false;
  std::vector<int64_t> eos_token_ids;  // from config.json; may be empty
  int64_t bos_token_id = -1;           // -1 when absent
  std::string torch_dtype;             // "bfloat16", "float16", "float32" or empty
  // Sliding-window attention (Mistral; Qwen2 with use_sliding_window): a sliding layer's query
  // at position i attends to keys i - sliding_window < j <= i, as in transformers. 0: none.
  int64_t sliding_window = 0;
  // Which layers slide, one entry per layer; empty when no layer does. Mistral (and GGUF's
  // <arch>.attention.sliding_window): every layer; Qwen2: layers >= max_window_layers, or
  // those `layer_types` marks "sliding_attention".
  std::vector<bool> sliding_layers;
  QuantizationConfig quantization;     // from `quantization_config`; method kNone when absent

  // The attention window of `layer` in tokens; 0 = full attention.
  [[nodiscard]] int64_t LayerWindow(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(sliding_layers.size()) &&
                   sliding_layers[layer]
               ? sliding_window
               : 0;
  }
  // The window that bounds a sequence's KV: sliding_window when every layer slides (blocks
  // before the window can then be freed, since one block id indexes every layer), else 0.
  [[nodiscard]] int64_t KvWindow() const {
    if (sliding_window <= 0 || sliding_layers.empty()) return 0;
    for (bool slides : sliding_layers) {
      if (!slides) return 0;
    }
    return sliding_window;
  }
};

// Parses config.json text. `source` names the file in error messages.
// Errors: INVALID_ARGUMENT naming the source and the offending field (missing, wrong type,
// out of range, inconsistent head counts, unsupported model_type, rope_scaling type or
// quantization: methods other than awq/gptq, bits other than 4, group sizes that are not a
// multiple of 32, AWQ layouts other than GEMM).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view source);

// The context window of a model whose config gives `max_position_embeddings` and scaling `s`
// (see the file comment): linear and dynamic multiply it by s.factor, yarn makes it
// s.original_max_position_embeddings * s.factor when that is larger; capped at 2^24.
int64_t ScaledContextLength(const RopeScaling& s, int64_t max_position_embeddings);

// Reads `path` (a config.json, or a directory holding one).
// Errors: NOT_FOUND when the file is missing; otherwise as ParseModelConfig.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::filesystem::path& path);

// The name a model directory or file is served under, the same for the coordinator and its
// workers: the last component of `path`, trailing slashes and "." ignored
// ("models/kjv-tiny/" -> "kjv-tiny"); a Hugging Face cache snapshot is named by its repo
// (".../models--Qwen--Qwen3-0.6B/snapshots/REV" -> "Qwen3-0.6B"). Empty only for a path
// without a named component ("/").
std::string ServedModelName(const std::filesystem::path& path);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_MODEL_CONFIG_H_
