// The exact merge of context-parallel ranks' attention shares on the GPU, the same arithmetic
// as kernels/cpu/attention.h's MergeAttentionPartials: for each (token, head) row,
// out = sum_c exp(lse_c - L) out_c / sum_c exp(lse_c - L) with L = max_c lse_c, and
// lse_out = L + log(sum_c exp(lse_c - L)). A row no part attended (every lse_c = -inf) gets
// zeros and -inf; a NaN lse gives the row NaN. Results differ from the CPU's only by expf's
// and logf's last bits.
#ifndef KVGRID_KERNELS_CUDA_ATTENTION_MERGE_CUH_
#define KVGRID_KERNELS_CUDA_ATTENTION_MERGE_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

struct MergeAttentionParams {
  const float* outputs = nullptr;  // [parts, rows, head_dim] (part stride part_stride), device
  const float* lses = nullptr;     // [parts, rows] (part stride part_stride), device
  float* out = nullptr;            // [rows, head_dim], device; must not overlap outputs
  float* lse_out = nullptr;        // [rows], device, or null
  int64_t parts = 0;               // >= 1
  int64_t rows = 0;                // 0 launches nothing
  int64_t head_dim = 0;
  // Floats from one part's outputs (and lses) to the next's; 0: packed (rows * head_dim for
  // outputs, rows for lses). An all-gather of each rank's [outputs | lses] is read in place
  // with part_stride = rows * (head_dim + 1) and lses = outputs + rows * head_dim.
  int64_t part_stride = 0;

  // INVALID_ARGUMENT naming the field for null pointers or sizes out of range.
  absl::Status Validate() const;
};

// Enqueues the merge on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchMergeAttentionPartials(const MergeAttentionParams& params,
                                          cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_ATTENTION_MERGE_CUH_
