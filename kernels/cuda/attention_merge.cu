#include "kernels/cuda/attention_merge.cuh"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// A grid-stride loop over output elements (row, channel): each thread reads its row's lses
// (parts of them, few) and its channel of every part's output, consecutive threads taking
// consecutive channels so the output reads are coalesced.
__global__ void MergeKernel(const float* __restrict__ outputs, const float* __restrict__ lses,
                            float* __restrict__ out, float* __restrict__ lse_out, int64_t parts,
                            int64_t rows, int64_t head_dim, int64_t out_stride,
                            int64_t lse_stride) {
  const int64_t total = rows * head_dim;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t r = idx / head_dim;
    const int64_t d = idx - r * head_dim;
    float top = -INFINITY;
    bool nan = false;
    for (int64_t c = 0; c < parts; ++c) {
      const float l = lses[c * lse_stride + r];
      nan |= l != l;  // NaN
      top = fmaxf(top, l);
    }
    float o = 0.f, lse = -INFINITY;
    if (nan) {
      o = lse = NAN;
    } else if (top != -INFINITY) {
      float sum = 0.f;
      for (int64_t c = 0; c < parts; ++c) {
        const float l = lses[c * lse_stride + r];
        if (l == -INFINITY) continue;
        const float a = expf(l - top);
        sum += a;
        o = fmaf(a, outputs[c * out_stride + r * head_dim + d], o);
      }
      o /= sum;
      lse = top + logf(sum);
    }
    out[idx] = o;
    if (d == 0 && lse_out != nullptr) lse_out[r] = lse;
  }
}

}  // namespace

absl::Status MergeAttentionParams::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("MergeAttentionParams.", parts...));
  };
  if (outputs == nullptr) return invalid("outputs is null");
  if (lses == nullptr) return invalid("lses is null");
  if (out == nullptr) return invalid("out is null");
  if (parts < 1 || parts > 1024) return invalid("parts must be in [1, 1024]: ", parts);
  if (rows < 0) return invalid("rows must be >= 0: ", rows);
  if (head_dim < 1 || head_dim > 1024) return invalid("head_dim must be in [1, 1024]: ", head_dim);
  if (part_stride != 0 && part_stride < rows * head_dim) {
    return invalid("part_stride must be 0 or >= rows * head_dim (", rows * head_dim,
                   "): ", part_stride);
  }
  return absl::OkStatus();
}

absl::Status LaunchMergeAttentionPartials(const MergeAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const int64_t total = p.rows * p.head_dim;
  if (total == 0) return absl::OkStatus();
  MergeKernel<<<GridStrideBlocks(total, kThreads), kThreads, 0, stream>>>(
      p.outputs, p.lses, p.out, p.lse_out, p.parts, p.rows, p.head_dim,
      p.part_stride != 0 ? p.part_stride : p.rows * p.head_dim,
      p.part_stride != 0 ? p.part_stride : p.rows);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
