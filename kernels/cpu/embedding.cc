#include "kernels/cpu/embedding.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels::cpu {

absl::Status EmbeddingParams::Validate() const {
  if ((!table && !blocks) || !output || (!ids && num_tokens > 0)) {
    return absl::InvalidArgumentError("EmbeddingParams: null table, ids or output");
  }
  if (vocab <= 0 || hidden <= 0 || num_tokens < 0) {
    return absl::InvalidArgumentError("EmbeddingParams: bad vocab, hidden or num_tokens");
  }
  if (blocks && (table || blocks->rows != vocab || blocks->cols != hidden ||
                 blocks->dtype == WeightDType::kF32 || !blocks->input_perm.empty() ||
                 static_cast<int64_t>(blocks->data.size()) != vocab * blocks->RowBytes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EmbeddingParams: blocks of [", blocks->rows, ", ", blocks->cols,
        "] are not a [vocab, hidden] table of [", vocab, ", ", hidden, "] (or a table too)"));
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[t], " at index ", t,
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Embedding(const EmbeddingParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.blocks) {
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      DequantizeRow(*p.blocks, p.ids[t], p.output + t * p.hidden);
    }
    return absl::OkStatus();
  }
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    std::memcpy(p.output + t * p.hidden, p.table + static_cast<int64_t>(p.ids[t]) * p.hidden,
                sizeof(float) * p.hidden);
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
