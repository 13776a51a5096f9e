// CUDA paged attention (kernels/cuda/paged_attention.cuh) against the CPU reference
// (kernels/cpu/attention.h): the same arenas, filled by the CPU encoders (KvWrite), read by
// both. Skipped, with a message, where no GPU is visible; the Validate tests run everywhere.
//
// Tolerance. Both sides decode every quantized channel to the same float (the CUDA decoders
// reproduce DequantizeRow exactly), so they differ only in the order and grouping of fp32
// sums: the 128-term dot products, the softmax sum over up to 5000 keys (split into chunks
// differently on each side) and the weighted sum of values. With q ~ N(0, 4), k, v ~ N(0, 1)
// and scale 1/sqrt(head_dim), a score's rounding error is a random walk of ~128 roundings of
// partial sums of size <= ~30, i.e. ~1e-6 per side; it perturbs the softmax weights
// relatively by the same amount, and the output (a convex combination of |v| <= ~5) by
// ~5e-6; the long sums add ~sqrt(5000) * 2^-24 ~ 4e-6 relative. kAbsTol + kRelTol * |ref|
// with both 1e-4 leaves a 10x margin over that, while a wrong mask, chunk boundary, merge
// weight or dequantization moves outputs by 1e-3..1 (q ~ N(0, 4) makes the attention peaked
// enough that dropping or adding a single key shows).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_write.h"
#include "kernels/cuda/attention_merge.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/kv_dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {

// Test names and ctest listings show dtypes by name rather than as bytes.
void PrintTo(KvDType dtype, std::ostream* os) { *os << KvDTypeName(dtype); }

namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

constexpr double kAbsTol = 1e-4;
constexpr double kRelTol = 1e-4;
constexpr KvDType kAllDTypes[] = {KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,
                                  KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3};

struct Geometry {
  KvDType k_dtype = KvDType::kF32;
  KvDType v_dtype = KvDType::kF32;
  int64_t head_dim = 64;
  int64_t group = 1;  // query heads per KV head
  int64_t block_size = 16;
  int64_t num_kv_heads = 2;

  int64_t num_heads() const { return group * num_kv_heads; }
  std::string Name() const {
    return absl::StrCat("K ", std::string(KvDTypeName(k_dtype)), " V ",
                        std::string(KvDTypeName(v_dtype)), " head_dim ", head_dim, " group ", group,
                        " block_size ", block_size, " kv_heads ", num_kv_heads);
  }
};

// The KV cache of a set of sequences on the host: each sequence's blocks are a random subset
// of the arena (so blocks are scattered and out of order), spare blocks stay zero, and rows
// are random N(0, 1) values encoded by KvWrite.
struct HostCache {
  Geometry geo;
  std::vector<int32_t> contexts;  // [num_seqs]
  int64_t num_blocks = 0;
  int64_t max_blocks_per_seq = 0;
  std::vector<int32_t> tables;          // [num_seqs, max_blocks_per_seq]
  std::vector<uint8_t> k, v;            // value planes
  std::vector<uint8_t> k_meta, v_meta;  // meta planes (empty for float dtypes)
};

HostCache MakeHostCache(const Geometry& geo, const std::vector<int32_t>& contexts,
                        std::mt19937_64& rng) {
  HostCache c;
  c.geo = geo;
  c.contexts = contexts;
  const int64_t bs = geo.block_size;
  int64_t used = 0;
  for (int32_t ctx : contexts) {
    const int64_t blocks = (ctx + bs - 1) / bs;
    used += blocks;
    c.max_blocks_per_seq = std::max(c.max_blocks_per_seq, blocks);
  }
  c.max_blocks_per_seq += 2;  // tables wider than needed, as the engine's are
  c.num_blocks = used + 5;
  std::vector<int32_t> perm(c.num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  c.tables.assign(contexts.size() * c.max_blocks_per_seq, 0);  // unused entries: block 0

  const KvRowLayout kl = KvRowLayoutFor(geo.k_dtype, geo.head_dim);
  const KvRowLayout vl = KvRowLayoutFor(geo.v_dtype, geo.head_dim);
  const int64_t rows = c.num_blocks * geo.num_kv_heads * bs;
  c.k.assign(rows * kl.value_bytes, 0);
  c.v.assign(rows * vl.value_bytes, 0);
  c.k_meta.assign(rows * kl.meta_bytes, 0);
  c.v_meta.assign(rows * vl.meta_bytes, 0);

  std::normal_distribution<float> normal(0.f, 1.f);
  int64_t next = 0;
  for (size_t s = 0; s < contexts.size(); ++s) {
    const int64_t ctx = contexts[s];
    const int64_t blocks = (ctx + bs - 1) / bs;
    for (int64_t b = 0; b < blocks; ++b) c.tables[s * c.max_blocks_per_seq + b] = perm[next++];
    std::vector<float> key(ctx * geo.num_kv_heads * geo.head_dim);
    std::vector<float> value(key.size());
    for (float& x : key) x = normal(rng);
    for (float& x : value) x = normal(rng);
    std::vector<int64_t> slots(ctx);
    for (int64_t p = 0; p < ctx; ++p) {
      slots[p] = int64_t{c.tables[s * c.max_blocks_per_seq + p / bs]} * bs + p % bs;
    }
    const absl::Status st = cpu::KvWrite({.key = key.data(),
                                          .value = value.data(),
                                          .slots = slots.data(),
                                          .k_cache = c.k.data(),
                                          .v_cache = c.v.data(),
                                          .k_meta = c.k_meta.empty() ? nullptr : c.k_meta.data(),
                                          .v_meta = c.v_meta.empty() ? nullptr : c.v_meta.data(),
                                          .k_dtype = geo.k_dtype,
                                          .v_dtype = geo.v_dtype,
                                          .num_tokens = ctx,
                                          .num_blocks = c.num_blocks,
                                          .num_kv_heads = geo.num_kv_heads,
                                          .block_size = bs,
                                          .head_dim = geo.head_dim});
    EXPECT_TRUE(st.ok()) << st;
  }
  return c;
}

// A batch over a cache: query counts per sequence and random queries.
struct Batch {
  std::vector<int32_t> query_start;  // [num_seqs + 1]
  std::vector<float> query;          // [num_tokens, num_heads, head_dim]
  int64_t window = 0;                // sliding window of both sides; 0 = full attention
  int64_t num_tokens() const { return query_start.back(); }
};

Batch MakeBatch(const HostCache& c, const std::vector<int32_t>& q_lens, std::mt19937_64& rng) {
  Batch b;
  b.query_start.assign(q_lens.size() + 1, 0);
  for (size_t s = 0; s < q_lens.size(); ++s) b.query_start[s + 1] = b.query_start[s] + q_lens[s];
  b.query.resize(b.num_tokens() * c.geo.num_heads() * c.geo.head_dim);
  std::normal_distribution<float> normal(0.f, 2.f);  // peaked attention: see the file comment
  for (float& x : b.query) x = normal(rng);
  return b;
}

float Scale(const Geometry& geo) { return 1.f / std::sqrt(static_cast<float>(geo.head_dim)); }

std::vector<float> CpuAttention(const HostCache& c, const Batch& b) {
  std::vector<float> out(b.query.size(), std::nanf(""));
  const absl::Status st =
      cpu::PagedAttention({.query = b.query.data(),
                           .output = out.data(),
                           .k_cache = c.k.data(),
                           .v_cache = c.v.data(),
                           .k_meta = c.k_meta.empty() ? nullptr : c.k_meta.data(),
                           .v_meta = c.v_meta.empty() ? nullptr : c.v_meta.data(),
                           .k_dtype = c.geo.k_dtype,
                           .v_dtype = c.geo.v_dtype,
                           .block_tables = c.tables.data(),
                           .seq_lens = c.contexts.data(),
                           .query_start = b.query_start.data(),
                           .num_seqs = static_cast<int64_t>(c.contexts.size()),
                           .num_tokens = b.num_tokens(),
                           .max_blocks_per_seq = c.max_blocks_per_seq,
                           .num_blocks = c.num_blocks,
                           .num_heads = c.geo.num_heads(),
                           .num_kv_heads = c.geo.num_kv_heads,
                           .block_size = c.geo.block_size,
                           .head_dim = c.geo.head_dim,
                           .scale = Scale(c.geo),
                           .window = b.window,
                           // The device kernels decode int8 to fp32; compare with the same.
                           .precision = cpu::KvKernelPrecision::kExact});
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// The cache's planes and tables on the device.
struct DeviceCache {
  explicit DeviceCache(const HostCache& c)
      : k(c.k),
        v(c.v),
        k_meta(c.k_meta),
        v_meta(c.v_meta),
        tables(c.tables),
        seq_lens(c.contexts) {}
  DeviceBuffer<uint8_t> k, v, k_meta, v_meta;
  DeviceBuffer<int32_t> tables, seq_lens;
};

// Params for `b` over `c` with device pointers; hints 0 mean "derive".
cuda::PagedAttentionParams GpuParams(const HostCache& c, const DeviceCache& d, const Batch& b,
                                     const float* query, float* output, const int32_t* query_start,
                                     int64_t max_seq_len, int64_t max_query_len) {
  cuda::PagedAttentionParams p;
  p.query = query;
  p.output = output;
  p.k_cache = d.k.get();
  p.v_cache = d.v.get();
  p.k_meta = d.k_meta.get();
  p.v_meta = d.v_meta.get();
  p.k_dtype = c.geo.k_dtype;
  p.v_dtype = c.geo.v_dtype;
  p.block_tables = d.tables.get();
  p.seq_lens = d.seq_lens.get();
  p.query_start = query_start;
  p.num_seqs = static_cast<int64_t>(c.contexts.size());
  p.num_tokens = b.num_tokens();
  p.max_blocks_per_seq = c.max_blocks_per_seq;
  p.num_blocks = c.num_blocks;
  p.num_heads = c.geo.num_heads();
  p.num_kv_heads = c.geo.num_kv_heads;
  p.block_size = c.geo.block_size;
  p.head_dim = c.geo.head_dim;
  p.scale = Scale(c.geo);
  p.window = b.window;
  p.max_seq_len = max_seq_len;
  p.max_query_len = max_query_len;
  return p;
}

// Runs `b` on the GPU; the output starts as NaN so that anything not written fails the
// comparison.
std::vector<float> GpuAttention(const HostCache& c, const DeviceCache& d, const Batch& b,
                                int64_t max_seq_len, int64_t max_query_len) {
  DeviceBuffer<float> query(b.query);
  DeviceBuffer<float> out(b.query.size());
  DeviceBuffer<int32_t> query_start(b.query_start);
  EXPECT_EQ(cudaMemset(out.get(), 0xff, b.query.size() * sizeof(float)), cudaSuccess);
  cuda::PagedAttentionParams p =
      GpuParams(c, d, b, query.get(), out.get(), query_start.get(), max_seq_len, max_query_len);
  const int64_t ws_bytes = cuda::PagedAttentionWorkspaceBytes(p);
  DeviceBuffer<uint8_t> workspace(static_cast<size_t>(ws_bytes));
  p.workspace = workspace.get();
  p.workspace_bytes = ws_bytes;
  const absl::Status st = cuda::LaunchPagedAttention(p, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.Download();
}

// Largest |got - want| and whether every element is within tolerance; the first few misses
// are printed with their (token, head, channel).
double Compare(const std::vector<float>& got, const std::vector<float>& want, const Geometry& geo,
               const std::string& label) {
  EXPECT_EQ(got.size(), want.size());
  double max_err = 0;
  int misses = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const bool ok = err <= kAbsTol + kRelTol * std::fabs(want[i]);  // false for NaN
    if (!std::isnan(err)) max_err = std::max(max_err, err);
    if (!ok && misses++ < 5) {
      const int64_t hd = geo.head_dim;
      const int64_t nh = geo.num_heads();
      ADD_FAILURE() << label << ": token " << i / (nh * hd) << " head " << (i / hd) % nh
                    << " channel " << i % hd << ": gpu " << got[i] << " cpu " << want[i];
    }
  }
  if (misses > 0) ADD_FAILURE() << label << ": " << misses << " of " << got.size() << " differ";
  return max_err;
}

// The contexts every configuration runs: a single token, a partial block, several decode
// chunks, and two long ones (many chunks); the second 5000 takes a chunk of prefill.
const std::vector<int32_t> kContexts = {1, 17, 300, 5000, 5000, 17};
// Pure decode: one query each (the last sequence too).
const std::vector<int32_t> kDecodeQueries = {1, 1, 1, 1, 1, 1};
// Mixed: a 1-token sequence, a whole prompt, a chunked prefill over a 255-token cache, a
// decode at 5000, a 70-token chunk after 4930 cached tokens (tiles of 64 rows end mid-token
// for group 4 and 7), and a sequence with no query this step.
const std::vector<int32_t> kMixedQueries = {1, 17, 45, 1, 70, 0};

// `c` with the blocks wholly before the window of each sequence's first query of `b` made
// holes (-1), as the block manager leaves them once it frees them: neither side may read them.
HostCache WithHoles(HostCache c, const Batch& b) {
  for (size_t s = 0; s < c.contexts.size(); ++s) {
    const int64_t q_len = b.query_start[s + 1] - b.query_start[s];
    const int64_t first_key = std::max<int64_t>(0, c.contexts[s] - q_len + 1 - b.window);
    for (int64_t i = 0; i < first_key / c.geo.block_size; ++i) {
      c.tables[s * c.max_blocks_per_seq + i] = -1;
    }
  }
  return c;
}

class PagedAttentionCudaTest : public ::testing::TestWithParam<std::tuple<KvDType, KvDType>> {};

TEST_P(PagedAttentionCudaTest, MatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const auto [k_dtype, v_dtype] = GetParam();
  double max_err = 0;
  for (int64_t head_dim : {64, 128}) {
    for (int64_t group : {1, 4}) {
      for (int64_t block_size : {16, 32}) {
        const Geometry geo{.k_dtype = k_dtype,
                           .v_dtype = v_dtype,
                           .head_dim = head_dim,
                           .group = group,
                           .block_size = block_size};
        std::mt19937_64 rng(head_dim * 1000 + group * 100 + block_size);
        const HostCache cache = MakeHostCache(geo, kContexts, rng);
        const DeviceCache dev(cache);
        // Decode with tight hints; mixed with the derived (loosest) bounds.
        const Batch decode = MakeBatch(cache, kDecodeQueries, rng);
        max_err =
            std::max(max_err, Compare(GpuAttention(cache, dev, decode, 5000, 1),
                                      CpuAttention(cache, decode), geo, geo.Name() + " decode"));
        const Batch mixed = MakeBatch(cache, kMixedQueries, rng);
        max_err =
            std::max(max_err, Compare(GpuAttention(cache, dev, mixed, 0, 0),
                                      CpuAttention(cache, mixed), geo, geo.Name() + " mixed"));
        if (HasFailure()) return;  // one configuration's report is enough
      }
    }
  }
  std::cout << "K " << KvDTypeName(k_dtype) << " V " << KvDTypeName(v_dtype)
            << ": max |gpu - cpu| = " << max_err << "\n";
  RecordProperty("max_abs_error", std::to_string(max_err));
}

INSTANTIATE_TEST_SUITE_P(AllDTypePairs, PagedAttentionCudaTest,
                         ::testing::Combine(::testing::ValuesIn(kAllDTypes),
                                            ::testing::ValuesIn(kAllDTypes)),
                         [](const ::testing::TestParamInfo<std::tuple<KvDType, KvDType>>& info) {
                           return absl::StrCat(
                               "K", std::string(KvDTypeName(std::get<0>(info.param))), "_V",
                               std::string(KvDTypeName(std::get<1>(info.param))));
                         });

// Groups that are not 1, 4 or 8 (padded decode rows; prefill tiles cutting a token's heads),
// groups above 8 (decode row tiles), a block size of 8, and the mixed int8 K / int4 V pair.
TEST(PagedAttentionCudaExtraTest, OddGroupsAndSmallBlocks) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (auto [group, block_size, head_dim] : {std::tuple{2, 8, 64}, std::tuple{7, 16, 128},
                                             std::tuple{12, 32, 128}, std::tuple{16, 16, 64}}) {
    const Geometry geo{.k_dtype = KvDType::kInt8,
                       .v_dtype = KvDType::kInt4,
                       .head_dim = head_dim,
                       .group = group,
                       .block_size = block_size};
    std::mt19937_64 rng(group);
    const HostCache cache = MakeHostCache(geo, kContexts, rng);
    const DeviceCache dev(cache);
    const Batch decode = MakeBatch(cache, kDecodeQueries, rng);
    Compare(GpuAttention(cache, dev, decode, 0, 0), CpuAttention(cache, decode), geo,
            geo.Name() + " decode");
    const Batch mixed = MakeBatch(cache, kMixedQueries, rng);
    Compare(GpuAttention(cache, dev, mixed, 0, 70), CpuAttention(cache, mixed), geo,
            geo.Name() + " mixed");
    if (HasFailure()) return;
  }
}

// Sliding windows (shorter than a block, several blocks, several decode chunks) over decode
// and mixed batches, with the blocks before each window made holes; the windowed decode
// workspace is sized by the window, not the context.
TEST(PagedAttentionCudaExtraTest, SlidingWindowMatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const std::vector<int32_t> contexts = {1, 17, 300, 2000, 2000, 17};
  for (auto [k_dtype, v_dtype, head_dim, group] :
       {std::tuple{KvDType::kF32, KvDType::kF32, 64, 1},
        std::tuple{KvDType::kF16, KvDType::kInt8, 128, 4},
        std::tuple{KvDType::kInt8, KvDType::kInt4, 64, 4},
        std::tuple{KvDType::kInt4, KvDType::kBF16, 128, 1}}) {
    const Geometry geo{.k_dtype = k_dtype,
                       .v_dtype = v_dtype,
                       .head_dim = head_dim,
                       .group = group,
                       .block_size = 16};
    std::mt19937_64 rng(head_dim + group);
    const HostCache cache = MakeHostCache(geo, contexts, rng);
    for (int64_t window : {5, 24, 700}) {
      for (const std::vector<int32_t>& q_lens : {kDecodeQueries, kMixedQueries}) {
        Batch batch = MakeBatch(cache, q_lens, rng);
        batch.window = window;
        const HostCache holed = WithHoles(cache, batch);
        const DeviceCache dev(holed);
        const std::string label = absl::StrCat(geo.Name(), " window ", window, " queries ",
                                               q_lens[4]);
        Compare(GpuAttention(holed, dev, batch, 0, 0), CpuAttention(holed, batch), geo, label);
        if (HasFailure()) return;
      }
    }
  }
}

// A batch big enough that the decode chunks grow past their minimum (512 tokens here), with
// 8 KV heads as in Llama-3-8B.
TEST(PagedAttentionCudaExtraTest, LargeBatchUsesLongChunks) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (KvDType dtype : {KvDType::kF16, KvDType::kInt4}) {
    const Geometry geo{.k_dtype = dtype,
                       .v_dtype = dtype,
                       .head_dim = 128,
                       .group = 4,
                       .block_size = 16,
                       .num_kv_heads = 8};
    std::mt19937_64 rng(7);
    std::vector<int32_t> contexts(32, 4096);
    contexts[5] = 4095;
    contexts[6] = 513;
    const HostCache cache = MakeHostCache(geo, contexts, rng);
    const DeviceCache dev(cache);
    const Batch decode = MakeBatch(cache, std::vector<int32_t>(contexts.size(), 1), rng);
    Compare(GpuAttention(cache, dev, decode, 4096, 1), CpuAttention(cache, decode), geo,
            geo.Name() + " decode");
    if (HasFailure()) return;
  }
}

// Context parallelism: rank r's table holds -1 for every block i with i % cp != r. The GPU's
// share of each rank (output and lse) matches the CPU's cp_rank share, and the GPU merge of the
// ranks' shares matches attention over every block (decode chunks, prefill, chunked prefill).
TEST(PagedAttentionCudaExtraTest, ContextParallelSharesAndTheirMergeMatchCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (auto [kd, vd] : {std::pair{KvDType::kF32, KvDType::kF32},
                        std::pair{KvDType::kF16, KvDType::kInt8},
                        std::pair{KvDType::kInt4, KvDType::kFp8E4m3}}) {
    const Geometry geo{.k_dtype = kd, .v_dtype = vd, .head_dim = 64, .group = 2,
                       .block_size = 16};
    std::mt19937_64 rng(17);
    const HostCache whole = MakeHostCache(geo, {1, 40, 300, 900}, rng);
    const Batch b = MakeBatch(whole, {1, 17, 1, 45}, rng);
    const int64_t rows = b.num_tokens() * geo.num_heads();
    const std::vector<float> want = CpuAttention(whole, b);
    for (int64_t cp : {2, 3}) {
      const std::string label = geo.Name() + " cp " + std::to_string(cp);
      DeviceBuffer<float> parts(cp * rows * geo.head_dim), lses(cp * rows);
      std::vector<float> cpu_parts(cp * rows * geo.head_dim), cpu_lses(cp * rows);
      for (int64_t r = 0; r < cp; ++r) {
        HostCache local = whole;
        for (size_t i = 0; i < local.tables.size(); ++i) {
          if (static_cast<int64_t>(i % local.max_blocks_per_seq) % cp != r) local.tables[i] = -1;
        }
        float* cpu_out = cpu_parts.data() + r * rows * geo.head_dim;
        float* cpu_lse = cpu_lses.data() + r * rows;
        ASSERT_TRUE(cpu::PagedAttention(
                        {.query = b.query.data(), .output = cpu_out, .k_cache = local.k.data(),
                         .v_cache = local.v.data(),
                         .k_meta = local.k_meta.empty() ? nullptr : local.k_meta.data(),
                         .v_meta = local.v_meta.empty() ? nullptr : local.v_meta.data(),
                         .k_dtype = kd, .v_dtype = vd, .block_tables = local.tables.data(),
                         .seq_lens = local.contexts.data(), .query_start = b.query_start.data(),
                         .num_seqs = 4, .num_tokens = b.num_tokens(),
                         .max_blocks_per_seq = local.max_blocks_per_seq,
                         .num_blocks = local.num_blocks, .num_heads = geo.num_heads(),
                         .num_kv_heads = geo.num_kv_heads, .block_size = geo.block_size,
                         .head_dim = geo.head_dim, .scale = Scale(geo),
                         .precision = cpu::KvKernelPrecision::kExact, .cp_size = cp,
                         .cp_rank = r, .lse = cpu_lse})
                        .ok());
        DeviceCache d(local);
        DeviceBuffer<float> query(b.query);
        DeviceBuffer<int32_t> query_start(b.query_start);
        cuda::PagedAttentionParams p = GpuParams(local, d, b, query.get(),
                                                 parts.get() + r * rows * geo.head_dim,
                                                 query_start.get(), 0, 0);
        p.lse = lses.get() + r * rows;
        const int64_t ws_bytes = cuda::PagedAttentionWorkspaceBytes(p);
        DeviceBuffer<uint8_t> workspace(static_cast<size_t>(ws_bytes));
        p.workspace = workspace.get();
        p.workspace_bytes = ws_bytes;
        ASSERT_TRUE(cuda::LaunchPagedAttention(p, nullptr).ok());
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      const std::vector<float> gpu_parts = parts.Download(), gpu_lses = lses.Download();
      Compare(gpu_parts, cpu_parts, geo, label + " shares");
      int lse_misses = 0;
      for (size_t i = 0; i < cpu_lses.size(); ++i) {
        const bool both_none = std::isinf(cpu_lses[i]) && cpu_lses[i] < 0 &&
                               std::isinf(gpu_lses[i]) && gpu_lses[i] < 0;
        if (!both_none && !(std::fabs(gpu_lses[i] - cpu_lses[i]) <=
                            kAbsTol + kRelTol * std::fabs(cpu_lses[i]))) {
          if (lse_misses++ < 5) {
            ADD_FAILURE() << label << ": lse " << i << ": gpu " << gpu_lses[i] << " cpu "
                          << cpu_lses[i];
          }
        }
      }
      EXPECT_EQ(lse_misses, 0) << label;
      DeviceBuffer<float> merged(rows * geo.head_dim);
      ASSERT_TRUE(cuda::LaunchMergeAttentionPartials({.outputs = parts.get(),
                                                      .lses = lses.get(),
                                                      .out = merged.get(),
                                                      .parts = cp,
                                                      .rows = rows,
                                                      .head_dim = geo.head_dim},
                                                     nullptr)
                      .ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      Compare(merged.Download(), want, geo, label + " merged");
      if (HasFailure()) return;
    }
  }
}

TEST(PagedAttentionCudaExtraTest, MergeOfRowsNoRankAttendedIsZeroAndNaNStaysVisible) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const float inf = std::numeric_limits<float>::infinity();
  // Two parts, three rows of 2 channels: no part attended row 0; row 1 only part 1; row 2 has
  // a NaN lse.
  DeviceBuffer<float> outputs(std::vector<float>{9, 9, 1, 2, 9, 9, 9, 9, 3, 4, 5, 6});
  DeviceBuffer<float> lses(std::vector<float>{-inf, -inf, 0.f, -inf, 0.5f, std::nanf("")});
  DeviceBuffer<float> out(6), lse_out(3);
  ASSERT_TRUE(cuda::LaunchMergeAttentionPartials({.outputs = outputs.get(), .lses = lses.get(),
                                                  .out = out.get(), .lse_out = lse_out.get(),
                                                  .parts = 2, .rows = 3, .head_dim = 2},
                                                 nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> o = out.Download(), l = lse_out.Download();
  EXPECT_EQ(o[0], 0.f);
  EXPECT_EQ(o[1], 0.f);
  EXPECT_EQ(l[0], -inf);
  EXPECT_FLOAT_EQ(o[2], 3.f);
  EXPECT_FLOAT_EQ(o[3], 4.f);
  EXPECT_FLOAT_EQ(l[1], 0.5f);
  EXPECT_TRUE(std::isnan(o[4]) && std::isnan(o[5]) && std::isnan(l[2]));
  EXPECT_EQ(cuda::LaunchMergeAttentionPartials({.outputs = outputs.get(), .lses = lses.get(),
                                                .out = out.get(), .parts = 0, .rows = 3,
                                                .head_dim = 2},
                                               nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Arena planes over 2^31 bytes with the sequences' blocks at the far end: every row offset
// must be computed in 64 bits. The CPU runs on a compact copy holding just those blocks.
TEST(PagedAttentionCudaExtraTest, ArenaLargerThan2GiB) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const Geometry geo{.k_dtype = KvDType::kF32,
                     .v_dtype = KvDType::kF32,
                     .head_dim = 128,
                     .group = 4,
                     .block_size = 16};
  std::mt19937_64 rng(11);
  const HostCache compact = MakeHostCache(geo, {300, 1000, 700}, rng);
  const int64_t block_bytes = geo.num_kv_heads * geo.block_size * 4 * geo.head_dim;
  const int64_t base = ((int64_t{1} << 31) + block_bytes - 1) / block_bytes + 3;
  const int64_t big_blocks = base + compact.num_blocks;
  const size_t plane = static_cast<size_t>(big_blocks * block_bytes);
  void* k = nullptr;
  void* v = nullptr;
  if (cudaMalloc(&k, plane) != cudaSuccess || cudaMalloc(&v, plane) != cudaSuccess) {
    cudaFree(k);
    cudaGetLastError();  // clear the allocation error
    GTEST_SKIP() << "could not allocate two " << plane << "-byte planes";
  }
  // Compact block c lives at block base + c of the big planes.
  const size_t offset = static_cast<size_t>(base * block_bytes);
  ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(k) + offset, compact.k.data(), compact.k.size(),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(static_cast<uint8_t*>(v) + offset, compact.v.data(), compact.v.size(),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  std::vector<int32_t> big_tables = compact.tables;
  for (int32_t& id : big_tables) id += static_cast<int32_t>(base);
  DeviceBuffer<int32_t> tables(big_tables), seq_lens(compact.contexts);
  const Batch batch = MakeBatch(compact, {1, 1, 40}, rng);
  DeviceBuffer<float> query(batch.query), out(batch.query.size());
  DeviceBuffer<int32_t> query_start(batch.query_start);
  cuda::PagedAttentionParams p;
  p.query = query.get();
  p.output = out.get();
  p.k_cache = k;
  p.v_cache = v;
  p.k_dtype = p.v_dtype = KvDType::kF32;
  p.block_tables = tables.get();
  p.seq_lens = seq_lens.get();
  p.query_start = query_start.get();
  p.num_seqs = 3;
  p.num_tokens = batch.num_tokens();
  p.max_blocks_per_seq = compact.max_blocks_per_seq;
  p.num_blocks = big_blocks;
  p.num_heads = geo.num_heads();
  p.num_kv_heads = geo.num_kv_heads;
  p.block_size = geo.block_size;
  p.head_dim = geo.head_dim;
  p.scale = Scale(geo);
  const int64_t ws_bytes = cuda::PagedAttentionWorkspaceBytes(p);
  DeviceBuffer<uint8_t> workspace(static_cast<size_t>(ws_bytes));
  p.workspace = workspace.get();
  p.workspace_bytes = ws_bytes;
  const absl::Status st = cuda::LaunchPagedAttention(p, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Compare(out.Download(), CpuAttention(compact, batch), geo, "arena > 2 GiB");
  cudaFree(k);
  cudaFree(v);
}

// Block ids outside the arena are never read: their positions get no weight, a sequence with
// no readable block gets zeros, and the device is still healthy afterwards.
TEST(PagedAttentionCudaExtraTest, OutOfRangeBlockIdsAreMaskedNotRead) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const Geometry geo{.k_dtype = KvDType::kF16,
                     .v_dtype = KvDType::kInt4,
                     .head_dim = 128,
                     .group = 4,
                     .block_size = 16};
  std::mt19937_64 rng(13);
  HostCache cache = MakeHostCache(geo, {100, 300, 300}, rng);
  // Sequence 0: every block bad; sequence 1: one block far outside; sequence 2: intact.
  for (int64_t b = 0; b < 7; ++b) cache.tables[b] = (b % 2 == 0) ? -5 : 1 << 30;
  cache.tables[cache.max_blocks_per_seq + 3] = static_cast<int32_t>(cache.num_blocks);
  const DeviceCache dev(cache);
  for (const std::vector<int32_t>& q_lens :
       {std::vector<int32_t>{1, 1, 1}, std::vector<int32_t>{20, 20, 20}}) {
    const Batch batch = MakeBatch(cache, q_lens, rng);
    const std::vector<float> got = GpuAttention(cache, dev, batch, 0, 0);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const int64_t row = geo.num_heads() * geo.head_dim;
    for (int64_t i = 0; i < q_lens[0] * row; ++i) ASSERT_EQ(got[i], 0.f) << i;
    for (float x : got) ASSERT_TRUE(std::isfinite(x));
  }
}

// --- Validate: host-only checks, so these run without a GPU too. ---

// Non-null, 256-byte aligned stand-ins: Validate never dereferences device pointers.
template <typename T>
T* FakeDevicePointer(uintptr_t n) {
  return reinterpret_cast<T*>(n * 256);
}

cuda::PagedAttentionParams ValidParams() {
  cuda::PagedAttentionParams p;
  p.query = FakeDevicePointer<const float>(1);
  p.output = FakeDevicePointer<float>(2);
  p.k_cache = FakeDevicePointer<const void>(3);
  p.v_cache = FakeDevicePointer<const void>(4);
  p.block_tables = FakeDevicePointer<const int32_t>(5);
  p.seq_lens = FakeDevicePointer<const int32_t>(6);
  p.query_start = FakeDevicePointer<const int32_t>(7);
  p.k_dtype = p.v_dtype = KvDType::kF16;
  p.num_seqs = 4;
  p.num_tokens = 4;
  p.max_blocks_per_seq = 4;  // contexts of at most 64 tokens: one decode chunk
  p.num_blocks = 100;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.block_size = 16;
  p.head_dim = 128;
  p.scale = 0.088f;
  return p;
}

void ExpectInvalidNaming(const cuda::PagedAttentionParams& p, const std::string& field) {
  const absl::Status st = p.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_NE(std::string(st.message()).find(field), std::string::npos) << st;
}

TEST(PagedAttentionCudaValidateTest, AcceptsValidParams) {
  EXPECT_TRUE(ValidParams().Validate().ok()) << ValidParams().Validate();
  EXPECT_EQ(cuda::PagedAttentionWorkspaceBytes(ValidParams()), 0);
}

// The bound an executor reserves is the most any step within it asks for, checked against
// every batch size and every context length (not only powers of two: the chunk length switches
// between them). No device needed.
TEST(PagedAttentionCudaValidateTest, MaxWorkspaceIsTheMostOfEveryStepWithinTheBounds) {
  struct Shape {
    int64_t heads, kv_heads, head_dim, block_size, seqs, max_len, window;
  };
  for (const Shape& sh : {Shape{32, 8, 128, 16, 12, 3000, 0}, Shape{4, 2, 64, 8, 9, 2100, 0},
                          Shape{14, 2, 64, 16, 5, 2500, 0}, Shape{32, 8, 128, 16, 6, 3000, 700}}) {
    cuda::PagedAttentionParams bounds;
    bounds.num_heads = sh.heads;
    bounds.num_kv_heads = sh.kv_heads;
    bounds.head_dim = sh.head_dim;
    bounds.block_size = sh.block_size;
    bounds.window = sh.window;
    bounds.num_seqs = sh.seqs;
    bounds.max_seq_len = sh.max_len;
    int64_t most = 0;
    for (int64_t n = 1; n <= sh.seqs; ++n) {
      for (int64_t len = 1; len <= sh.max_len; ++len) {
        cuda::PagedAttentionParams p = bounds;
        p.num_seqs = n;
        p.num_tokens = n;
        p.max_seq_len = len;
        p.max_blocks_per_seq = (len + sh.block_size - 1) / sh.block_size;
        most = std::max(most, cuda::PagedAttentionWorkspaceBytes(p));
      }
    }
    EXPECT_GT(most, 0) << sh.heads << " heads";
    EXPECT_EQ(cuda::PagedAttentionMaxWorkspaceBytes(bounds), most) << sh.heads << " heads";
  }
}

TEST(PagedAttentionCudaValidateTest, NamesTheField) {
  auto p = ValidParams();
  p.query = nullptr;
  ExpectInvalidNaming(p, "query");
  p = ValidParams();
  p.query = reinterpret_cast<const float*>(256 + 4);
  ExpectInvalidNaming(p, "query");
  p = ValidParams();
  p.output = const_cast<float*>(p.query);
  ExpectInvalidNaming(p, "output");
  p = ValidParams();
  p.head_dim = 96;
  ExpectInvalidNaming(p, "head_dim");
  p = ValidParams();
  p.block_size = 24;
  ExpectInvalidNaming(p, "block_size");
  p = ValidParams();
  p.k_dtype = KvDType::kInt8;
  ExpectInvalidNaming(p, "k_meta");
  p = ValidParams();
  p.v_dtype = KvDType::kInt4;
  ExpectInvalidNaming(p, "v_meta");
  p = ValidParams();
  p.num_kv_heads = 5;
  ExpectInvalidNaming(p, "num_kv_heads");
  p = ValidParams();
  p.scale = 0.f;
  ExpectInvalidNaming(p, "scale");
  p = ValidParams();
  p.max_query_len = 5;
  ExpectInvalidNaming(p, "max_query_len");
  p = ValidParams();
  p.num_seqs = 70000;
  ExpectInvalidNaming(p, "num_seqs");
}

TEST(PagedAttentionCudaValidateTest, LongContextsNeedTheWorkspace) {
  auto p = ValidParams();
  p.max_blocks_per_seq = 2048;  // 32K tokens: several decode chunks
  const int64_t need = cuda::PagedAttentionWorkspaceBytes(p);
  // Partial output, max and sum for every (sequence, chunk, head).
  EXPECT_GT(need, 0);
  EXPECT_EQ(need % (4 * p.num_seqs * p.num_heads * (p.head_dim + 2)), 0);
  ExpectInvalidNaming(p, "workspace");
  p.workspace = FakeDevicePointer<void>(8);
  p.workspace_bytes = need - 1;
  ExpectInvalidNaming(p, "workspace_bytes");
  p.workspace_bytes = need;
  EXPECT_TRUE(p.Validate().ok()) << p.Validate();
  // A tighter max_seq_len never needs more; one chunk's worth needs none.
  p.max_seq_len = 4096;
  EXPECT_LE(cuda::PagedAttentionWorkspaceBytes(p), need);
  p.max_seq_len = 64;
  EXPECT_EQ(cuda::PagedAttentionWorkspaceBytes(p), 0);
  // A window of one chunk needs none either, however long the contexts.
  p.max_seq_len = 0;
  p.window = 64;
  EXPECT_EQ(cuda::PagedAttentionWorkspaceBytes(p), 0);
  p.window = -1;
  ExpectInvalidNaming(p, "window");
}

}  // namespace
}  // namespace kvgrid::kernels
