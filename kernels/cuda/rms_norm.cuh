// RMSNorm on the GPU: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, fp32 accumulate.
// Checked against kernels/cpu/rms_norm.h (tests labelled `gpu`).
#ifndef KVGRID_KERNELS_CUDA_RMS_NORM_CUH_
#define KVGRID_KERNELS_CUDA_RMS_NORM_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

struct RmsNormParams {
  const float* input = nullptr;   // [num_tokens, hidden], device
  const float* weight = nullptr;  // [hidden], device
  float* output = nullptr;        // [num_tokens, hidden], device; may alias input
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;

  // INVALID_ARGUMENT naming the field for null pointers, non-positive sizes or eps <= 0.
  absl::Status Validate() const;
};

// Enqueues the kernel on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_RMS_NORM_CUH_
