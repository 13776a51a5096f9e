// Token embedding lookup, from an fp32 table or from one in quantized blocks (a GGUF file's
// Q8_0/Q4_K/Q6_K... token_embd, kept as stored): then only the rows looked up are decoded.
#ifndef KVGRID_KERNELS_CPU_EMBEDDING_H_
#define KVGRID_KERNELS_CPU_EMBEDDING_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/quant_linear.h"

namespace kvgrid::kernels::cpu {

struct EmbeddingParams {
  const float* table = nullptr;    // [vocab, hidden], or null when `blocks` is given
  const QuantMatrix* blocks = nullptr;  // [vocab, hidden] in blocks (no input_perm), or null
  const int32_t* ids = nullptr;    // [num_tokens]
  float* output = nullptr;         // [num_tokens, hidden]
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t num_tokens = 0;

  absl::Status Validate() const;
};

// output[t] = row ids[t] of the table (decoded as DequantizeRow does for `blocks`).
// Errors: INVALID_ARGUMENT for an id outside [0, vocab), naming the id and its index, or for
// blocks that are not [vocab, hidden].
absl::Status Embedding(const EmbeddingParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_EMBEDDING_H_
