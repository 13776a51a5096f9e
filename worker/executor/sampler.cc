#include "worker/executor/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::worker {

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: must be a finite number >= 0, got ", temperature));
  }
  if (!(top_p > 0.0 && top_p <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p: must be in (0, 1], got ", top_p));
  }
  if (top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: must be >= 0 (0 = off), got ", top_k));
  }
  if (!(min_p >= 0.0 && min_p <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p: must be in [0, 1], got ", min_p));
  }
  if (!(repetition_penalty > 0.0) || !std::isfinite(repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty: must be > 0, got ", repetition_penalty));
  }
  if (logprobs < -1 || logprobs > 20) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs: must be in [-1, 20] (-1 = none), got ", logprobs));
  }
  if (!(std::abs(presence_penalty) <= kMaxPenalty)) {  // NaN fails too
    return absl::InvalidArgumentError(absl::StrCat("presence_penalty: must be in [-", kMaxPenalty,
                                                   ", ", kMaxPenalty, "], got ",
                                                   presence_penalty));
  }
  if (!(std::abs(frequency_penalty) <= kMaxPenalty)) {
    return absl::InvalidArgumentError(absl::StrCat("frequency_penalty: must be in [-",
                                                   kMaxPenalty, ", ", kMaxPenalty, "], got ",
                                                   frequency_penalty));
  }
  if (static_cast<int64_t>(logit_bias.size()) > kMaxLogitBiasEntries) {
    return absl::InvalidArgumentError(absl::StrCat("logit_bias: at most ", kMaxLogitBiasEntries,
                                                   " entries, got ", logit_bias.size()));
  }
  absl::flat_hash_set<int32_t> biased;
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token id ", id, " is outside the vocabulary"));
    }
    if (!(std::abs(bias) <= kMaxLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias[", id, "]: must be in [-",
                                                     kMaxLogitBias, ", ", kMaxLogitBias,
                                                     "], got ", bias));
    }
    if (!biased.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token id ", id, " is given more than once"));
    }
  }
  return absl::OkStatus();
}

namespace {

// A float's bits mapped so that unsigned order is the floats' order (NaN excluded); -0 maps
// as +0, which compares equal to it.
uint32_t OrderedBits(float x) {
  uint32_t u;
  const float canonical = x == 0.f ? 0.f : x;
  std::memcpy(&u, &canonical, sizeof(u));
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// Uniform double in [0, 1) from 53 random bits: the same on every platform.
double UniformUnit(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
}

}  // namespace

bool IsGreedy(const SamplingParams& params) { return params.temperature < 1e-5; }

void ApplyPenalties(std::span<float> logits, const SamplingParams& p,
                    const TokenHistory& history) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  for (const auto& [id, bias] : p.logit_bias) {
    if (in_vocab(id)) logits[id] += bias;
  }
  // Each id is touched once, so the sets' iteration order cannot change the result.
  if (p.repetition_penalty != 1.0) {
    const float penalty = static_cast<float>(p.repetition_penalty);
    for (int32_t id : history.seen()) {
      if (!in_vocab(id)) continue;
      logits[id] = logits[id] > 0 ? logits[id] / penalty : logits[id] * penalty;
    }
  }
  if (p.frequency_penalty != 0.0 || p.presence_penalty != 0.0) {
    const float frequency = static_cast<float>(p.frequency_penalty);
    const float presence = static_cast<float>(p.presence_penalty);
    for (const auto& [id, count] : history.output_counts()) {
      if (!in_vocab(id)) continue;
      logits[id] -= frequency * static_cast<float>(count);
      logits[id] -= presence;
    }
  }
}

int32_t SampleToken(std::span<float> logits, const SamplingParams& p,
                    const TokenHistory& history, std::mt19937_64& rng) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  ApplyPenalties(logits, p, history);
  // Very low temperatures are greedy: exp((l - max) / T) would underflow or produce NaN. One
  // vectorized pass over the row (NaN as -inf, ties to the lower id): the argmax of a 152k
  // vocabulary is serial work in every decode step, once per sequence.
  if (IsGreedy(p)) {
    return static_cast<int32_t>(kernels::cpu::Vec().argmax(logits.data(), vocab));
  }
  // NaN would break the orderings below; it can only come from a broken checkpoint or an
  // overflowing cache, and such a token must never be picked.
  for (float& x : logits) {
    if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
  }
  // Exactly one draw per sampled token, whatever the logits, so a resumed stream can skip
  // ahead by the number of tokens (see Engine's resume_tokens).
  const double unit = UniformUnit(rng);

  // Candidates sorted by logit (descending, ties by id); top-k cuts the list first so the
  // common case sorts only k entries. Each candidate is one 64-bit key, the logit's order
  // inverted above the id, so the sort compares integers in place instead of chasing ids into
  // the logits (a vocabulary of 152k: 12.6 -> 8.3 ms on a Sapphire Rapids-class core).
  std::vector<uint64_t> keys(vocab);
  for (int32_t id = 0; id < vocab; ++id) {
    keys[id] = static_cast<uint64_t>(~OrderedBits(logits[id])) << 32 | static_cast<uint32_t>(id);
  }
  int32_t keep = vocab;
  if (p.top_k > 0 && p.top_k < vocab) {
    keep = static_cast<int32_t>(p.top_k);
    std::nth_element(keys.begin(), keys.begin() + keep, keys.end());
    keys.resize(keep);
  }
  std::sort(keys.begin(), keys.end());
  std::vector<int32_t> ids(keep);
  for (int32_t i = 0; i < keep; ++i) ids[i] = static_cast<int32_t>(keys[i] & 0xFFFFFFFFu);
  if (!std::isfinite(logits[ids[0]])) return ids[0];  // +inf wins outright; all -inf: lowest id

  // Softmax over the candidates at the given temperature.
  const double inv_t = 1.0 / p.temperature;
  const double max = logits[ids[0]];
  std::vector<double> probs(keep);
  double sum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    probs[i] = std::exp((logits[ids[i]] - max) * inv_t);
    sum += probs[i];
  }
  for (double& q : probs) q /= sum;

  // top-p: the smallest prefix whose mass reaches top_p (always at least one token).
  if (p.top_p < 1.0) {
    double mass = 0.0;
    int32_t cut = 0;
    while (cut < keep) {
      mass += probs[cut++];
      if (mass >= p.top_p) break;
    }
    keep = cut;
  }
  // min-p: relative to the most likely token.
  if (p.min_p > 0.0) {
    const double floor = p.min_p * probs[0];
    int32_t cut = 1;
    while (cut < keep && probs[cut] >= floor) ++cut;
    keep = cut;
  }

  double total = 0.0;
  for (int32_t i = 0; i < keep; ++i) total += probs[i];
  const double u = unit * total;
  double acc = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (u < acc) return ids[i];
  }
  return ids[keep - 1];
}

void LogSoftmaxInPlace(std::span<float> logits) {
  if (logits.empty()) return;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float max = -kInf;
  int64_t num_inf = 0;
  for (float& x : logits) {
    if (std::isnan(x)) x = -kInf;
    max = std::max(max, x);
    if (x == kInf) ++num_inf;
  }
  if (max == kInf) {
    const float share = -std::log(static_cast<float>(num_inf));
    for (float& x : logits) x = x == kInf ? share : -kInf;
    return;
  }
  if (max == -kInf) {
    const float uniform = -std::log(static_cast<float>(logits.size()));
    for (float& x : logits) x = uniform;
    return;
  }
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  const float log_z = max + static_cast<float>(std::log(sum));
  for (float& x : logits) x -= log_z;
}

}  // namespace kvgrid::worker
