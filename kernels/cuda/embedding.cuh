// Token embedding lookup on the GPU: output[t] = table[ids[t]] as fp32, from an fp32, fp16 or
// bf16 table (16-bit rows are widened exactly). Checked against kernels/cpu/embedding.h.
//
// Out-of-range ids: the CPU reference rejects them with INVALID_ARGUMENT before copying
// anything, but the ids live on the device here and the host cannot look at them without a
// synchronizing copy. So the kernel never reads outside the table: a token whose id is outside
// [0, vocab) gets a row of zeros, and `invalid_id_flag` (when given) is set to 1 so the caller
// can turn that into its INVALID_ARGUMENT once it reads the flag back.
//
// Vocabulary-parallel lookup (tensor parallelism): a rank's table holds rows
// [vocab_begin, vocab_begin + table_rows) of the vocabulary; a valid id outside them gets a row
// of zeros, so the sum of the ranks' outputs is the whole lookup.
#ifndef KVGRID_KERNELS_CUDA_EMBEDDING_CUH_
#define KVGRID_KERNELS_CUDA_EMBEDDING_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cuda {

struct EmbeddingParams {
  const void* table = nullptr;    // [table_rows, hidden] of table_dtype, device, element-aligned
  const int32_t* ids = nullptr;   // [num_tokens], device
  float* output = nullptr;        // [num_tokens, hidden], device
  int32_t* invalid_id_flag = nullptr;  // [1], device, or null: set to 1 (never cleared) when an
                                       // id was outside [0, vocab); the caller zeroes it
  model::DType table_dtype = model::DType::kF32;  // kF32, kF16 or kBF16
  int64_t vocab = 0;
  int64_t vocab_begin = 0;  // the vocabulary row of the table's first row
  int64_t table_rows = 0;   // rows in the table; 0: vocab (the whole vocabulary, vocab_begin 0)
  int64_t hidden = 0;
  int64_t num_tokens = 0;  // 0 launches nothing

  // INVALID_ARGUMENT naming the field for null or misaligned pointers, sizes out of range or
  // an unsupported table dtype. The ids are not checked (see the file comment).
  absl::Status Validate() const;
};

// Enqueues the lookup on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchEmbedding(const EmbeddingParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_EMBEDDING_CUH_
