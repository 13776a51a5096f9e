// Token sampling from one sequence's logits: logit bias, repetition, frequency and presence
// penalties, then temperature, top-k, top-p and min-p, then a draw from the sequence's own
// random stream — so a seeded request samples the same tokens whatever else is in the batch.
// Temperature 0 is greedy (after the bias and penalties, as in vLLM).
#ifndef KVGRID_WORKER_EXECUTOR_SAMPLER_H_
#define KVGRID_WORKER_EXECUTOR_SAMPLER_H_

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/executor/token_history.h"

namespace kvgrid::worker {

// OpenAI's bounds: penalties in [-kMaxPenalty, kMaxPenalty], biases in [-kMaxLogitBias,
// kMaxLogitBias]. At most kMaxLogitBiasEntries biased tokens (OpenAI documents no count; this
// bounds the per-step work and the request size, and is far more than a ban list needs).
inline constexpr double kMaxPenalty = 2.0;
inline constexpr double kMaxLogitBias = 100.0;
inline constexpr int64_t kMaxLogitBiasEntries = 1024;

struct SamplingParams {
  double temperature = 1.0;         // 0 (or below 1e-5) = greedy
  double top_p = 1.0;               // (0, 1]
  int64_t top_k = 0;                // 0 = off
  double min_p = 0.0;               // [0, 1]: drop tokens below min_p * p(top token)
  double repetition_penalty = 1.0;  // > 0; 1 = off (HF semantics: divide positive logits)
  std::optional<uint64_t> seed;     // absent: drawn from the OS
  int64_t logprobs = -1;            // -1: none; k >= 0: chosen token's plus the top k (<= 20)
  // OpenAI's penalties over the generated tokens only (not the prompt, as in vLLM); 0 = off.
  double presence_penalty = 0.0;    // [-2, 2]: once per distinct generated id
  double frequency_penalty = 0.0;   // [-2, 2]: once per occurrence in the output
  // (token id, bias added to its logit), distinct ids; biases in [-100, 100]. Ids must be in
  // the vocabulary, which Validate cannot know: the engine checks them.
  std::vector<std::pair<int32_t, float>> logit_bias;

  // INVALID_ARGUMENT naming the field (e.g. "top_p: must be in (0, 1], got 1.5").
  absl::Status Validate() const;
};

// Temperature below 1e-5: argmax, no random draw. Otherwise SampleToken draws exactly once.
bool IsGreedy(const SamplingParams& params);

// What SampleToken does to `logits` ([vocab]) before it samples, in vLLM's order: adds
// logit_bias; divides positive logits of the ids in history.seen() by the repetition penalty
// and multiplies negative ones; then, for each generated id t with count c,
// logits[t] -= frequency_penalty * c, then logits[t] -= presence_penalty (float arithmetic).
// Work is proportional to the bias entries and the distinct ids in `history`, never to the
// vocabulary. Ids outside `logits` are skipped.
void ApplyPenalties(std::span<float> logits, const SamplingParams& params,
                    const TokenHistory& history);

// Picks the next token. `logits` ([vocab]) is modified in place (ApplyPenalties, scaling).
// `history` is the sequence's tokens as the penalties see them; it must track what `params`
// need (TokenHistory(params, prompt), then AddOutput per token). The bias and penalties never
// consume random draws, so a seeded stream stays aligned with or without them.
// Ties break toward the lower token id, so greedy decoding is reproducible. NaN logits are
// treated as -inf.
int32_t SampleToken(std::span<float> logits, const SamplingParams& params,
                    const TokenHistory& history, std::mt19937_64& rng);

// Turns raw logits ([vocab]) into log-probabilities in place, for the logprobs a response
// reports: log_softmax, with NaN as -inf (as SampleToken treats it). Logits of +inf share all
// the probability (log(1 / their count) each, -inf for the rest); a row with no finite or +inf
// logit is uniform. Every result is a number, so callers may sort by it.
void LogSoftmaxInPlace(std::span<float> logits);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_SAMPLER_H_
