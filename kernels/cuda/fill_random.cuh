// Deterministic pseudo-random fill on the GPU, for benchmark weights that would take minutes to
// make on the host and copy over (16 GB for a Llama-3-8B shape): element i is uniform in
// [-amplitude, amplitude], a hash of (seed, i), rounded to the buffer's type. Not for tests that
// compare against the CPU (they upload host weights).
#ifndef KVGRID_KERNELS_CUDA_FILL_RANDOM_CUH_
#define KVGRID_KERNELS_CUDA_FILL_RANDOM_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cuda {

struct FillRandomParams {
  void* output = nullptr;                  // [num_elements] of dtype, device, element-aligned
  model::DType dtype = model::DType::kBF16;  // kF32, kF16 or kBF16
  int64_t num_elements = 0;                // >= 0; 0 launches nothing
  float amplitude = 1.f;                   // > 0
  uint64_t seed = 0;

  // INVALID_ARGUMENT naming the field for a null or misaligned output, a negative size, an
  // unsupported dtype or a non-positive amplitude.
  absl::Status Validate() const;
};

// Enqueues the fill on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchFillRandom(const FillRandomParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_FILL_RANDOM_CUH_
