// SiLU-gated MLP activation on the GPU: output = silu(gate) * up with silu(g) = g / (1 + e^-g),
// the same expression as kernels/cpu/activation.h (results differ only by expf's last bits:
// CUDA's expf is within 2 ulp, glibc's within 1).
#ifndef KVGRID_KERNELS_CUDA_SILU_AND_MUL_CUH_
#define KVGRID_KERNELS_CUDA_SILU_AND_MUL_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

struct SiluAndMulParams {
  const float* gate_up = nullptr;  // [num_tokens, 2 * intermediate], device: gate then up per row
  float* output = nullptr;         // [num_tokens, intermediate], device; must not overlap gate_up
  int64_t num_tokens = 0;          // 0 launches nothing
  int64_t intermediate = 0;

  // INVALID_ARGUMENT naming the field for null pointers or sizes out of range.
  absl::Status Validate() const;
};

// Enqueues the kernel on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchSiluAndMul(const SiluAndMulParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_SILU_AND_MUL_CUH_
