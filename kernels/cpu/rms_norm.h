// RMSNorm: output[t] = input[t] / sqrt(mean(input[t]^2) + eps) * weight.
#ifndef KVGRID_KERNELS_CPU_RMS_NORM_H_
#define KVGRID_KERNELS_CPU_RMS_NORM_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cpu {

struct RmsNormParams {
  const float* input = nullptr;   // [num_tokens, hidden]
  const float* weight = nullptr;  // [hidden]
  float* output = nullptr;        // [num_tokens, hidden]; may alias input
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;

  // INVALID_ARGUMENT naming the field for null pointers, negative sizes or eps <= 0.
  absl::Status Validate() const;
};

// Sums in double so the reference does not drift with hidden size. Parallel over tokens.
absl::Status RmsNorm(const RmsNormParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_RMS_NORM_H_
