// What the sampler's penalties know of one continuation's tokens, kept up to date one token at
// a time so that a step never rescans the history or touches the whole vocabulary.
#ifndef KVGRID_WORKER_EXECUTOR_TOKEN_HISTORY_H_
#define KVGRID_WORKER_EXECUTOR_TOKEN_HISTORY_H_

#include <cstdint>
#include <span>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace kvgrid::worker {

struct SamplingParams;

// The distinct ids of prompt + generated tokens (the repetition penalty's set, as vLLM and
// Hugging Face have it) and how often each id was generated (the presence and frequency
// penalties, over the output only, as vLLM has them). Only what the sampling parameters use
// is kept: with every penalty off it holds nothing and costs nothing per token. Sizes grow
// with the distinct ids seen, never with the vocabulary.
//
// A copy is independent, so n > 1 siblings forked from one prompt each keep their own.
// Thread-safety: none (a value type).
class TokenHistory {
 public:
  // Nothing tracked: for sampling with every penalty off.
  TokenHistory() = default;
  // Tracks what `params` need, starting from `prompt` (ids outside the vocabulary are kept
  // and ignored by the sampler).
  TokenHistory(const SamplingParams& params, std::span<const int32_t> prompt);

  // Records one generated token (a resumed one included: failover replays them here).
  void AddOutput(int32_t token);

  // Ids in prompt + output; empty unless the repetition penalty is on.
  [[nodiscard]] const absl::flat_hash_set<int32_t>& seen() const { return seen_; }
  // Generated id -> count; empty unless a presence or frequency penalty is on.
  [[nodiscard]] const absl::flat_hash_map<int32_t, int32_t>& output_counts() const {
    return output_counts_;
  }

 private:
  bool track_seen_ = false;
  bool track_counts_ = false;
  absl::flat_hash_set<int32_t> seen_;
  absl::flat_hash_map<int32_t, int32_t> output_counts_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_TOKEN_HISTORY_H_
