// PagedAttention against a dense, contiguous reference on random batches that mix prefill,
// chunked prefill and decode, with GQA, scattered block tables and every KV dtype (K and V
// chosen independently). The reference attends over the arena rows as DequantizeRow decodes
// them, so what is checked is the kernel's arithmetic, not the formats' rounding (that is
// kv_quant_test's).
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/cpu/kv_write.h"
#include "kernels/cpu/vec.h"

namespace kvgrid::kernels::cpu {
namespace {

struct Case {
  int64_t heads, kv_heads, head_dim, block_size;
  std::vector<int32_t> ctx_lens;  // per sequence, after this step
  std::vector<int32_t> q_lens;    // per sequence
  KvDType dtype;                     // K, and V unless v_dtype is set
  std::optional<KvDType> v_dtype = std::nullopt;
  KvKernelPrecision precision = KvKernelPrecision::kExact;
  double tolerance = 1e-5;  // max |output - reference|
  // Sliding window (0: full attention). With a window, table entries of blocks wholly before
  // the window of each sequence's first query are made holes (-1), as the block manager
  // leaves them: the kernel must not read them.
  int64_t window = 0;
  // Context-parallel ranks (1: one call). With more, each rank's call sees a table whose other
  // ranks' entries are -1, and MergeAttentionPartials combines their outputs.
  int64_t cp_size = 1;
};

// Dense reference: K/V per sequence as [ctx, kv_heads, head_dim] in fp64.
void RunCase(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t num_seqs = static_cast<int64_t>(c.ctx_lens.size());
  int64_t max_blocks = 0, total_blocks = 0;
  for (int32_t len : c.ctx_lens) {
    const int64_t b = (len + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, b);
    total_blocks += b;
  }
  const int64_t num_blocks = total_blocks + 3;
  // Scatter blocks: a random permutation of arena ids.
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(num_seqs * max_blocks, 0);
  int64_t next = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t b = (c.ctx_lens[s] + c.block_size - 1) / c.block_size;
    for (int64_t i = 0; i < b; ++i) tables[s * max_blocks + i] = ids[next++];
  }

  const KvDType k_dtype = c.dtype;
  const KvDType v_dtype = c.v_dtype.value_or(c.dtype);
  const KvRowLayout kl = KvRowLayoutFor(k_dtype, c.head_dim);
  const KvRowLayout vl = KvRowLayoutFor(v_dtype, c.head_dim);
  const int64_t kv_row = c.kv_heads * c.head_dim;
  const int64_t arena_rows = num_blocks * c.kv_heads * c.block_size;
  std::vector<std::byte> k_cache(arena_rows * kl.value_bytes);
  std::vector<std::byte> v_cache(arena_rows * vl.value_bytes);
  std::vector<std::byte> k_meta(arena_rows * kl.meta_bytes);
  std::vector<std::byte> v_meta(arena_rows * vl.meta_bytes);
  void* k_meta_ptr = k_meta.empty() ? nullptr : k_meta.data();
  void* v_meta_ptr = v_meta.empty() ? nullptr : v_meta.data();
  std::vector<std::vector<float>> k_dense(num_seqs), v_dense(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = c.ctx_lens[s];
    k_dense[s].resize(len * kv_row);
    v_dense[s].resize(len * kv_row);
    for (float& x : k_dense[s]) x = normal(rng);
    for (float& x : v_dense[s]) x = normal(rng);
    std::vector<int64_t> slots(len);
    for (int64_t p = 0; p < len; ++p) {
      slots[p] = static_cast<int64_t>(tables[s * max_blocks + p / c.block_size]) * c.block_size +
                 p % c.block_size;
    }
    ASSERT_TRUE(KvWrite({.key = k_dense[s].data(),
                         .value = v_dense[s].data(),
                         .slots = slots.data(),
                         .k_cache = k_cache.data(),
                         .v_cache = v_cache.data(),
                         .k_meta = k_meta_ptr,
                         .v_meta = v_meta_ptr,
                         .k_dtype = k_dtype,
                         .v_dtype = v_dtype,
                         .num_tokens = len,
                         .num_blocks = num_blocks,
                         .num_kv_heads = c.kv_heads,
                         .block_size = c.block_size,
                         .head_dim = c.head_dim})
                    .ok());
    // The reference sees what the arena holds.
    for (int64_t p = 0; p < len; ++p) {
      const int64_t block = slots[p] / c.block_size;
      for (int64_t g = 0; g < c.kv_heads; ++g) {
        const int64_t row = (block * c.kv_heads + g) * c.block_size + slots[p] % c.block_size;
        DequantizeRow(k_dtype, k_cache.data() + row * kl.value_bytes,
                      k_meta.data() + row * kl.meta_bytes, c.head_dim,
                      k_dense[s].data() + p * kv_row + g * c.head_dim);
        DequantizeRow(v_dtype, v_cache.data() + row * vl.value_bytes,
                      v_meta.data() + row * vl.meta_bytes, c.head_dim,
                      v_dense[s].data() + p * kv_row + g * c.head_dim);
      }
    }
  }

  if (c.window > 0) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t first_key = std::max<int64_t>(0, c.ctx_lens[s] - c.q_lens[s] + 1 - c.window);
      for (int64_t b = 0; b < first_key / c.block_size; ++b) tables[s * max_blocks + b] = -1;
    }
  }
  std::vector<int32_t> query_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) query_start[s + 1] = query_start[s] + c.q_lens[s];
  const int64_t num_tokens = query_start[num_seqs];
  std::vector<float> q(num_tokens * c.heads * c.head_dim);
  for (float& x : q) x = normal(rng);
  std::vector<float> out(q.size(), -1.f);
  std::vector<float> lse(num_tokens * c.heads, -1.f);
  const float scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  PagedAttentionParams params{.query = q.data(),
                              .output = out.data(),
                              .k_cache = k_cache.data(),
                              .v_cache = v_cache.data(),
                              .k_meta = k_meta_ptr,
                              .v_meta = v_meta_ptr,
                              .k_dtype = k_dtype,
                              .v_dtype = v_dtype,
                              .block_tables = tables.data(),
                              .seq_lens = c.ctx_lens.data(),
                              .query_start = query_start.data(),
                              .num_seqs = num_seqs,
                              .num_tokens = num_tokens,
                              .max_blocks_per_seq = max_blocks,
                              .num_blocks = num_blocks,
                              .num_heads = c.heads,
                              .num_kv_heads = c.kv_heads,
                              .block_size = c.block_size,
                              .head_dim = c.head_dim,
                              .scale = scale,
                              .window = c.window,
                              .precision = c.precision,
                              .lse = lse.data()};
  if (c.cp_size == 1) {
    ASSERT_TRUE(PagedAttention(params).ok());
  } else {
    const int64_t rows = num_tokens * c.heads;
    std::vector<float> part_out(c.cp_size * rows * c.head_dim, -1.f);
    std::vector<float> part_lse(c.cp_size * rows, -1.f);
    for (int64_t r = 0; r < c.cp_size; ++r) {
      std::vector<int32_t> rank_tables = tables;
      for (size_t i = 0; i < rank_tables.size(); ++i) {
        if (static_cast<int64_t>(i % max_blocks) % c.cp_size != r) rank_tables[i] = -1;
      }
      PagedAttentionParams rank = params;
      rank.block_tables = rank_tables.data();
      rank.cp_size = c.cp_size;
      rank.cp_rank = r;
      rank.output = part_out.data() + r * rows * c.head_dim;
      rank.lse = part_lse.data() + r * rows;
      ASSERT_TRUE(PagedAttention(rank).ok()) << "rank " << r;
    }
    MergeAttentionPartials(part_out.data(), part_lse.data(), c.cp_size, rows, c.head_dim,
                           out.data(), lse.data());
  }

  const int64_t group = c.heads / c.kv_heads;
  double max_err = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t i = 0; i < c.q_lens[s]; ++i) {
      const int64_t t = query_start[s] + i;
      const int64_t pos = c.ctx_lens[s] - c.q_lens[s] + i;
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t g = h / group;
        const float* qv = q.data() + (t * c.heads + h) * c.head_dim;
        // Keys lo..pos: pos - window < j <= pos with a window.
        const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
        std::vector<double> w(pos + 1, 0.0);
        double max = -1e300;
        for (int64_t j = lo; j <= pos; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < c.head_dim; ++d) {
            dot += static_cast<double>(qv[d]) * k_dense[s][j * kv_row + g * c.head_dim + d];
          }
          w[j] = dot * scale;
          max = std::max(max, w[j]);
        }
        double sum = 0;
        for (int64_t j = lo; j <= pos; ++j) sum += (w[j] = std::exp(w[j] - max));
        max_err = std::max(max_err, std::abs(max + std::log(sum) - lse[t * c.heads + h]));
        for (int64_t d = 0; d < c.head_dim; ++d) {
          double acc = 0;
          for (int64_t j = lo; j <= pos; ++j) {
            acc += w[j] / sum * v_dense[s][j * kv_row + g * c.head_dim + d];
          }
          max_err = std::max(max_err,
                             std::abs(acc - out[(t * c.heads + h) * c.head_dim + d]));
        }
      }
    }
  }
  EXPECT_LT(max_err, c.tolerance) << "seed " << seed << " K " << KvDTypeName(k_dtype) << " V "
                           << KvDTypeName(v_dtype) << " cp " << c.cp_size;
}

TEST(PagedAttentionTest, DecodeBatchMatchesDenseReference) {
  RunCase({8, 2, 32, 16, {1, 17, 40, 64}, {1, 1, 1, 1}, KvDType::kF32}, 1);
}

TEST(PagedAttentionTest, PrefillAndChunkedPrefillMatchDenseReference) {
  // Full prefill, a chunk that follows cached tokens, and a decode in one batch.
  RunCase({4, 4, 16, 8, {23, 50, 9}, {23, 13, 1}, KvDType::kF32}, 2);
  RunCase({6, 3, 64, 32, {100, 33}, {100, 33}, KvDType::kF32}, 3);
}

TEST(PagedAttentionTest, Fp16ArenaMatchesReferenceOnRoundedValues) {
  RunCase({8, 2, 32, 16, {5, 31, 70}, {5, 2, 1}, KvDType::kF16}, 4);
}

TEST(PagedAttentionTest, QuantizedArenasMatchReferenceOnDecodedValues) {
  for (KvDType dtype : {KvDType::kBF16, KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3}) {
    // Llama-3-like GQA decode, a prefill with a chunk, and head dims off the SIMD width
    // (34: a 2-channel tail; 80: a short last int4 group).
    RunCase({8, 2, 128, 16, {5, 31, 70}, {5, 2, 1}, dtype}, 5);
    RunCase({6, 3, 80, 8, {23, 50}, {23, 13}, dtype}, 6);
    RunCase({4, 1, 34, 32, {40, 1}, {1, 1}, dtype}, 7);
  }
}

TEST(PagedAttentionTest, MixedKAndVDTypes) {
  RunCase({8, 2, 64, 16, {33, 70, 3}, {1, 5, 3}, KvDType::kInt8, KvDType::kInt4}, 8);
  RunCase({8, 4, 48, 8, {19, 64}, {19, 1}, KvDType::kF16, KvDType::kInt8}, 9);
  RunCase({4, 2, 32, 16, {50}, {7}, KvDType::kInt4, KvDType::kBF16}, 10);
  RunCase({8, 2, 64, 16, {33, 70, 3}, {1, 5, 3}, KvDType::kFp8E4m3, KvDType::kInt4}, 13);
}

// Decode queries over long contexts are cut into chunks whose partial softmax results are
// merged; a prefill sequence in the same batch takes the per-head path.
TEST(PagedAttentionTest, LongContextDecodeMatchesDenseReference) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kInt8,
                        KvDType::kInt4, KvDType::kFp8E4m3}) {
    RunCase({8, 2, 64, 16, {3000, 2501, 700, 40}, {1, 3, 1, 12}, dtype}, 11);
  }
  RunCase({8, 2, 64, 16, {3000, 1}, {2, 1}, KvDType::kInt8, KvDType::kInt4}, 12);
}

// The fast int8 kernels round queries and softmax weights to int8 (kv_int8_vnni.h): outputs
// (weighted means of N(0, 1) values) move by ~1e-2, while a misplaced row or channel moves
// them by O(1).
TEST(PagedAttentionTest, FastInt8KernelsStayCloseToReference) {
  for (auto [k, v] : {std::pair{KvDType::kInt8, KvDType::kInt8},
                      std::pair{KvDType::kInt8, KvDType::kF16},
                      std::pair{KvDType::kF16, KvDType::kInt8}}) {
    const KvKernelPrecision fast = KvKernelPrecision::kFast;
    RunCase({8, 2, 128, 16, {5, 31, 70}, {5, 2, 1}, k, v, fast, 0.05}, 20);
    RunCase({6, 3, 80, 8, {23, 50}, {23, 13}, k, v, fast, 0.05}, 21);
    RunCase({4, 1, 34, 32, {40, 1}, {1, 1}, k, v, fast, 0.05}, 22);
    RunCase({14, 2, 64, 16, {3000, 700, 40}, {1, 1, 12}, k, v, fast, 0.05}, 23);
  }
}

// Sliding windows: decode and prefill, windows shorter and longer than a block, starting
// mid-block, a chunk after cached tokens, long decode contexts split into chunks, every
// dtype, with the blocks before each window made holes.
TEST(PagedAttentionTest, SlidingWindowMatchesDenseReference) {
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kInt8,
                        KvDType::kInt4, KvDType::kFp8E4m3}) {
    for (int64_t window : {1, 5, 24, 100}) {
      Case c{8, 2, 64, 16, {200, 57, 23, 3000, 40}, {1, 57, 9, 1, 12}, dtype};
      c.window = window;
      RunCase(c, 30 + window);
    }
  }
  // The fast int8 kernels on windowed rows (mid-block starts hit the prepared-query path).
  Case fast{8, 2, 128, 16, {200, 70, 3000}, {1, 20, 1}, KvDType::kInt8, std::nullopt,
            KvKernelPrecision::kFast, 0.05};
  fast.window = 24;
  RunCase(fast, 40);
  // A window past the context is full attention.
  Case wide{4, 2, 32, 8, {30, 30}, {30, 1}, KvDType::kF32};
  wide.window = 4096;
  RunCase(wide, 41);
}

TEST(PagedAttentionTest, NegativeWindowIsRejected) {
  std::vector<float> q(32), out(32);
  std::vector<float> kv(8 * 32);
  const int32_t table = 0, len = 1;
  const int32_t qs[2] = {0, 1};
  const absl::Status st = PagedAttention({.query = q.data(),
                                          .output = out.data(),
                                          .k_cache = kv.data(),
                                          .v_cache = kv.data(),
                                          .block_tables = &table,
                                          .seq_lens = &len,
                                          .query_start = qs,
                                          .num_seqs = 1,
                                          .num_tokens = 1,
                                          .max_blocks_per_seq = 1,
                                          .num_blocks = 1,
                                          .num_heads = 1,
                                          .num_kv_heads = 1,
                                          .block_size = 8,
                                          .head_dim = 32,
                                          .scale = 1.f,
                                          .window = -1});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("window"), std::string::npos) << st;
}

TEST(PagedAttentionTest, RandomShapes) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t kv_heads = 1 + rng() % 3;
    const int64_t heads = kv_heads * (1 + rng() % 4);
    const int64_t head_dim = 2 * (1 + rng() % 40);
    const int64_t block_size = int64_t{8} << (rng() % 3);
    const int64_t num_seqs = 1 + rng() % 4;
    std::vector<int32_t> ctx, ql;
    for (int64_t s = 0; s < num_seqs; ++s) {
      ctx.push_back(1 + rng() % 70);
      ql.push_back(1 + rng() % ctx.back());
    }
    constexpr KvDType kDTypes[] = {KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,
                                   KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3};
    RunCase({heads, kv_heads, head_dim, block_size, ctx, ql, kDTypes[rng() % 6],
             kDTypes[rng() % 6]},
            100 + trial);
  }
}

// Context parallelism: 2 to 4 ranks, each attending over its own blocks (block i on rank
// i % C), merged through their log-sum-exp, against the one dense reference: decode (whose
// long contexts the kernel splits into chunks, some holding no block of a rank), prefill,
// chunked prefill, sliding windows, GQA and every K and V dtype.
TEST(PagedAttentionTest, ContextParallelRanksMergeToFullAttention) {
  std::mt19937_64 rng(11);
  constexpr KvDType kDTypes[] = {KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,
                                 KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3};
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t kv_heads = 1 + rng() % 3;
    const int64_t heads = kv_heads * (1 + rng() % 4);
    const int64_t head_dim = 2 * (1 + rng() % 40);
    const int64_t block_size = int64_t{4} << (rng() % 3);
    const int64_t num_seqs = 1 + rng() % 4;
    std::vector<int32_t> ctx, ql;
    for (int64_t s = 0; s < num_seqs; ++s) {
      // Some decode contexts long enough to be split into chunks.
      ctx.push_back(trial % 3 == 0 ? 600 + rng() % 900 : 1 + rng() % 90);
      ql.push_back(rng() % 2 ? 1 : 1 + rng() % ctx.back());
    }
    Case c{heads, kv_heads, head_dim, block_size, ctx, ql, kDTypes[rng() % 6],
           kDTypes[rng() % 6]};
    c.window = trial % 4 == 1 ? 1 + rng() % 40 : 0;
    c.cp_size = 2 + trial % 3;
    RunCase(c, 300 + trial);
  }
  // kFast int8 rounds each rank's queries and weights on its own: close, not exact.
  RunCase({.heads = 8, .kv_heads = 2, .head_dim = 64, .block_size = 16, .ctx_lens = {700, 33},
           .q_lens = {1, 5}, .dtype = KvDType::kInt8,
           .precision = KvKernelPrecision::kFast, .tolerance = 3e-2, .cp_size = 3},
          400);
}

TEST(PagedAttentionTest, MergeOfRowsNoRankAttendedIsZero) {
  const float none = -std::numeric_limits<float>::infinity();
  // Two rows of head_dim 2 from two parts: row 0 attended by part 1 only, row 1 by neither.
  const std::vector<float> outputs = {9, 9, 9, 9, /*part 1*/ 1, 2, 7, 7};
  const std::vector<float> lses = {none, none, 0.5f, none};
  std::vector<float> out(4, -1.f), lse(2, -1.f);
  MergeAttentionPartials(outputs.data(), lses.data(), 2, 2, 2, out.data(), lse.data());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 0, 0}));
  EXPECT_EQ(lse[0], 0.5f);
  EXPECT_EQ(lse[1], none);
}

TEST(PagedAttentionTest, RejectsRankOutsideTheGroup) {
  std::vector<float> q(4), out(4);
  std::vector<float> k(4), v(4);
  const int32_t table = 0, len = 1, starts[] = {0, 1};
  PagedAttentionParams p{.query = q.data(), .output = out.data(), .k_cache = k.data(),
                         .v_cache = v.data(), .k_dtype = KvDType::kF32,
                         .v_dtype = KvDType::kF32, .block_tables = &table, .seq_lens = &len,
                         .query_start = starts, .num_seqs = 1, .num_tokens = 1,
                         .max_blocks_per_seq = 1, .num_blocks = 1, .num_heads = 1,
                         .num_kv_heads = 1, .block_size = 1, .head_dim = 4, .scale = 0.5f,
                         .cp_size = 2, .cp_rank = 2};
  const absl::Status s = PagedAttention(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cp_rank"), std::string::npos) << s;
}

// The softmax exponentials, fast and portable, against std::exp over the range softmax uses.
TEST(PagedAttentionTest, ExpSumMatchesStdExp) {
  for (const VecOps* vec : {&Vec(), &PortableVec()}) {
    for (int64_t n : {1, 7, 8, 16, 29, 33, 1000}) {
      std::vector<float> x(n);
      for (int64_t i = 0; i < n; ++i) x[i] = -100.f * static_cast<float>(i) / n + 3.f;
      std::vector<float> y = x;
      const float shift = 1.5f * 3.f;
      const float sum = vec->exp_sum(y.data(), n, 1.5f, shift);
      double want_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double arg = static_cast<double>(x[i]) * 1.5 - shift;
        const double want = std::exp(arg);
        want_sum += want;
        // A few ulp, plus the rounding of the argument to float (relative |arg| * 2^-23).
        EXPECT_NEAR(y[i], want, want * (3e-7 + 1.2e-7 * std::abs(arg)) + 1e-37)
            << vec->name << " x=" << x[i];
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum) << vec->name << " n=" << n;
    }
  }
}

TEST(PagedAttentionTest, RejectsQuantizedArenaWithoutMeta) {
  std::vector<float> q(16), out(16);
  std::vector<std::byte> cache(16 * 16);
  const int32_t table[] = {0};
  const int32_t lens[] = {1};
  const int32_t starts[] = {0, 1};
  absl::Status s = PagedAttention({.query = q.data(),
                                   .output = out.data(),
                                   .k_cache = cache.data(),
                                   .v_cache = cache.data(),
                                   .k_meta = cache.data(),
                                   .k_dtype = KvDType::kInt8,
                                   .v_dtype = KvDType::kInt4,
                                   .block_tables = table,
                                   .seq_lens = lens,
                                   .query_start = starts,
                                   .num_seqs = 1,
                                   .num_tokens = 1,
                                   .max_blocks_per_seq = 1,
                                   .num_blocks = 1,
                                   .num_heads = 1,
                                   .num_kv_heads = 1,
                                   .block_size = 16,
                                   .head_dim = 16,
                                   .scale = 0.25f});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("v_meta"), std::string::npos) << s;
}

TEST(PagedAttentionTest, RejectsBlockOutsideArena) {
  std::vector<float> q(16), out(16);
  std::vector<float> cache(16 * 16);
  const int32_t table[] = {5};
  const int32_t lens[] = {1};
  const int32_t starts[] = {0, 1};
  absl::Status s = PagedAttention({.query = q.data(),
                                   .output = out.data(),
                                   .k_cache = cache.data(),
                                   .v_cache = cache.data(),
                                   .block_tables = table,
                                   .seq_lens = lens,
                                   .query_start = starts,
                                   .num_seqs = 1,
                                   .num_tokens = 1,
                                   .max_blocks_per_seq = 1,
                                   .num_blocks = 1,
                                   .num_heads = 1,
                                   .num_kv_heads = 1,
                                   .block_size = 16,
                                   .head_dim = 16,
                                   .scale = 0.25f});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("outside the arena"), std::string::npos);
}

// A hole (-1) is fine before the window of the first query, and an error inside it.
TEST(PagedAttentionTest, HolesOnlyBeforeTheWindow) {
  std::vector<float> q(2 * 16), out(2 * 16);
  std::vector<float> cache(3 * 8 * 16);
  std::vector<int32_t> table = {-1, 1, 2};
  const int32_t lens[] = {20};
  const int32_t starts[] = {0, 2};
  PagedAttentionParams p{.query = q.data(),
                         .output = out.data(),
                         .k_cache = cache.data(),
                         .v_cache = cache.data(),
                         .block_tables = table.data(),
                         .seq_lens = lens,
                         .query_start = starts,
                         .num_seqs = 1,
                         .num_tokens = 2,
                         .max_blocks_per_seq = 3,
                         .num_blocks = 3,
                         .num_heads = 1,
                         .num_kv_heads = 1,
                         .block_size = 8,
                         .head_dim = 16,
                         .scale = 0.25f,
                         .window = 10};
  // Queries at 18 and 19: the first sees 9..18, so block 0 (0..7) is never read.
  EXPECT_TRUE(PagedAttention(p).ok());
  p.window = 11;  // the first query now sees position 8 of block 1 only: still fine
  EXPECT_TRUE(PagedAttention(p).ok());
  p.window = 12;  // it sees position 7, in the hole
  EXPECT_EQ(PagedAttention(p).code(), absl::StatusCode::kInvalidArgument);
  p.window = 0;
  EXPECT_EQ(PagedAttention(p).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
