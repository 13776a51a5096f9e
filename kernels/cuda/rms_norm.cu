#include "kernels/cuda/rms_norm.cuh"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token; a block-wide reduction of the sum of squares.
__global__ void RmsNormKernel(const float* input, const float* __restrict__ weight,
                              float* output, int64_t hidden, float eps) {
  const int64_t row = blockIdx.x;
  const float* x = input + row * hidden;
  float* y = output + row * hidden;

  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) sum += x[i] * x[i];

  __shared__ float warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < kThreads / 32 ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (lane == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) y[i] = x[i] * scale * weight[i];
}

}  // namespace

absl::Status RmsNormParams::Validate() const {
  if (input == nullptr) return absl::InvalidArgumentError("RmsNormParams.input is null");
  if (weight == nullptr) return absl::InvalidArgumentError("RmsNormParams.weight is null");
  if (output == nullptr) return absl::InvalidArgumentError("RmsNormParams.output is null");
  if (num_tokens <= 0 || num_tokens > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("RmsNormParams.num_tokens out of range: ", num_tokens));
  }
  if (hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("RmsNormParams.hidden must be > 0: ", hidden));
  }
  if (!(eps > 0.f)) return absl::InvalidArgumentError("RmsNormParams.eps must be > 0");
  return absl::OkStatus();
}

absl::Status LaunchRmsNorm(const RmsNormParams& params, cudaStream_t stream) {
  if (absl::Status s = params.Validate(); !s.ok()) return s;
  RmsNormKernel<<<static_cast<unsigned>(params.num_tokens), kThreads, 0, stream>>>(
      params.input, params.weight, params.output, params.hidden, params.eps);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
