// Moves the K/V data of whole blocks between two pools of the same geometry: within one pool
// for copy-on-write, between the device pool and the host swap space for preemption by swap.
#ifndef KVGRID_WORKER_KV_KV_BLOCK_COPY_H_
#define KVGRID_WORKER_KV_KV_BLOCK_COPY_H_

#include <span>

#include "absl/status/status.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

// For each copy, block `src` of `from` overwrites block `dst` of `to`, in every layer's K and V
// planes. `from` and `to` may be the same pool. Errors: INVALID_ARGUMENT when the geometries
// differ or an id is outside its pool (nothing is copied then).
absl::Status CopyKvBlocks(KvPool& from, KvPool& to, std::span<const BlockCopy> copies);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_KV_BLOCK_COPY_H_
