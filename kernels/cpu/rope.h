// Rotary position embedding in Hugging Face's half-split ("rotate_half") convention:
// for i < d/2, (x[i], x[i + d/2]) is rotated by angle position * inv_freq[i], and cos and sin
// are multiplied by the scaling's attention factor (YaRN's mscale; 1 otherwise), which scales
// every q.k product by its square, as transformers does.
#ifndef KVGRID_KERNELS_CPU_ROPE_H_
#define KVGRID_KERNELS_CPU_ROPE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/model_config.h"

namespace kvgrid::kernels::cpu {

// inv_freq[i] = theta^(-2i/d) / freq_divisors[i] (GGUF rope_freqs; 1 without), rescaled for
// rope_scaling "linear" (/ factor), "llama3" (wavelength-dependent: long wavelengths / factor,
// short kept, a smooth blend between), "dynamic" (theta raised to
// theta * (factor^2 - factor + 1)^(d / (d - 2)): NTK scaling fixed at original * factor
// positions, as vLLM does) or "yarn" (per dimension, a linear ramp between the dimensions
// where the original context makes beta_fast and beta_slow rotations blends the frequency
// divided by factor, below, with the frequency itself, above; the ramp's ends floored and
// ceiled unless truncate is false).
// Errors: INVALID_ARGUMENT for an odd or non-positive head_dim (> 2 for dynamic), a divisor
// table of another length, or bad scaling parameters.
absl::StatusOr<std::vector<double>> RopeInvFreq(const model::ModelConfig& config);

// What cos and sin are multiplied by: for yarn, attention_factor when given, else
// (0.1 * mscale * ln(factor) + 1) / (0.1 * mscale_all_dim * ln(factor) + 1) when both mscales
// are given, else 0.1 * ln(factor) + 1 (1 for factor <= 1); 1 for every other type.
double RopeAttentionFactor(const model::ModelConfig& config);

struct RopeParams {
  float* query = nullptr;             // [num_tokens, num_heads, head_dim], rotated in place
  float* key = nullptr;               // [num_tokens, num_kv_heads, head_dim], rotated in place
  const int32_t* positions = nullptr; // [num_tokens]
  const double* inv_freq = nullptr;   // [head_dim / 2]
  double scale = 1.0;                 // cos and sin are multiplied by it (RopeAttentionFactor)
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;

  absl::Status Validate() const;
};

// Angles are formed in double, so long positions lose no precision. Parallel over tokens.
absl::Status Rope(const RopeParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_ROPE_H_
