#include "kernels/cuda/rope.cuh"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One block per token (grid-stride over tokens). The block first fills a shared table of the
// token's cos and sin (half entries each), then rotates every (head, i) pair of q and k with it,
// so each cos/sin is computed once per token as on the CPU.
__global__ void RopeKernel(float* query, float* key, const int32_t* __restrict__ positions,
                           const double* __restrict__ inv_freq, double scale,
                           int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim) {
  extern __shared__ float cos_sin[];  // [2, half]: cos then sin
  const int64_t half = head_dim / 2;
  const int64_t q_pairs = num_heads * half;
  const int64_t pairs = (num_heads + num_kv_heads) * half;
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const double pos = static_cast<double>(positions[t]);
    for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
      double s, c;
      sincos(pos * inv_freq[i], &s, &c);
      cos_sin[i] = static_cast<float>(c * scale);
      cos_sin[half + i] = static_cast<float>(s * scale);
    }
    __syncthreads();
    for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
      const bool is_q = p < q_pairs;
      const int64_t hp = is_q ? p : p - q_pairs;
      const int64_t h = hp / half;
      const int64_t i = hp % half;
      float* x = is_q ? query + (t * num_heads + h) * head_dim
                      : key + (t * num_kv_heads + h) * head_dim;
      const float a = x[i];
      const float b = x[i + half];
      const float c = cos_sin[i];
      const float s = cos_sin[half + i];
      // Explicitly rounded products and sums: contracting them into FMAs would round once
      // fewer than the CPU reference does.
      x[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      x[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    __syncthreads();  // the next token overwrites the table
  }
}

}  // namespace

absl::Status RopeParams::Validate() const {
  if (query == nullptr && num_heads > 0) {
    return absl::InvalidArgumentError("RopeParams.query is null");
  }
  if (key == nullptr && num_kv_heads > 0) {
    return absl::InvalidArgumentError("RopeParams.key is null");
  }
  if (positions == nullptr) return absl::InvalidArgumentError("RopeParams.positions is null");
  if (inv_freq == nullptr) return absl::InvalidArgumentError("RopeParams.inv_freq is null");
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RopeParams.num_tokens must be >= 0: ", num_tokens));
  }
  if (num_heads < 0 || num_heads > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("RopeParams.num_heads out of range: ", num_heads));
  }
  if (num_kv_heads < 0 || num_kv_heads > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("RopeParams.num_kv_heads out of range: ", num_kv_heads));
  }
  if (!(scale > 0) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("RopeParams.scale must be > 0: ", scale));
  }
  if (head_dim <= 0 || head_dim % 2 != 0 || head_dim > kRopeMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RopeParams.head_dim must be even and in (0, ", kRopeMaxHeadDim, "]: ", head_dim));
  }
  return absl::OkStatus();
}

absl::Status LaunchRope(const RopeParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0 || p.num_heads + p.num_kv_heads == 0) return absl::OkStatus();
  const size_t shared_bytes = sizeof(float) * static_cast<size_t>(p.head_dim);
  RopeKernel<<<GridStrideBlocks(p.num_tokens, 1), kThreads, shared_bytes, stream>>>(
      p.query, p.key, p.positions, p.inv_freq, p.scale, p.num_tokens, p.num_heads,
      p.num_kv_heads, p.head_dim);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
