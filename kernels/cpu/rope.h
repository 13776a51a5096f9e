// Rotary position embedding in Hugging Face's half-split ("rotate_half") convention:
// for i < d/2, (x[i], x[i + d/2]) is rotated by angle position * inv_freq[i].
#ifndef KVGRID_KERNELS_CPU_ROPE_H_
#define KVGRID_KERNELS_CPU_ROPE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/model_config.h"

namespace kvgrid::kernels::cpu {

// inv_freq[i] = theta^(-2i/d), rescaled for rope_scaling "linear" (/ factor) or "llama3"
// (wavelength-dependent: long wavelengths / factor, short kept, a smooth blend between).
// Errors: INVALID_ARGUMENT for an odd or non-positive head_dim or bad scaling parameters.
absl::StatusOr<std::vector<double>> RopeInvFreq(const model::ModelConfig& config);

struct RopeParams {
  float* query = nullptr;             // [num_tokens, num_heads, head_dim], rotated in place
  float* key = nullptr;               // [num_tokens, num_kv_heads, head_dim], rotated in place
  const int32_t* positions = nullptr; // [num_tokens]
  const double* inv_freq = nullptr;   // [head_dim / 2]
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
