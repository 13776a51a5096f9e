// Dense linear layers on the GPU through cuBLAS: output = input x weight^T (+ bias), with
// fp16 or bf16 input and weight, fp32 output and fp32 accumulation. The fp32 activations are
// cast to the weights' 16-bit type first (kernels/cuda/cast.cuh). Checked against
// kernels/cpu/gemm.h's Linear on the same 16-bit-rounded weights.
#ifndef KVGRID_KERNELS_CUDA_GEMM_CUH_
#define KVGRID_KERNELS_CUDA_GEMM_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/cublas_handle.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cuda {

struct GemmParams {
  const void* input = nullptr;   // [num_tokens, in_features] of dtype, device
  const void* weight = nullptr;  // [out_features, in_features] of dtype, device (the
                                 // checkpoint's row-major layout)
  const float* bias = nullptr;   // [out_features], device, or null
  float* output = nullptr;       // [num_tokens, out_features], device; must not overlap
                                 // input, weight or bias
  model::DType dtype = model::DType::kBF16;  // of input and weight: kF16 or kBF16
  int64_t num_tokens = 0;                    // 0 launches nothing
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool accumulate = false;  // output += instead of output =

  // INVALID_ARGUMENT naming the field for null or misaligned pointers, sizes outside
  // (0, INT32_MAX] (cuBLAS takes int) or a dtype other than fp16/bf16.
  absl::Status Validate() const;
};

// Enqueues the GEMM (and, with a bias, a broadcast of the bias into output ahead of it) on
// `stream`, setting `handle`'s stream, host pointer mode and default math mode. Errors:
// Validate()'s; INVALID_ARGUMENT for a null handle; INTERNAL naming the CUDA or cuBLAS call.
absl::Status LaunchGemm(const GemmParams& params, const CublasHandle& handle,
                        cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_GEMM_CUH_
