// Token sampling from one sequence's logits: repetition penalty, then temperature, top-k,
// top-p and min-p, then a draw from the sequence's own random stream — so a seeded request
// samples the same tokens whatever else is in the batch. Temperature 0 is greedy.
#ifndef KVGRID_WORKER_EXECUTOR_SAMPLER_H_
#define KVGRID_WORKER_EXECUTOR_SAMPLER_H_

#include <cstdint>
#include <optional>
#include <random>
#include <span>

#include "absl/status/status.h"

namespace kvgrid::worker {

struct SamplingParams {
  double temperature = 1.0;         // 0 (or below 1e-5) = greedy
  double top_p = 1.0;               // (0, 1]
  int64_t top_k = 0;                // 0 = off
  double min_p = 0.0;               // [0, 1]: drop tokens below min_p * p(top token)
  double repetition_penalty = 1.0;  // > 0; 1 = off (HF semantics: divide positive logits)
  std::optional<uint64_t> seed;     // absent: drawn from the OS
  int64_t logprobs = -1;            // -1: none; k >= 0: chosen token's plus the top k (<= 20)

  // INVALID_ARGUMENT naming the field (e.g. "top_p: must be in (0, 1], got 1.5").
  absl::Status Validate() const;
};

// Temperature below 1e-5: argmax, no random draw. Otherwise SampleToken draws exactly once.
bool IsGreedy(const SamplingParams& params);

// Picks the next token. `logits` ([vocab]) is modified in place (penalties, scaling).
// `context` holds the prompt and generated tokens the repetition penalty applies to.
// Ties break toward the lower token id, so greedy decoding is reproducible. NaN logits are
// treated as -inf.
int32_t SampleToken(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> context, std::mt19937_64& rng);

// Turns raw logits ([vocab]) into log-probabilities in place, for the logprobs a response
// reports: log_softmax, with NaN as -inf (as SampleToken treats it). Logits of +inf share all
// the probability (log(1 / their count) each, -inf for the rest); a row with no finite or +inf
// logit is uniform. Every result is a number, so callers may sort by it.
void LogSoftmaxInPlace(std::span<float> logits);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_SAMPLER_H_
