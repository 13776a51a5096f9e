// The memory of one card's paged KV cache: for every layer, a K arena and a V arena laid out
// [num_blocks][num_kv_heads][block_size][head_dim] (head-major, so one head's keys in a block
// are contiguous). An arena of a quantized dtype is two planes in that order (formats in
// kernels/kv_dtype.h): values [..][value_bytes] and per-row scales/zero points [..][meta_bytes].
// Sized from a byte budget. Owns the memory (anonymous mappings: zeroed, and
// committed page by page as blocks are first written); non-copyable. Not thread-safe.
#ifndef KVGRID_WORKER_KV_KV_POOL_H_
#define KVGRID_WORKER_KV_KV_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::worker {

struct KvGeometry {
  int64_t num_layers = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = 16;
  kernels::KvDType k_dtype = kernels::KvDType::kF32;
  kernels::KvDType v_dtype = kernels::KvDType::kF32;

  // K + V bytes one token occupies across all layers.
  [[nodiscard]] int64_t BytesPerToken() const;
  [[nodiscard]] int64_t BytesPerBlock() const { return BytesPerToken() * block_size; }
};

class KvPool {
 public:
  // Allocates as many blocks as `budget_bytes` holds (zero-filled).
  // Errors: INVALID_ARGUMENT for a bad geometry or a budget below one block (with the numbers);
  // RESOURCE_EXHAUSTED when the budget exceeds physical memory or the mapping fails.
  static absl::StatusOr<std::unique_ptr<KvPool>> Create(const KvGeometry& geometry,
                                                        int64_t budget_bytes);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  [[nodiscard]] const KvGeometry& geometry() const { return geometry_; }
  [[nodiscard]] int32_t num_blocks() const { return num_blocks_; }
  [[nodiscard]] int64_t capacity_tokens() const { return num_blocks_ * geometry_.block_size; }
  [[nodiscard]] int64_t bytes() const { return num_blocks_ * geometry_.BytesPerBlock(); }

  // Arena base pointers for `layer` (0 <= layer < num_layers): the values planes, and the
  // metadata planes (nullptr for float dtypes, which have none).
  [[nodiscard]] void* k(int64_t layer) { return k_[layer].data; }
  [[nodiscard]] void* v(int64_t layer) { return v_[layer].data; }
  [[nodiscard]] void* k_meta(int64_t layer) { return k_meta_[layer].data; }
  [[nodiscard]] void* v_meta(int64_t layer) { return v_meta_[layer].data; }

 private:
  struct Arena {
    void* data = nullptr;
    size_t bytes = 0;
  };
  KvPool(const KvGeometry& geometry, int32_t num_blocks);
  KvGeometry geometry_;
  int32_t num_blocks_;
  std::vector<Arena> k_, v_, k_meta_, v_meta_;  // one per layer; empty Arenas for no meta
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_KV_POOL_H_
