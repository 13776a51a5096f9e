// Writes new tokens' K and V rows into the paged KV arenas, converting to the arena dtype
// (quantizing for int8/int4 with kernels/cpu/kv_quant.h, formats in kernels/kv_dtype.h).
#ifndef KVGRID_KERNELS_CPU_KV_WRITE_H_
#define KVGRID_KERNELS_CPU_KV_WRITE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cpu {

// Arena planes, with R = KvRowLayoutFor(dtype, head_dim):
//   values [num_blocks, num_kv_heads, block_size, R.value_bytes]
//   meta   [num_blocks, num_kv_heads, block_size, R.meta_bytes]   (quantized dtypes only)
struct KvWriteParams {
  const float* key = nullptr;     // [num_tokens, num_kv_heads, head_dim]
  const float* value = nullptr;   // [num_tokens, num_kv_heads, head_dim]
  const int64_t* slots = nullptr; // [num_tokens]: block_id * block_size + offset; -1 skips
  void* k_cache = nullptr;        // values plane of k_dtype
  void* v_cache = nullptr;        // values plane of v_dtype
  void* k_meta = nullptr;         // meta plane of k_dtype; null for float dtypes
  void* v_meta = nullptr;         // meta plane of v_dtype; null for float dtypes
  KvDType k_dtype = KvDType::kF32;
  KvDType v_dtype = KvDType::kF32;
  int64_t num_tokens = 0;
  int64_t num_blocks = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;           // even

  // INVALID_ARGUMENT for null pointers (a meta plane is required exactly when its dtype has
  // metadata), bad sizes, an odd head_dim, or a slot outside the arena.
  absl::Status Validate() const;
};

// Converts each token's rows and stores them at its slot; tokens are independent, so a batch
// may write any set of distinct slots. Errors: those of Validate().
absl::Status KvWrite(const KvWriteParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_KV_WRITE_H_
