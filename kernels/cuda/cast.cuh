// fp32 -> fp16 / bf16 on the GPU, round to nearest even: bit-identical to model::F32ToF16 and
// model::F32ToBF16 for every input, NaN and infinities included (kernels/cuda/numeric.cuh).
// Used to feed fp32 activations to 16-bit GEMMs (kernels/cuda/gemm.cuh).
#ifndef KVGRID_KERNELS_CUDA_CAST_CUH_
#define KVGRID_KERNELS_CUDA_CAST_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cuda {

struct CastParams {
  const float* input = nullptr;  // [num_elements], device
  void* output = nullptr;        // [num_elements] of `dtype`, device, 2-byte aligned; must not
                                 // overlap input
  model::DType dtype = model::DType::kBF16;  // kF16 or kBF16
  int64_t num_elements = 0;                  // >= 0; 0 launches nothing

  // INVALID_ARGUMENT naming the field for null or misaligned pointers, a negative size or a
  // dtype other than fp16/bf16.
  absl::Status Validate() const;
};

// Enqueues the conversion on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchCast(const CastParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_CAST_CUH_
