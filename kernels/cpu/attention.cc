#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <omp.h>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::kernels::cpu {
namespace {

// First position a query with `ctx` positions of context (it sits at ctx - 1) attends to.
int64_t WindowStart(int64_t ctx, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
}

}  // namespace

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
  if (window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedAttentionParams.window: must be >= 0, got ", window));
  }
  if (cp_size < 1 || cp_rank < 0 || cp_rank >= cp_size) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams.cp_rank: ", cp_rank,
                                                   " is not a rank of cp_size ", cp_size));
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
    // The first query sees the lowest keys; blocks before its window may be holes.
    const int64_t first_key = WindowStart(seq_lens[s] - q_len + 1, window);
    for (int64_t b = first_key / block_size; b < blocks; ++b) {
      if (b % cp_size != cp_rank) continue;  // another rank's block
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
// and each block would start with a DRAM round trip. Each kernel call is handed the rows the
// thread reads soon after (the kernels' `ahead`): the same KV head's rows of this rank's next
// block, and after the K pass's last block the V pass's first. The AVX-512 float kernels ask for
// them a line at a time through their arithmetic; asked for all at once into L1 before each
// call, the requests waited for the core's few fill buffers and the arithmetic waited behind
// them. With the K/V in DRAM (attention_bench --flush-mb 256, 14 heads over 2 KV heads,
// 2,048 positions, bench/RESULTS.md) that took fp16 from 0.101 to 0.092 ms a call and fp32 from
// 0.142 to 0.128. In a later run, asking into L2 rather than L1 (kernels/cpu/prefetch.h) took
// fp16 from 0.101 to 0.094 and fp32 from 0.135 to 0.123.

// Queries of decode-like sequences (at most kMaxSplitQueries query tokens) are work items of
// all KV heads at once: an item walks its blocks reading each block's rows of every head,
// which lie next to each other in the arena, so each block is one long stream for the
// hardware prefetcher instead of num_kv_heads short ones (at 8K context this made int8
// decode ~1.5x faster on one core). Long contexts are split into chunks of at most
// kChunkTokens positions (fewer when the batch is small, so each thread gets about
// kItemsPerThread items; at least kMinChunkTokens), which keeps an item's scores in L2 and
// balances the threads; each chunk keeps its own softmax maximum and sum and a final pass
// merges them.
constexpr int64_t kMaxSplitQueries = 8;
constexpr int64_t kChunkTokens = 512;
constexpr int64_t kMinChunkTokens = 64;
constexpr int64_t kItemsPerThread = 4;

// Positions [begin, end) of query token t's context, for KV heads [g_begin, g_end). `part` < 0:
// the item covers the whole context and writes the output; otherwise it covers all KV heads
// and writes partial results number `part`.
struct WorkItem {
  int64_t t, g_begin, g_end, begin, end, part;
};

// log(sum_j exp(scale * s_j)) from the highest score and sum_j exp(scale * (s_j - max)); -inf
// when nothing was attended.
inline float LogSumExp(float scale, float max, float sum) {
  return sum == 0.f ? -std::numeric_limits<float>::infinity() : scale * max + std::log(sum);
}

}  // namespace

absl::Status PagedAttention(const PagedAttentionParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const VecOps& vec = Vec();
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t hd = p.head_dim;
  const int64_t bs = p.block_size;
  const int64_t nh = p.num_heads;
  const KvRowLayout kl = KvRowLayoutFor(p.k_dtype, hd);
  const KvRowLayout vl = KvRowLayoutFor(p.v_dtype, hd);
  const KvRowKernels kk = KvRowKernelsFor(p.k_dtype, p.precision);
  const KvRowKernels vk = KvRowKernelsFor(p.v_dtype, p.precision);
  const auto* k_values = static_cast<const std::byte*>(p.k_cache);
  const auto* v_values = static_cast<const std::byte*>(p.v_cache);
  const auto* k_meta = static_cast<const std::byte*>(p.k_meta);
  const auto* v_meta = static_cast<const std::byte*>(p.v_meta);

  // Map each query token to its sequence once, and cut the work into items.
  std::vector<int32_t> token_seq(p.num_tokens);
  std::vector<WorkItem> items;
  items.reserve(p.num_tokens * p.num_kv_heads);
  // Split query tokens: their first partial index and number of chunks.
  struct Split {
    int64_t t, first_part, parts;
  };
  std::vector<Split> splits;
  int64_t num_parts = 0;
  int64_t split_positions = 0;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = p.query_start[s + 1] - p.query_start[s];
    if (q_len <= kMaxSplitQueries) {
      const int64_t seen = p.window > 0 ? std::min<int64_t>(p.window, p.seq_lens[s])
                                        : p.seq_lens[s];
      split_positions += q_len * seen;
    }
  }
  const int64_t threads = omp_get_max_threads();
  const int64_t chunk_tokens = std::clamp(split_positions / (kItemsPerThread * threads),
                                          kMinChunkTokens, kChunkTokens);
  const int64_t chunk_blocks = std::max<int64_t>(1, chunk_tokens / bs);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = p.query_start[s + 1] - p.query_start[s];
    for (int64_t t = p.query_start[s]; t < p.query_start[s + 1]; ++t) {
      token_seq[t] = static_cast<int32_t>(s);
      const int64_t ctx = p.seq_lens[s] - q_len + (t - p.query_start[s]) + 1;
      const int64_t lo = WindowStart(ctx, p.window);
      if (q_len > kMaxSplitQueries) {
        for (int64_t g = 0; g < p.num_kv_heads; ++g) items.push_back({t, g, g + 1, lo, ctx, -1});
        continue;
      }
      const int64_t base = lo / bs * bs;  // chunks cut at block boundaries
      const int64_t blocks = (ctx - base + bs - 1) / bs;
      const int64_t chunks = (blocks + chunk_blocks - 1) / chunk_blocks;
      if (chunks == 1) {
        items.push_back({t, 0, p.num_kv_heads, lo, ctx, -1});
        continue;
      }
      // Even chunks, whole blocks each (the first starts at the window).
      const int64_t per = (blocks + chunks - 1) / chunks * bs;
      int64_t parts = 0;
      for (int64_t b = base; b < ctx; b += per) {
        items.push_back({t, 0, p.num_kv_heads, std::max(b, lo), std::min(ctx, b + per),
                         num_parts + parts});
        ++parts;
      }
      splits.push_back({t, num_parts, parts});
      num_parts += parts;
    }
  }
  std::vector<float> part_out(num_parts * nh * hd);  // [num_parts, num_heads, head_dim]
  std::vector<float> part_max(num_parts * nh);       // [num_parts, num_heads]
  std::vector<float> part_sum(num_parts * nh);       // [num_parts, num_heads]

  const int64_t work = static_cast<int64_t>(items.size());
#pragma omp parallel if (work > 1)
  {
    std::vector<float> scores;  // [heads of the item, len]
    std::vector<float> sums;    // [heads of the item]
    std::vector<float> maxes;   // [heads of the item]: the highest score
    std::vector<std::byte> prepared_buffer;  // the item's queries as kk.prepare_query left them
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < work; ++it) {
      const WorkItem& w = items[it];
      const int64_t t = w.t;
      const int64_t g0 = w.g_begin;
      const int64_t ng = w.g_end - w.g_begin;
      const int64_t s = token_seq[t];
      const int64_t begin = w.begin;
      const int64_t end = w.end;
      const int64_t len = end - begin;
      const int64_t heads = ng * group;
      const int32_t* table = p.block_tables + s * p.max_blocks_per_seq;
      scores.resize(heads * len);

      // One block's rows of KV heads g0.. are consecutive in both planes; position j is row
      // j % bs of its block (a window may start mid-block).
      auto first_row = [&](int64_t j) {
        return (table[j / bs] * p.num_kv_heads + g0) * bs + j % bs;
      };
      // Positions [j, next_block(j)) lie in one block.
      auto next_block = [bs](int64_t j) { return (j / bs + 1) * bs; };
      // Whether position j's block is this rank's (always, without context parallelism).
      auto local = [&](int64_t j) { return (j / bs) % p.cp_size == p.cp_rank; };
      // KV head g0 + g's rows from position j's (in the same block) in a plane.
      auto rows_at = [&](const std::byte* values, const std::byte* meta, const KvRowLayout& l,
                         int64_t j, int64_t g) {
        const int64_t row = first_row(j) + g * bs;
        return KvRows{values + row * l.value_bytes, meta ? meta + row * l.meta_bytes : nullptr};
      };
      // This rank's first position at or after `begin`, or `end` when it has none.
      const int64_t first_local = [&] {
        const int64_t b = begin / bs;
        const int64_t skip = ((p.cp_rank - b) % p.cp_size + p.cp_size) % p.cp_size;
        return skip == 0 ? begin : std::min(end, (b + skip) * bs);
      }();
      // What the thread reads after KV head g0 + g's `rows` rows of position j's block in the
      // K pass (`k_pass`) or the V pass, starting where `rows` rows stay inside the block.
      auto ahead = [&](bool k_pass, int64_t j, int64_t g, int64_t rows) {
        const int64_t next = (j / bs + p.cp_size) * bs;  // this rank's next block
        if (next < end) {
          return k_pass ? rows_at(k_values, k_meta, kl, next, g)
                        : rows_at(v_values, v_meta, vl, next, g);
        }
        if (k_pass && first_local < end) {
          const int64_t block = first_local / bs * bs;
          return rows_at(v_values, v_meta, vl, std::min(first_local, block + bs - rows), g);
        }
        return KvRows{};
      };
      const float* q = p.query + (t * nh + g0 * group) * hd;
      // Kernels that round the queries do it once per item, not once per block.
      std::byte* prepared = nullptr;
      if (kk.prepare_query) {
        const size_t bytes = heads * kk.prepared_query_bytes;
        prepared_buffer.resize(bytes + 64);
        void* aligned = prepared_buffer.data();
        size_t space = prepared_buffer.size();
        prepared = static_cast<std::byte*>(std::align(64, bytes, aligned, space));
        if (!kk.prepare_query(q, hd, heads, prepared)) prepared = nullptr;
      }
      for (int64_t j = begin; j < end; j = next_block(j)) {
        const int64_t rows = std::min(next_block(j), end) - j;
        if (!local(j)) {
          // Another rank's positions take no weight.
          for (int64_t h = 0; h < heads; ++h) {
            std::fill_n(scores.data() + h * len + (j - begin), rows,
                        -std::numeric_limits<float>::infinity());
          }
          continue;
        }
        for (int64_t g = 0; g < ng; ++g) {
          const KvRows own = rows_at(k_values, k_meta, kl, j, g);
          float* sc = scores.data() + g * group * len + (j - begin);
          if (prepared) {
            kk.dot_prepared(own.values, own.meta, hd, rows,
                            prepared + g * group * kk.prepared_query_bytes, group, sc, len,
                            ahead(true, j, g, rows));
          } else {
            kk.dot(own.values, own.meta, hd, rows, q + g * group * hd, group, sc, len,
                   ahead(true, j, g, rows));
          }
        }
      }
      // Unnormalized softmax weights; the output is divided by their sum at the end.
      sums.resize(heads);
      maxes.resize(heads);
      for (int64_t h = 0; h < heads; ++h) {
        float* sc = scores.data() + h * len;
        const float max = vec.max(sc, len);
        maxes[h] = max;
        if (p.cp_size > 1 && max == -std::numeric_limits<float>::infinity()) {
          // No position of this rank (a NaN score keeps max at -inf too, and without context
          // parallelism propagates as before).
          std::fill_n(sc, len, 0.f);
          sums[h] = 0.f;
          continue;
        }
        if (p.cp_size == 1) {
          sums[h] = vec.exp_sum(sc, len, p.scale, p.scale * max);
          continue;
        }
        // Only this rank's runs of positions are exponentiated (exp_sum would flush the other
        // ranks' -inf to tiny values, not 0); theirs take weight 0.
        float sum = 0.f;
        for (int64_t j = begin; j < end; j = next_block(j)) {
          const int64_t rows = std::min(next_block(j), end) - j;
          float* row = sc + (j - begin);
          if (local(j)) {
            sum += vec.exp_sum(row, rows, p.scale, p.scale * max);
          } else {
            std::fill_n(row, rows, 0.f);
          }
        }
        sums[h] = sum;
      }
      if (w.part >= 0) std::copy(maxes.begin(), maxes.end(), part_max.data() + w.part * nh);
      float* out = w.part >= 0 ? part_out.data() + w.part * nh * hd
                               : p.output + (t * nh + g0 * group) * hd;
      std::memset(out, 0, sizeof(float) * heads * hd);
      for (int64_t j = begin; j < end; j = next_block(j)) {
        if (!local(j)) continue;
        const int64_t rows = std::min(next_block(j), end) - j;
        for (int64_t g = 0; g < ng; ++g) {
          const KvRows own = rows_at(v_values, v_meta, vl, j, g);
          vk.axpy(own.values, own.meta, hd, rows, scores.data() + g * group * len + (j - begin),
                  group, len, out + g * group * hd, ahead(false, j, g, rows));
        }
      }
      if (w.part >= 0) {
        std::copy(sums.begin(), sums.end(), part_sum.data() + w.part * nh);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = sums[h] == 0.f ? 0.f : 1.f / sums[h];
        for (int64_t i = 0; i < hd; ++i) out[h * hd + i] *= inv;
      }
      if (p.lse != nullptr) {
        float* lse = p.lse + t * nh + g0 * group;
        for (int64_t h = 0; h < heads; ++h) lse[h] = LogSumExp(p.scale, maxes[h], sums[h]);
      }
    }

    // Merge the chunks of each split token: rescale each chunk's sum and output from its own
    // maximum to the overall one.
    const int64_t merges = static_cast<int64_t>(splits.size()) * nh;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < merges; ++i) {
      const Split& sp = splits[i / nh];
      const int64_t h = i % nh;
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < sp.parts; ++c) {
        max = std::max(max, part_max[(sp.first_part + c) * nh + h]);
      }
      float* o = p.output + (sp.t * nh + h) * hd;
      std::fill(o, o + hd, 0.f);
      if (p.cp_size > 1 && max == -std::numeric_limits<float>::infinity()) {
        // No chunk held this rank's blocks.
        if (p.lse != nullptr) p.lse[sp.t * nh + h] = max;
        continue;
      }
      float sum = 0.f;
      for (int64_t c = 0; c < sp.parts; ++c) {
        const int64_t k = (sp.first_part + c) * nh + h;
        const float a = std::exp(p.scale * (part_max[k] - max));
        sum += a * part_sum[k];
        const float* po = part_out.data() + k * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] += a * po[d];
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
      if (p.lse != nullptr) p.lse[sp.t * nh + h] = LogSumExp(p.scale, max, sum);
    }
  }
  return absl::OkStatus();
}

void MergeAttentionPartials(const float* outputs, const float* lses, int64_t parts,
                            int64_t rows, int64_t head_dim, float* out, float* lse_out) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (rows * parts * head_dim > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    float top = kNone;
    bool nan = false;
    for (int64_t c = 0; c < parts; ++c) {
      const float l = lses[c * rows + r];
      nan |= std::isnan(l);
      top = std::max(top, l);
    }
    float* o = out + r * head_dim;
    if (nan) {  // a part's NaN stays visible
      std::fill_n(o, head_dim, std::numeric_limits<float>::quiet_NaN());
      if (lse_out != nullptr) lse_out[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    std::fill_n(o, head_dim, 0.f);
    if (top == kNone) {
      if (lse_out != nullptr) lse_out[r] = kNone;
      continue;
    }
    float total = 0.f;
    for (int64_t c = 0; c < parts; ++c) {
      const float l = lses[c * rows + r];
      if (l == kNone) continue;
      const float a = std::exp(l - top);
      total += a;
      const float* po = outputs + (c * rows + r) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += a * po[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    if (lse_out != nullptr) lse_out[r] = top + std::log(total);
  }
}

}  // namespace kvgrid::kernels::cpu
