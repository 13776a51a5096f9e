#include "worker/kv/kv_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvgrid::worker {

int64_t KvGeometry::BytesPerToken() const {
  return num_layers * num_kv_heads *
         (kernels::KvRowLayoutFor(k_dtype, head_dim).total() +
          kernels::KvRowLayoutFor(v_dtype, head_dim).total());
}

KvPool::KvPool(const KvGeometry& geometry, int32_t num_blocks)
    : geometry_(geometry), num_blocks_(num_blocks) {}

KvPool::~KvPool() {
  for (std::vector<Arena>* arenas : {&k_, &v_, &k_meta_, &v_meta_}) {
    for (const Arena& a : *arenas) {
      if (a.data) munmap(a.data, a.bytes);
    }
  }
}

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
  const int64_t total = blocks * per_block;
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (physical > 0 && total > physical) {
    return absl::ResourceExhaustedError(absl::StrCat("--kv-cache-memory: ", total,
                                                     " bytes of KV blocks exceed the ", physical,
                                                     " bytes of physical memory"));
  }
  std::unique_ptr<KvPool> pool(new KvPool(g, static_cast<int32_t>(blocks)));
  const int64_t rows = blocks * g.num_kv_heads * g.block_size;
  // Page-aligned and zero-filled by the kernel, so rows are aligned for SIMD loads. A plane of
  // zero bytes (the metadata of a float dtype) stays an empty Arena with a null pointer.
  auto map = [&](int64_t row_bytes, int64_t layer, std::vector<Arena>* arenas) -> absl::Status {
    const size_t bytes = static_cast<size_t>(rows * row_bytes);
    if (bytes == 0) {
      arenas->push_back({});
      return absl::OkStatus();
    }
    void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KV pool: could not map ", bytes, " bytes for layer ", layer));
    }
    arenas->push_back({mem, bytes});
    return absl::OkStatus();
  };
  const kernels::KvRowLayout kl = kernels::KvRowLayoutFor(g.k_dtype, g.head_dim);
  const kernels::KvRowLayout vl = kernels::KvRowLayoutFor(g.v_dtype, g.head_dim);
  for (int64_t layer = 0; layer < g.num_layers; ++layer) {
    for (auto [row_bytes, arenas] :
         {std::pair{kl.value_bytes, &pool->k_}, std::pair{vl.value_bytes, &pool->v_},
          std::pair{kl.meta_bytes, &pool->k_meta_}, std::pair{vl.meta_bytes, &pool->v_meta_}}) {
      if (absl::Status s = map(row_bytes, layer, arenas); !s.ok()) return s;
    }
  }
  return pool;
}

}  // namespace kvgrid::worker
