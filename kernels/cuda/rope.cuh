// Rotary position embedding on the GPU, in place on q and k, in Hugging Face's half-split
// ("rotate_half") convention: for i < d/2, (x[i], x[i + d/2]) is rotated by the angle
// position * inv_freq[i]. Checked against kernels/cpu/rope.h.
//
// The frequencies come in as the table cpu::RopeInvFreq builds (double, [head_dim / 2]), so
// plain, "linear", "dynamic", "yarn" and "llama3" scaling and GGUF's rope_freqs divisors are all
// the caller's choice of table; `scale` (cpu::RopeAttentionFactor: YaRN's mscale, else 1)
// multiplies cos and sin in double before they are rounded, as on the CPU. Precision follows
// the CPU reference step for step: the angle is formed in double, its cos and sin are taken in
// double and rounded to float, and the rotation is done in float without FMA contraction. The
// only difference left is CUDA's double sin/cos (<= 2 ulp of a double) against glibc's, which
// after rounding to float changes a cos or sin by one float ulp in rare cases.
#ifndef KVGRID_KERNELS_CUDA_ROPE_CUH_
#define KVGRID_KERNELS_CUDA_ROPE_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

// The largest head_dim RopeParams accepts: the block's cos/sin table lives in shared memory
// (head_dim floats).
inline constexpr int64_t kRopeMaxHeadDim = 4096;

struct RopeParams {
  float* query = nullptr;              // [num_tokens, num_heads, head_dim], device, in place
  float* key = nullptr;                // [num_tokens, num_kv_heads, head_dim], device, in place
  const int32_t* positions = nullptr;  // [num_tokens], device
  const double* inv_freq = nullptr;    // [head_dim / 2], device (cpu::RopeInvFreq's table)
  double scale = 1.0;                  // > 0: cos and sin are multiplied by it
  int64_t num_tokens = 0;              // 0 launches nothing
  int64_t num_heads = 0;               // may be 0 (query then unused)
  int64_t num_kv_heads = 0;            // may be 0 (key then unused)
  int64_t head_dim = 0;                // even, <= kRopeMaxHeadDim

  // INVALID_ARGUMENT naming the field for null pointers or sizes out of range.
  absl::Status Validate() const;
};

// Enqueues the rotation on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchRope(const RopeParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_ROPE_CUH_
