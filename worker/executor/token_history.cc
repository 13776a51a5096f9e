#include "worker/executor/token_history.h"

#include "worker/executor/sampler.h"

namespace kvgrid::worker {

TokenHistory::TokenHistory(const SamplingParams& params, std::span<const int32_t> prompt)
    : track_seen_(params.repetition_penalty != 1.0),
      track_counts_(params.presence_penalty != 0.0 || params.frequency_penalty != 0.0) {
  if (track_seen_) seen_.insert(prompt.begin(), prompt.end());
}

void TokenHistory::AddOutput(int32_t token) {
  if (track_seen_) seen_.insert(token);
  if (track_counts_) ++output_counts_[token];
}

}  // namespace kvgrid::worker
