// Where a sequence goes: the worker group choice, as a pure function over a snapshot of the
// registry, so it is tested without processes.
//
// Only live groups serving the model whose whole KV pool can ever hold the sequence's
// worst case (prompt + max_new_tokens, capped at the context length; for a group whose
// model slides every layer, at most its window plus one prefill chunk) are eligible, and of
// those only ones whose queue is not full. Among them the order is: can admit it now (enough
// free blocks and a free sequence slot), longer prefix-cache affinity, fewer requests in
// flight, more free blocks.
#ifndef KVGRID_COORDINATOR_PLACEMENT_H_
#define KVGRID_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::coordinator {

struct Candidate {
  std::string worker_id;
  bool live = true;           // serving, heartbeating, not draining
  int64_t block_size = 16;
  int64_t blocks_total = 0;   // the whole pool
  int64_t blocks_free = 0;    // at the last heartbeat, minus what was placed since
  int64_t max_model_len = 0;
  int64_t in_flight = 0;      // placed and not finished
  int64_t max_num_seqs = 1;   // run at once
  int64_t prefix_blocks = 0;  // leading prompt blocks recently sent to this worker
  // KvCapacity.kv_window and .max_num_batched_tokens: a windowed sequence never holds more
  // than its window plus one step's tokens.
  int64_t kv_window = 0;
  int64_t prefill_chunk = 0;
};

struct PlacementRequest {
  int64_t prompt_tokens = 0;
  int64_t max_new_tokens = 0;
  // Requests a worker may hold beyond max_num_seqs before it counts as full.
  int64_t max_queue_depth = 0;
};

// The worst case a sequence can need on `c`, in tokens.
int64_t WorstCaseTokens(const Candidate& c, const PlacementRequest& r);
// The most blocks it holds at once on `c`: those of WorstCaseTokens, or with a KV window
// at most ceil((kv_window - 1 + min(prefill_chunk, tokens)) / block_size) + 1 (the worker's
// own bound, worker/kv/kv_planner.h's SequenceBlocks).
int64_t WorstCaseBlocks(const Candidate& c, const PlacementRequest& r);

// Index of the chosen candidate.
// Errors: UNAVAILABLE when no candidate is live; INVALID_ARGUMENT when no live candidate can
// ever hold the sequence (tokens and blocks needed vs. the largest pool); RESOURCE_EXHAUSTED
// when every candidate that could hold it has a full queue.
absl::StatusOr<size_t> ChooseWorker(std::span<const Candidate> candidates,
                                    const PlacementRequest& request);

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_PLACEMENT_H_
