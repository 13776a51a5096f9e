#include "kernels/cuda/fill_random.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// SplitMix64's finalizer: a well-mixed 64-bit hash of the element index and the seed.
__device__ inline uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) { return v; }
template <>
__device__ inline __half FromFloat<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void FillRandomKernel(T* out, int64_t n, float amplitude, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // The top 24 bits as a float in [0, 1), then onto [-amplitude, amplitude).
    const float u = static_cast<float>(Mix(seed * 0x100000001B3ull + i) >> 40) * (1.f / 16777216.f);
    out[i] = FromFloat<T>((2.f * u - 1.f) * amplitude);
  }
}

}  // namespace

absl::Status FillRandomParams::Validate() const {
  if (output == nullptr) return absl::InvalidArgumentError("FillRandomParams.output is null");
  if (num_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillRandomParams.num_elements is negative: ", num_elements));
  }
  const size_t align = dtype == model::DType::kF32 ? 4 : 2;
  if (dtype != model::DType::kF32 && dtype != model::DType::kF16 &&
      dtype != model::DType::kBF16) {
    return absl::InvalidArgumentError("FillRandomParams.dtype must be fp32, fp16 or bf16");
  }
  if (reinterpret_cast<uintptr_t>(output) % align != 0) {
    return absl::InvalidArgumentError("FillRandomParams.output is misaligned for its dtype");
  }
  if (!(amplitude > 0.f)) return absl::InvalidArgumentError("FillRandomParams.amplitude must be > 0");
  return absl::OkStatus();
}

absl::Status LaunchFillRandom(const FillRandomParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_elements == 0) return absl::OkStatus();
  const int64_t wanted = (p.num_elements + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 65536 ? wanted : 65536);  // grid-stride
  switch (p.dtype) {
    case model::DType::kF32:
      FillRandomKernel<float><<<blocks, kThreads, 0, stream>>>(static_cast<float*>(p.output),
                                                               p.num_elements, p.amplitude,
                                                               p.seed);
      break;
    case model::DType::kF16:
      FillRandomKernel<__half><<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(p.output),
                                                                p.num_elements, p.amplitude,
                                                                p.seed);
      break;
    default:
      FillRandomKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
          static_cast<__nv_bfloat16*>(p.output), p.num_elements, p.amplitude, p.seed);
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
