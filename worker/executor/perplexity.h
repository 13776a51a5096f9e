// Held-out evaluation of a model through the paged KV cache, so the KV dtype's effect on
// quality is what is measured.
//
// `tokens` are cut into consecutive, non-overlapping windows of `window` tokens (the last may
// be shorter); each window starts from an empty cache, its first token is context only, and
// every later token is predicted from the tokens before it in the window. Windows are fed in
// chunks of `chunk` tokens, each chunk attending to the earlier ones in the cache.
#ifndef KVGRID_WORKER_EXECUTOR_PERPLEXITY_H_
#define KVGRID_WORKER_EXECUTOR_PERPLEXITY_H_

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::worker {

struct EvaluationOptions {
  int64_t window = 512;
  int64_t chunk = 128;
  int64_t block_size = 16;
  kernels::KvDType k_dtype = kernels::KvDType::kF32;
  kernels::KvDType v_dtype = kernels::KvDType::kF32;
  bool keep_argmax = false;  // record the most likely token at every predicted position
};

struct EvaluationResult {
  double nll = 0.0;            // summed negative log-likelihood (nats)
  int64_t predicted = 0;       // tokens predicted
  double perplexity = 0.0;     // exp(nll / predicted)
  std::vector<int32_t> argmax; // [predicted] when keep_argmax
};

// Errors: INVALID_ARGUMENT for window < 2, chunk < 1, fewer than 2 tokens, or a token outside
// the vocabulary (naming its index); errors of the forward pass as they are.
absl::StatusOr<EvaluationResult> EvaluateTokens(LlamaModel& model, std::span<const int32_t> tokens,
                                                const EvaluationOptions& options);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_PERPLEXITY_H_
