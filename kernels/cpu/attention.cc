#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::kernels::cpu {

absl::Status PagedAttentionParams::Validate() const {
  if (!query || !output || !k_cache || !v_cache || !block_tables || !seq_lens || !query_start) {
    return absl::InvalidArgumentError("PagedAttentionParams: null pointer");
  }
  if (num_seqs < 0 || num_tokens < 0 || max_blocks_per_seq <= 0 || num_blocks <= 0 ||
      num_heads <= 0 || num_kv_heads <= 0 || block_size <= 0 || head_dim <= 0 ||
      head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        "PagedAttentionParams: sizes out of range (head_dim must be even)");
  }
  for (auto [meta, dtype, name] : {std::tuple{k_meta, k_dtype, "k_meta"},
                                   std::tuple{v_meta, v_dtype, "v_meta"}}) {
    if (KvRowLayoutFor(dtype, head_dim).meta_bytes > 0 && !meta) {
      return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams.", name,
                                                     ": required for ",
                                                     std::string(KvDTypeName(dtype))));
    }
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

// Blocks are scattered, so the hardware prefetcher loses the stream at every block boundary
// and each block would start with a DRAM round trip; ask for the block after next early.
constexpr int64_t kPrefetchBlocks = 2;

inline void Prefetch(const std::byte* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

}  // namespace

absl::Status PagedAttention(const PagedAttentionParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const VecOps& vec = Vec();
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hd = p.head_dim;
  const int64_t bs = p.block_size;
  const KvRowLayout kl = KvRowLayoutFor(p.k_dtype, hd);
  const KvRowLayout vl = KvRowLayoutFor(p.v_dtype, hd);
  const KvRowKernels kk = KvRowKernelsFor(p.k_dtype);
  const KvRowKernels vk = KvRowKernelsFor(p.v_dtype);
  const auto* k_values = static_cast<const std::byte*>(p.k_cache);
  const auto* v_values = static_cast<const std::byte*>(p.v_cache);
  const auto* k_meta = static_cast<const std::byte*>(p.k_meta);
  const auto* v_meta = static_cast<const std::byte*>(p.v_meta);

  // Map each query token to its sequence once.
  std::vector<int32_t> token_seq(p.num_tokens);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    for (int32_t t = p.query_start[s]; t < p.query_start[s + 1]; ++t) token_seq[t] = s;
  }

  const int64_t work = p.num_tokens * p.num_kv_heads;
#pragma omp parallel if (work > 1)
  {
    std::vector<float> scores;   // [group, ctx]
    std::vector<float> inv_sum;  // [group]
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

      // One block's rows of KV head g are consecutive in both planes.
      auto first_row = [&](int64_t j) { return (table[j / bs] * p.num_kv_heads + g) * bs; };
      auto prefetch = [&](const std::byte* values, const std::byte* meta, const KvRowLayout& l,
                          int64_t j) {
        const int64_t ahead = j + kPrefetchBlocks * bs;
        if (ahead >= ctx) return;
        const int64_t row = first_row(ahead);
        const int64_t rows = std::min(bs, ctx - ahead);
        Prefetch(values + row * l.value_bytes, rows * l.value_bytes);
        if (meta) Prefetch(meta + row * l.meta_bytes, rows * l.meta_bytes);
      };
      const float* q = p.query + (t * p.num_heads + g * group) * hd;
      for (int64_t j = 0; j < ctx; j += bs) {
        prefetch(k_values, k_meta, kl, j);
        const int64_t row = first_row(j);
        kk.dot(k_values + row * kl.value_bytes, k_meta ? k_meta + row * kl.meta_bytes : nullptr,
               hd, std::min(bs, ctx - j), q, group, scores.data() + j, ctx);
      }
      // Unnormalized softmax weights; the output is divided by their sum at the end.
      inv_sum.resize(group);
      for (int64_t h = 0; h < group; ++h) {
        float* w = scores.data() + h * ctx;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < ctx; ++j) max = std::max(max, w[j]);
        inv_sum[h] = 1.f / vec.exp_sum(w, ctx, p.scale, p.scale * max);
      }
      float* out = p.output + (t * p.num_heads + g * group) * hd;
      std::memset(out, 0, sizeof(float) * group * hd);
      for (int64_t j = 0; j < ctx; j += bs) {
        prefetch(v_values, v_meta, vl, j);
        const int64_t row = first_row(j);
        vk.axpy(v_values + row * vl.value_bytes, v_meta ? v_meta + row * vl.meta_bytes : nullptr,
                hd, std::min(bs, ctx - j), scores.data() + j, group, ctx, out);
      }
      for (int64_t h = 0; h < group; ++h) {
        for (int64_t i = 0; i < hd; ++i) out[h * hd + i] *= inv_sum[h];
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
