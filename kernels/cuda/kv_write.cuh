// Writes new tokens' K and V rows into the paged KV arenas on the GPU, converting each row to
// its arena's dtype (formats in kernels/kv_dtype.h). The bytes written are identical to those
// of kernels/cpu/kv_write.h for every dtype: the per-value arithmetic is shared with the host
// through kernels/cuda/numeric.cuh, and the row-wide reductions (max |x|, and per int4 group
// min and max) are exact whatever order a warp combines them in.
//
// Slots: the CPU reference rejects a slot outside [-1, num_blocks * block_size) with
// INVALID_ARGUMENT before writing. The slots live on the device here, so the kernel instead
// skips such a token (writing nothing for it, exactly as for -1) and sets `invalid_slot_flag`
// when given, for the caller to turn into its error once it reads the flag back.
#ifndef KVGRID_KERNELS_CUDA_KV_WRITE_CUH_
#define KVGRID_KERNELS_CUDA_KV_WRITE_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cuda {

// Arena planes, with R = KvRowLayoutFor(dtype, head_dim):
//   values [num_blocks, num_kv_heads, block_size, R.value_bytes]
//   meta   [num_blocks, num_kv_heads, block_size, R.meta_bytes]   (quantized dtypes only)
struct KvWriteParams {
  const float* key = nullptr;      // [num_tokens, num_kv_heads, head_dim], device
  const float* value = nullptr;    // [num_tokens, num_kv_heads, head_dim], device
  const int64_t* slots = nullptr;  // [num_tokens], device: block_id * block_size + offset;
                                   // -1 skips the token
  void* k_cache = nullptr;         // values plane of k_dtype, device, element-aligned
  void* v_cache = nullptr;         // values plane of v_dtype, device, element-aligned
  void* k_meta = nullptr;          // meta plane of k_dtype, device, 2-byte aligned; null for
                                   // float dtypes
  void* v_meta = nullptr;          // meta plane of v_dtype, as k_meta
  int32_t* invalid_slot_flag = nullptr;  // [1], device, or null: set to 1 (never cleared) when a
                                         // slot was outside [-1, num_blocks * block_size)
  KvDType k_dtype = KvDType::kF32;
  KvDType v_dtype = KvDType::kF32;
  int64_t num_tokens = 0;  // 0 launches nothing
  int64_t num_blocks = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;    // even

  // INVALID_ARGUMENT naming the field for null or misaligned pointers (a meta plane is required
  // exactly when its dtype has metadata), bad sizes or an odd head_dim. Slots are not checked
  // (see the file comment).
  absl::Status Validate() const;
};

// Enqueues the write on `stream`. Tokens are independent; two tokens with the same slot race.
// Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchKvWrite(const KvWriteParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_KV_WRITE_CUH_
