#include "worker/executor/perplexity.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

absl::StatusOr<EvaluationResult> EvaluateTokens(LlamaModel& model, std::span<const int32_t> tokens,
                                                const EvaluationOptions& o) {
  const int64_t ctx = model.config().max_position_embeddings;
  if (o.window < 2 || o.window > ctx) {
    return absl::InvalidArgumentError(
        absl::StrCat("window: must be in [2, ", ctx, "], got ", o.window));
  }
  if (o.chunk < 1) return absl::InvalidArgumentError("chunk: must be >= 1");
  if (tokens.size() < 2) return absl::InvalidArgumentError("need at least 2 tokens");
  const int64_t vocab = model.config().vocab_size;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " (id ", tokens[i],
                                                     ") is outside the vocabulary of ", vocab));
    }
  }

  const KvGeometry geometry = model.KvGeometryFor(o.block_size, o.k_dtype, o.v_dtype);
  const int64_t blocks = (o.window + o.block_size - 1) / o.block_size;
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<KvPool> pool,
                          KvPool::Create(geometry, blocks * geometry.BytesPerBlock()));
  EvaluationResult result;
  std::vector<float> logits;
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t start = 0; start + 1 < n; start += o.window) {
    const int64_t len = std::min(o.window, n - start);
    BlockManager manager(pool->num_blocks(), static_cast<int32_t>(o.block_size));
    constexpr SequenceId kSeq = 1;
    KVGRID_RETURN_IF_ERROR(manager.Reserve(kSeq, len));
    for (int64_t c0 = 0; c0 < len; c0 += o.chunk) {
      const int64_t c1 = std::min(len, c0 + o.chunk);
      ForwardBatch b =
          SingleSequenceBatch(manager, kSeq, c0, tokens.subspan(start + c0, c1 - c0));
      // Every position predicts the next token, except the window's last.
      b.logit_rows.clear();
      for (int64_t pos = c0; pos < c1 && pos + 1 < len; ++pos) {
        b.logit_rows.push_back(static_cast<int32_t>(pos - c0));
      }
      KVGRID_RETURN_IF_ERROR(model.Forward(b, *pool, &logits));
      for (size_t r = 0; r < b.logit_rows.size(); ++r) {
        const int64_t pos = c0 + b.logit_rows[r];
        const float* row = logits.data() + r * vocab;
        const float* best = std::max_element(row, row + vocab);
        double sum = 0.0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - *best);
        result.nll += (*best + std::log(sum)) - row[tokens[start + pos + 1]];
        ++result.predicted;
        if (o.keep_argmax) result.argmax.push_back(static_cast<int32_t>(best - row));
      }
    }
  }
  result.perplexity = std::exp(result.nll / static_cast<double>(result.predicted));
  return result;
}

}  // namespace kvgrid::worker
