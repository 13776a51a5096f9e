// Token embedding lookup.
#ifndef KVGRID_KERNELS_CPU_EMBEDDING_H_
#define KVGRID_KERNELS_CPU_EMBEDDING_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cpu {

struct EmbeddingParams {
  const float* table = nullptr;    // [vocab, hidden]
  const int32_t* ids = nullptr;    // [num_tokens]
  float* output = nullptr;         // [num_tokens, hidden]
  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t num_tokens = 0;

  absl::Status Validate() const;
};

// Errors: INVALID_ARGUMENT for an id outside [0, vocab), naming the id and its index.
absl::Status Embedding(const EmbeddingParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_EMBEDDING_H_
