#include "coordinator/placement.h"

#include <algorithm>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvgrid::coordinator {
namespace {

int64_t BlocksFor(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

}  // namespace

int64_t WorstCaseTokens(const Candidate& c, const PlacementRequest& r) {
  // Written to avoid overflow: max_new_tokens may be anything up to INT32_MAX.
  if (c.max_model_len > 0 && r.max_new_tokens >= c.max_model_len - r.prompt_tokens) {
    return std::max(c.max_model_len, r.prompt_tokens);
  }
  return r.prompt_tokens + r.max_new_tokens;
}

int64_t WorstCaseBlocks(const Candidate& c, const PlacementRequest& r) {
  const int64_t tokens = WorstCaseTokens(c, r);
  const int64_t all = BlocksFor(tokens, c.block_size);
  if (c.kv_window <= 0) return all;
  // A worker that did not say its chunk: assume a whole prompt in one step.
  const int64_t chunk = c.prefill_chunk > 0 ? c.prefill_chunk : tokens;
  return std::min(all, BlocksFor(c.kv_window - 1 + std::min(chunk, tokens), c.block_size) + 1);
}

absl::StatusOr<size_t> ChooseWorker(std::span<const Candidate> candidates,
                                    const PlacementRequest& request) {
  bool any_live = false;
  bool any_holds = false;
  int64_t largest_tokens = 0, largest_blocks = 0, needed_tokens = 0, needed_blocks = 0;
  int64_t needed_window = 0;
  int64_t best = -1;
  std::tuple<bool, int64_t, int64_t, int64_t> best_key;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (!c.live) continue;
    any_live = true;
    const int64_t tokens = WorstCaseTokens(c, request);
    const int64_t need = WorstCaseBlocks(c, request);
    if (c.blocks_total * c.block_size > largest_tokens) {
      largest_tokens = c.blocks_total * c.block_size;
      largest_blocks = c.blocks_total;
      needed_tokens = tokens;
      needed_blocks = need;
      needed_window = c.kv_window;
    }
    if (need > c.blocks_total) continue;
    any_holds = true;
    if (c.in_flight >= c.max_num_seqs + request.max_queue_depth) continue;
    // Smaller is better.
    const bool admits_now = c.blocks_free >= need && c.in_flight < c.max_num_seqs;
    const auto key = std::make_tuple(!admits_now, -c.prefix_blocks, c.in_flight, -c.blocks_free);
    if (best < 0 || key < best_key) {
      best = static_cast<int64_t>(i);
      best_key = key;
    }
  }
  if (!any_live) return absl::UnavailableError("no live worker serves the model");
  if (!any_holds) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt + max_new_tokens: the sequence may need ", needed_tokens, " tokens (",
                     needed_blocks, " KV blocks",
                     needed_window > 0 ? absl::StrCat(" with its window of ", needed_window) : "",
                     "); the largest KV pool of a live worker group holds ", largest_tokens,
                     " tokens (", largest_blocks, " blocks)"));
  }
  if (best < 0) {
    return absl::ResourceExhaustedError(
        "every worker group that can hold the sequence has a full queue; retry later");
  }
  return static_cast<size_t>(best);
}

}  // namespace kvgrid::coordinator
