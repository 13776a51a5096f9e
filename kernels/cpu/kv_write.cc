#include "kernels/cpu/kv_write.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::kernels::cpu {

absl::Status KvWriteParams::Validate() const {
  if (num_tokens > 0 && (!key || !value || !slots)) {
    return absl::InvalidArgumentError("KvWriteParams: null key, value or slots");
  }
  if (!k_cache || !v_cache) return absl::InvalidArgumentError("KvWriteParams: null cache");
  if (num_tokens < 0 || num_blocks <= 0 || num_kv_heads <= 0 || block_size <= 0 ||
      head_dim <= 0) {
    return absl::InvalidArgumentError("KvWriteParams: sizes out of range");
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < -1 || slots[t] >= num_blocks * block_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("KvWriteParams.slots[", t, "] = ", slots[t], " is outside the arena of ",
                       num_blocks * block_size, " slots"));
    }
  }
  return absl::OkStatus();
}

namespace {

void StoreRow(const float* src, void* cache, KvDType dtype, int64_t elem_offset, int64_t n) {
  switch (dtype) {
    case KvDType::kF32:
      std::memcpy(static_cast<float*>(cache) + elem_offset, src, sizeof(float) * n);
      break;
    case KvDType::kF16:
      Vec().f32_to_f16(src, static_cast<uint16_t*>(cache) + elem_offset, n);
      break;
  }
}

}  // namespace

absl::Status KvWrite(const KvWriteParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / p.block_size;
    const int64_t offset = slot % p.block_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const int64_t dst = ((block * p.num_kv_heads + h) * p.block_size + offset) * p.head_dim;
      const int64_t src = (t * p.num_kv_heads + h) * p.head_dim;
      StoreRow(p.key + src, p.k_cache, p.k_dtype, dst, p.head_dim);
      StoreRow(p.value + src, p.v_cache, p.v_dtype, dst, p.head_dim);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
