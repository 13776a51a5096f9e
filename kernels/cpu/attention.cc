#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::kernels::cpu {

absl::Status PagedAttentionParams::Validate() const {
  if (!query || !output || !k_cache || !v_cache || !block_tables || !seq_lens || !query_start) {
    return absl::InvalidArgumentError("PagedAttentionParams: null pointer");
  }
  if (num_seqs < 0 || num_tokens < 0 || max_blocks_per_seq <= 0 || num_blocks <= 0 ||
      num_heads <= 0 || num_kv_heads <= 0 || block_size <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError("PagedAttentionParams: sizes out of range");
  }
  if (num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams: num_heads ", num_heads,
                                                   " not divisible by num_kv_heads ",
                                                   num_kv_heads));
  }
  if (query_start[0] != 0 || query_start[num_seqs] != num_tokens) {
    return absl::InvalidArgumentError(
        "PagedAttentionParams.query_start must start at 0 and end at num_tokens");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s];
    if (q_len < 0 || q_len > seq_lens[s]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PagedAttentionParams: sequence ", s, " has ", q_len, " queries for a context of ",
          seq_lens[s]));
    }
    const int64_t blocks = (static_cast<int64_t>(seq_lens[s]) + block_size - 1) / block_size;
    if (blocks > max_blocks_per_seq) {
      return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams: sequence ", s,
                                                     " needs ", blocks, " blocks, table has ",
                                                     max_blocks_per_seq));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id = block_tables[s * max_blocks_per_seq + b];
      if (id < 0 || id >= num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams.block_tables[", s,
                                                       "][", b, "] = ", id,
                                                       " is outside the arena"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// Returns a pointer to `n` floats of the row at element offset `elem`: the row itself for fp32,
// else `scratch` after conversion.
inline const float* LoadRow(const void* cache, KvDType dtype, int64_t elem, int64_t n,
                            float* scratch, const VecOps& vec) {
  switch (dtype) {
    case KvDType::kF32:
      return static_cast<const float*>(cache) + elem;
    case KvDType::kF16:
      vec.f16_to_f32(static_cast<const uint16_t*>(cache) + elem, scratch, n);
      return scratch;
  }
  return scratch;
}

}  // namespace

absl::Status PagedAttention(const PagedAttentionParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const VecOps& vec = Vec();
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hd = p.head_dim;

  // Map each query token to its sequence once.
  std::vector<int32_t> token_seq(p.num_tokens);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    for (int32_t t = p.query_start[s]; t < p.query_start[s + 1]; ++t) token_seq[t] = s;
  }

  const int64_t work = p.num_tokens * p.num_kv_heads;
#pragma omp parallel if (work > 1)
  {
    std::vector<float> scores;
    std::vector<float> k_scratch(hd), v_scratch(hd);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < work; ++item) {
      const int64_t t = item / p.num_kv_heads;
      const int64_t g = item % p.num_kv_heads;
      const int64_t s = token_seq[t];
      const int64_t q_len = p.query_start[s + 1] - p.query_start[s];
      const int64_t pos = p.seq_lens[s] - q_len + (t - p.query_start[s]);
      const int64_t ctx = pos + 1;
      const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
      scores.resize(group * ctx);

      const float* q = p.query + (t * p.num_heads + g * group) * hd;
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t block = table[j / p.block_size];
        const int64_t elem = ((block * p.num_kv_heads + g) * p.block_size + j % p.block_size) * hd;
        const float* k = LoadRow(p.k_cache, p.k_dtype, elem, hd, k_scratch.data(), vec);
        for (int64_t h = 0; h < group; ++h) scores[h * ctx + j] = vec.dot(q + h * hd, k, hd) * p.scale;
      }
      for (int64_t h = 0; h < group; ++h) {
        float* row = scores.data() + h * ctx;
        const float max = *std::max_element(row, row + ctx);
        float sum = 0.f;
        for (int64_t j = 0; j < ctx; ++j) {
          row[j] = std::exp(row[j] - max);
          sum += row[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < ctx; ++j) row[j] *= inv;
      }
      float* out = p.output + (t * p.num_heads + g * group) * hd;
      std::memset(out, 0, sizeof(float) * group * hd);
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t block = table[j / p.block_size];
        const int64_t elem = ((block * p.num_kv_heads + g) * p.block_size + j % p.block_size) * hd;
        const float* v = LoadRow(p.v_cache, p.v_dtype, elem, hd, v_scratch.data(), vec);
        for (int64_t h = 0; h < group; ++h) vec.axpy(scores[h * ctx + j], v, out + h * hd, hd);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
