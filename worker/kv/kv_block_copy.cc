#include "worker/kv/kv_block_copy.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvgrid::worker {
namespace {

void CopyPlane(const void* from, void* to, int64_t block_bytes, std::span<const BlockCopy> copies) {
  for (const BlockCopy& c : copies) {
    std::memmove(static_cast<std::byte*>(to) + c.dst * block_bytes,
                 static_cast<const std::byte*>(from) + c.src * block_bytes, block_bytes);
  }
}

}  // namespace

absl::Status CopyKvBlocks(KvPool& from, KvPool& to, std::span<const BlockCopy> copies) {
  const KvGeometry& g = from.geometry();
  const KvGeometry& h = to.geometry();
  if (g.num_layers != h.num_layers || g.num_kv_heads != h.num_kv_heads ||
      g.head_dim != h.head_dim || g.block_size != h.block_size || g.k_dtype != h.k_dtype ||
      g.v_dtype != h.v_dtype) {
    return absl::InvalidArgumentError("CopyKvBlocks: the pools' geometries differ");
  }
  for (const BlockCopy& c : copies) {
    if (c.src < 0 || c.src >= from.num_blocks() || c.dst < 0 || c.dst >= to.num_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("CopyKvBlocks: copy ", c.src, " -> ", c.dst, " is outside the pools"));
    }
  }
  const int64_t rows_per_block = g.num_kv_heads * g.block_size;
  for (const auto& [dtype, is_k] : {std::pair{g.k_dtype, true}, std::pair{g.v_dtype, false}}) {
    const kernels::KvRowLayout row = kernels::KvRowLayoutFor(dtype, g.head_dim);
    for (int64_t layer = 0; layer < g.num_layers; ++layer) {
      CopyPlane(is_k ? from.k(layer) : from.v(layer), is_k ? to.k(layer) : to.v(layer),
                rows_per_block * row.value_bytes, copies);
      if (row.meta_bytes > 0) {  // quantized rows: their scales and zero points travel too
        CopyPlane(is_k ? from.k_meta(layer) : from.v_meta(layer),
                  is_k ? to.k_meta(layer) : to.v_meta(layer), rows_per_block * row.meta_bytes,
                  copies);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
