#include "kernels/cuda/cast.cuh"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/numeric.cuh"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// A grid-stride loop: memory-bound, so one element per thread per step is enough.
template <bool kBF16>
__global__ void CastKernel(const float* __restrict__ input, uint16_t* __restrict__ output,
                           int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    output[i] = kBF16 ? F32ToBF16Bits(input[i]) : F32ToF16Bits(input[i]);
  }
}

}  // namespace

absl::Status CastParams::Validate() const {
  if (input == nullptr) return absl::InvalidArgumentError("CastParams.input is null");
  if (output == nullptr) return absl::InvalidArgumentError("CastParams.output is null");
  if (!IsAligned(input, alignof(float))) {
    return absl::InvalidArgumentError("CastParams.input is not 4-byte aligned");
  }
  if (!IsAligned(output, alignof(uint16_t))) {
    return absl::InvalidArgumentError("CastParams.output is not 2-byte aligned");
  }
  if (dtype != model::DType::kF16 && dtype != model::DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("CastParams.dtype must be f16 or bf16, got ",
                                                   std::string(model::DTypeName(dtype))));
  }
  if (num_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CastParams.num_elements must be >= 0: ", num_elements));
  }
  return absl::OkStatus();
}

absl::Status LaunchCast(const CastParams& params, cudaStream_t stream) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  if (params.num_elements == 0) return absl::OkStatus();
  const unsigned blocks = GridStrideBlocks(params.num_elements, kThreads);
  auto* out = static_cast<uint16_t*>(params.output);
  if (params.dtype == model::DType::kBF16) {
    CastKernel<true><<<blocks, kThreads, 0, stream>>>(params.input, out, params.num_elements);
  } else {
    CastKernel<false><<<blocks, kThreads, 0, stream>>>(params.input, out, params.num_elements);
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
