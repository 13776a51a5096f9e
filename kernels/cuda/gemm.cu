#include "kernels/cuda/gemm.cuh"

#include <library_types.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// output[t, n] = (accumulate ? output[t, n] : 0) + bias[n]; the GEMM then adds into it with
// beta = 1, so bias and accumulation need no cuBLASLt epilogue.
__global__ void BroadcastBiasKernel(const float* __restrict__ bias, float* __restrict__ output,
                                    int64_t out_features, int64_t total, bool accumulate) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const float b = bias[i % out_features];
    output[i] = accumulate ? output[i] + b : b;
  }
}

absl::Status CheckDim(const char* name, int64_t v, bool allow_zero) {
  if ((allow_zero ? v < 0 : v <= 0) || v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GemmParams.", name, " must be in ", allow_zero ? "[0" : "(0", ", INT32_MAX]: ", v));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GemmParams::Validate() const {
  if (input == nullptr && num_tokens > 0) {
    return absl::InvalidArgumentError("GemmParams.input is null");
  }
  if (weight == nullptr) return absl::InvalidArgumentError("GemmParams.weight is null");
  if (output == nullptr) return absl::InvalidArgumentError("GemmParams.output is null");
  if (dtype != model::DType::kF16 && dtype != model::DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("GemmParams.dtype must be f16 or bf16, got ",
                                                   std::string(model::DTypeName(dtype))));
  }
  if (!IsAligned(input, 2)) {
    return absl::InvalidArgumentError("GemmParams.input is not 2-byte aligned");
  }
  if (!IsAligned(weight, 2)) {
    return absl::InvalidArgumentError("GemmParams.weight is not 2-byte aligned");
  }
  if (!IsAligned(bias, 4)) {
    return absl::InvalidArgumentError("GemmParams.bias is not 4-byte aligned");
  }
  if (!IsAligned(output, 4)) {
    return absl::InvalidArgumentError("GemmParams.output is not 4-byte aligned");
  }
  if (absl::Status s = CheckDim("num_tokens", num_tokens, true); !s.ok()) return s;
  if (absl::Status s = CheckDim("in_features", in_features, false); !s.ok()) return s;
  return CheckDim("out_features", out_features, false);
}

absl::Status LaunchGemm(const GemmParams& p, const CublasHandle& handle, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (handle.get() == nullptr) return absl::InvalidArgumentError("LaunchGemm: null cuBLAS handle");
  if (p.num_tokens == 0) return absl::OkStatus();
  const int64_t total = p.num_tokens * p.out_features;
  if (p.bias != nullptr) {
    BroadcastBiasKernel<<<GridStrideBlocks(total, kThreads), kThreads, 0, stream>>>(
        p.bias, p.output, p.out_features, total, p.accumulate);
    KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  const float alpha = 1.f;
  const float beta = (p.accumulate || p.bias != nullptr) ? 1.f : 0.f;
  const cudaDataType_t type = p.dtype == model::DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
  const int n = static_cast<int>(p.out_features);
  const int t = static_cast<int>(p.num_tokens);
  const int k = static_cast<int>(p.in_features);
  cublasHandle_t h = handle.get();
  if (absl::Status s = handle.Bind(stream); !s.ok()) return s;
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  // cuBLAS is column-major. Row-major output [T, N] is column-major [N, T] with ld N, and
  //   output^T[N, T] = weight[N, K] x input^T[K, T],
  // where row-major weight [N, K] is column-major [K, N] (ld K), used transposed, and row-major
  // input [T, K] is column-major [K, T] (ld K), used as is.
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, t, k, &alpha,
                                             p.weight, type, k, p.input, type, k, &beta,
                                             p.output, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
