// Writes new tokens' K and V rows into the paged KV arenas, converting to the arena dtype.
#ifndef KVGRID_KERNELS_CPU_KV_WRITE_H_
#define KVGRID_KERNELS_CPU_KV_WRITE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cpu {

struct KvWriteParams {
  const float* key = nullptr;     // [num_tokens, num_kv_heads, head_dim]
  const float* value = nullptr;   // [num_tokens, num_kv_heads, head_dim]
  const int64_t* slots = nullptr; // [num_tokens]: block_id * block_size + offset; -1 skips
  void* k_cache = nullptr;        // [num_blocks, num_kv_heads, block_size, head_dim] of k_dtype
  void* v_cache = nullptr;        // [num_blocks, num_kv_heads, block_size, head_dim] of v_dtype
  KvDType k_dtype = KvDType::kF32;
  KvDType v_dtype = KvDType::kF32;
  int64_t num_tokens = 0;
  int64_t num_blocks = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;

  // INVALID_ARGUMENT for null pointers, bad sizes, or a slot outside the arena.
  absl::Status Validate() const;
};

absl::Status KvWrite(const KvWriteParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_KV_WRITE_H_
