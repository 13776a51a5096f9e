#include "kernels/cpu/kv_write.h"

#include <cstddef>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/kv_quant.h"

namespace kvgrid::kernels::cpu {

absl::Status KvWriteParams::Validate() const {
  if (num_tokens > 0 && (!key || !value || !slots)) {
    return absl::InvalidArgumentError("KvWriteParams: null key, value or slots");
  }
  if (!k_cache || !v_cache) return absl::InvalidArgumentError("KvWriteParams: null cache");
  if (num_tokens < 0 || num_blocks <= 0 || num_kv_heads <= 0 || block_size <= 0 ||
      head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError("KvWriteParams: sizes out of range (head_dim must be even)");
  }
  for (auto [meta, dtype, name] : {std::tuple{k_meta, k_dtype, "k_meta"},
                                   std::tuple{v_meta, v_dtype, "v_meta"}}) {
    const bool needs_meta = KvRowLayoutFor(dtype, head_dim).meta_bytes > 0;
    if (needs_meta && !meta) {
      return absl::InvalidArgumentError(absl::StrCat("KvWriteParams.", name, ": required for ",
                                                     std::string(KvDTypeName(dtype))));
    }
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

absl::Status KvWrite(const KvWriteParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const KvRowLayout kl = KvRowLayoutFor(p.k_dtype, p.head_dim);
  const KvRowLayout vl = KvRowLayoutFor(p.v_dtype, p.head_dim);
  auto* k_values = static_cast<std::byte*>(p.k_cache);
  auto* v_values = static_cast<std::byte*>(p.v_cache);
  auto* k_meta = static_cast<std::byte*>(p.k_meta);
  auto* v_meta = static_cast<std::byte*>(p.v_meta);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = p.slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / p.block_size;
    const int64_t offset = slot % p.block_size;
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const int64_t row = (block * p.num_kv_heads + h) * p.block_size + offset;
      const int64_t src = (t * p.num_kv_heads + h) * p.head_dim;
      QuantizeRow(p.k_dtype, p.key + src, p.head_dim, k_values + row * kl.value_bytes,
                  k_meta ? k_meta + row * kl.meta_bytes : nullptr);
      QuantizeRow(p.v_dtype, p.value + src, p.head_dim, v_values + row * vl.value_bytes,
                  v_meta ? v_meta + row * vl.meta_bytes : nullptr);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
