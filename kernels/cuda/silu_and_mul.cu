#include "kernels/cuda/silu_and_mul.cuh"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// A grid-stride loop over output elements; consecutive threads take consecutive columns of a
// row, so the gate and up reads are both coalesced.
__global__ void SiluAndMulKernel(const float* __restrict__ gate_up, float* __restrict__ output,
                                 int64_t intermediate, int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t t = idx / intermediate;
    const int64_t i = idx - t * intermediate;
    const float g = gate_up[t * 2 * intermediate + i];
    const float u = gate_up[t * 2 * intermediate + intermediate + i];
    output[idx] = g / (1.f + expf(-g)) * u;
  }
}

}  // namespace

absl::Status SiluAndMulParams::Validate() const {
  if (gate_up == nullptr) return absl::InvalidArgumentError("SiluAndMulParams.gate_up is null");
  if (output == nullptr) return absl::InvalidArgumentError("SiluAndMulParams.output is null");
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SiluAndMulParams.num_tokens must be >= 0: ", num_tokens));
  }
  if (intermediate <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SiluAndMulParams.intermediate must be > 0: ", intermediate));
  }
  return absl::OkStatus();
}

absl::Status LaunchSiluAndMul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const int64_t total = p.num_tokens * p.intermediate;
  if (total == 0) return absl::OkStatus();
  SiluAndMulKernel<<<GridStrideBlocks(total, kThreads), kThreads, 0, stream>>>(
      p.gate_up, p.output, p.intermediate, total);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
