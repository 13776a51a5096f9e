#include "worker/kv/kv_pool.h"

#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvgrid::worker {

int64_t KvGeometry::BytesPerToken() const {
  return num_layers * num_kv_heads * head_dim *
         static_cast<int64_t>(kernels::KvDTypeSize(k_dtype) + kernels::KvDTypeSize(v_dtype));
}

void KvPool::FreeDeleter::operator()(std::byte* p) const { std::free(p); }

KvPool::KvPool(const KvGeometry& geometry, int32_t num_blocks)
    : geometry_(geometry), num_blocks_(num_blocks) {}

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(const KvGeometry& g,
                                                       int64_t budget_bytes) {
  if (g.num_layers <= 0 || g.num_kv_heads <= 0 || g.head_dim <= 0 ||
      !(g.block_size == 8 || g.block_size == 16 || g.block_size == 32)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV geometry: layers, kv heads and head_dim must be positive and block_size one of "
        "8/16/32 (got block_size ",
        g.block_size, ")"));
  }
  const int64_t per_block = g.BytesPerBlock();
  const int64_t blocks = budget_bytes / per_block;
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-memory ", budget_bytes,
                                                   " bytes is below one KV block (", per_block,
                                                   " bytes)"));
  }
  if (blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("--kv-cache-memory: too many blocks for 32-bit block ids");
  }
  std::unique_ptr<KvPool> pool(new KvPool(g, static_cast<int32_t>(blocks)));
  const int64_t plane = blocks * g.num_kv_heads * g.block_size * g.head_dim;
  for (int64_t layer = 0; layer < g.num_layers; ++layer) {
    for (auto [arena, dtype] : {std::pair{&pool->k_, g.k_dtype}, std::pair{&pool->v_, g.v_dtype}}) {
      const size_t bytes = static_cast<size_t>(plane) * kernels::KvDTypeSize(dtype);
      // 64-byte alignment keeps rows aligned for SIMD loads.
      void* mem = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      if (!mem) {
        return absl::ResourceExhaustedError(
            absl::StrCat("KV pool: could not allocate ", bytes, " bytes for layer ", layer));
      }
      std::memset(mem, 0, bytes);
      arena->emplace_back(static_cast<std::byte*>(mem));
    }
  }
  return pool;
}

}  // namespace kvgrid::worker
