// cuda_attention_bench: decode attention on the GPU (kernels/cuda/paged_attention.cuh), in the
// shape of Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128, 16-token blocks),
// for batches of 1..64 sequences at 1K/8K/32K tokens of context and fp16/int8/int4 KV.
//
// Decode attention reads every K and V row of every sequence once per step and does little
// arithmetic per byte, so its figure of merit is the memory bandwidth it achieves:
//   achieved bytes/s = KV bytes read (values + metadata, K and V, every position of every
//                      sequence and KV head) / kernel time
// against the device's peak (2 * memory clock * bus width, from cudaDevAttrMemoryClockRate and
// cudaDevAttrGlobalMemoryBusWidth, which CUDA 13 reports instead of cudaDeviceProp's
// memoryClockRate; --peak-gbs overrides it with the datasheet figure, e.g. 4800 for an H200).
// The kernel time covers one LaunchPagedAttention call (the split-K kernel and the merge),
// measured with cudaEvents around many back-to-back calls.
//
// The arena is random but validly encoded data filled on the device. Each measurement cycles
// through disjoint sets of blocks (up to 64), so that small batches are read from HBM rather
// than from the 50 MB L2 of the previous call.
//
//   build/bin/cuda_attention_bench [--json] [--peak-gbs 4800] [--contexts 1024,8192,32768]
//                                  [--batches 1,4,16,64] [--dtypes fp16,int8,int4,fp8_e4m3]
//                                  [--min-ms 20]
// Exits 0 with a message when no GPU is visible.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/paged_attention.cuh"
#include "kernels/kv_dtype.h"

namespace {

using kvgrid::kernels::KvDType;
using kvgrid::kernels::KvRowLayout;
using kvgrid::kernels::KvRowLayoutFor;

constexpr int64_t kHeads = 32;
constexpr int64_t kKvHeads = 8;
constexpr int64_t kHeadDim = 128;
constexpr int64_t kBlockSize = 16;
constexpr int kMaxTableSets = 64;

void Die(const char* what, cudaError_t err) {
  std::fprintf(stderr, "cuda_attention_bench: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

#define BENCH_CUDA(call)                       \
  do {                                         \
    const cudaError_t err_ = (call);           \
    if (err_ != cudaSuccess) Die(#call, err_); \
  } while (0)

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// A uniform float in [-1, 1) from a hash.
__device__ float UnitFloat(uint32_t h) {
  return static_cast<float>(h >> 8) * (2.f / 16777216.f) - 1.f;
}

// Fills a value plane with valid encodings of random values: 32-bit words of fp32, two fp16 or
// bf16, or four int8 / eight int4 codes (any bits are valid codes there).
__global__ void FillValues(uint32_t* words, int64_t n, KvDType dtype, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h0 = Hash(seed + 2 * i), h1 = Hash(seed + 2 * i + 1);
    uint32_t w = h0;
    if (dtype == KvDType::kF32) {
      w = __float_as_uint(UnitFloat(h0));
    } else if (dtype == KvDType::kF16) {
      w = static_cast<uint32_t>(__half_as_ushort(__float2half_rn(UnitFloat(h0)))) |
          (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(UnitFloat(h1)))) << 16);
    } else if (dtype == KvDType::kBF16) {
      w = (__float_as_uint(UnitFloat(h0)) >> 16) | (__float_as_uint(UnitFloat(h1)) & 0xffff0000u);
    }
    words[i] = w;
  }
}

// Fills a meta plane with one plausible 16-bit word everywhere: an int8 row scale, or an int4
// group scale with zero point 8.
__global__ void FillMeta(uint16_t* words, int64_t n, uint16_t word) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    words[i] = word;
  }
}

std::vector<int64_t> ParseList(const char* s) {
  std::vector<int64_t> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

std::vector<KvDType> ParseDTypes(const char* s) {
  std::vector<KvDType> out;
  std::string list(s);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    auto d = kvgrid::kernels::ParseKvDType(name);
    if (!d.ok()) {
      std::fprintf(stderr, "cuda_attention_bench: %s\n", std::string(d.status().message()).c_str());
      std::exit(2);
    }
    out.push_back(*d);
    start = comma + 1;
  }
  return out;
}

struct Result {
  std::string dtype;
  int64_t batch = 0, context = 0, table_sets = 0;
  double us_per_call = 0, kv_bytes = 0, gbs = 0;
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  double peak_flag = 0;
  double min_ms = 20;
  std::vector<int64_t> contexts = {1024, 8192, 32768};
  std::vector<int64_t> batches = {1, 4, 16, 64};
  std::vector<KvDType> dtypes = {KvDType::kF16, KvDType::kInt8, KvDType::kInt4,
                                 KvDType::kFp8E4m3};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "cuda_attention_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json") {
      json = true;
    } else if (a == "--peak-gbs") {
      peak_flag = std::atof(next());
    } else if (a == "--contexts") {
      contexts = ParseList(next());
    } else if (a == "--batches") {
      batches = ParseList(next());
    } else if (a == "--dtypes") {
      dtypes = ParseDTypes(next());
    } else if (a == "--min-ms") {
      min_ms = std::atof(next());
    } else {
      std::fprintf(stderr,
                   "usage: cuda_attention_bench [--json] [--peak-gbs GB/s] "
                   "[--contexts 1024,8192,32768] [--batches 1,4,16,64] "
                   "[--dtypes fp16,int8,int4,fp8_e4m3] [--min-ms 20]\n");
      return 2;
    }
  }
  if (contexts.empty() || batches.empty() || dtypes.empty() ||
      *std::min_element(contexts.begin(), contexts.end()) <= 0 ||
      *std::min_element(batches.begin(), batches.end()) <= 0) {
    std::fprintf(stderr,
                 "cuda_attention_bench: contexts, batches and dtypes must be non-empty "
                 "lists of positive values\n");
    return 2;
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    if (json) {
      std::printf("{\"skipped\": \"no CUDA device visible\"}\n");
    } else {
      std::printf("cuda_attention_bench: no CUDA device visible; nothing to measure\n");
    }
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  int mem_clock_khz = 0, bus_bits = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, 0));
  BENCH_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
  const double device_peak = 2.0 * mem_clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // GB/s, DDR
  const double peak = peak_flag > 0 ? peak_flag : device_peak;

  const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t max_bps = (max_context + kBlockSize - 1) / kBlockSize;
  const int64_t num_blocks = max_batch * max_bps;  // the biggest batch fills the arena once
  const int64_t rows = num_blocks * kKvHeads * kBlockSize;

  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));

  std::mt19937_64 rng(1);
  std::vector<int32_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);

  std::vector<Result> results;
  for (KvDType dtype : dtypes) {
    const KvRowLayout l = KvRowLayoutFor(dtype, kHeadDim);
    void *k = nullptr, *v = nullptr, *k_meta = nullptr, *v_meta = nullptr;
    BENCH_CUDA(cudaMalloc(&k, rows * l.value_bytes));
    BENCH_CUDA(cudaMalloc(&v, rows * l.value_bytes));
    FillValues<<<4096, 256>>>(static_cast<uint32_t*>(k), rows * l.value_bytes / 4, dtype, 1);
    FillValues<<<4096, 256>>>(static_cast<uint32_t*>(v), rows * l.value_bytes / 4, dtype,
                              1ull << 40);
    BENCH_CUDA(cudaGetLastError());
    if (l.meta_bytes > 0) {
      BENCH_CUDA(cudaMalloc(&k_meta, rows * l.meta_bytes));
      BENCH_CUDA(cudaMalloc(&v_meta, rows * l.meta_bytes));
      // int8, fp8: scale 2^-7; int4: scale 2^-4 (low mantissa bits clear) with zero point 8.
      const uint16_t word = dtype == KvDType::kInt4 ? (0x2c00 | 8) : 0x2000;
      FillMeta<<<4096, 256>>>(static_cast<uint16_t*>(k_meta), rows * l.meta_bytes / 2, word);
      FillMeta<<<4096, 256>>>(static_cast<uint16_t*>(v_meta), rows * l.meta_bytes / 2, word);
      BENCH_CUDA(cudaGetLastError());
    }
    BENCH_CUDA(cudaDeviceSynchronize());

    for (int64_t context : contexts) {
      for (int64_t batch : batches) {
        const int64_t bps = (context + kBlockSize - 1) / kBlockSize;
        const int64_t sets = std::clamp<int64_t>(num_blocks / (batch * bps), 1, kMaxTableSets);
        // Set i uses blocks perm[i * batch * bps ...]: disjoint between sets.
        std::vector<int32_t> tables(sets * batch * bps);
        std::copy(perm.begin(), perm.begin() + tables.size(), tables.begin());
        std::vector<int32_t> seq_lens(batch, static_cast<int32_t>(context));
        std::vector<int32_t> query_start(batch + 1);
        std::iota(query_start.begin(), query_start.end(), 0);
        std::vector<float> query(batch * kHeads * kHeadDim);
        std::normal_distribution<float> normal(0.f, 1.f);
        for (float& x : query) x = normal(rng);

        int32_t *d_tables, *d_lens, *d_qs;
        float *d_q, *d_out;
        BENCH_CUDA(cudaMalloc(&d_tables, tables.size() * 4));
        BENCH_CUDA(cudaMalloc(&d_lens, seq_lens.size() * 4));
        BENCH_CUDA(cudaMalloc(&d_qs, query_start.size() * 4));
        BENCH_CUDA(cudaMalloc(&d_q, query.size() * 4));
        BENCH_CUDA(cudaMalloc(&d_out, query.size() * 4));
        BENCH_CUDA(cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
        BENCH_CUDA(
            cudaMemcpy(d_lens, seq_lens.data(), seq_lens.size() * 4, cudaMemcpyHostToDevice));
        BENCH_CUDA(
            cudaMemcpy(d_qs, query_start.data(), query_start.size() * 4, cudaMemcpyHostToDevice));
        BENCH_CUDA(cudaMemcpy(d_q, query.data(), query.size() * 4, cudaMemcpyHostToDevice));

        kvgrid::kernels::cuda::PagedAttentionParams p;
        p.query = d_q;
        p.output = d_out;
        p.k_cache = k;
        p.v_cache = v;
        p.k_meta = k_meta;
        p.v_meta = v_meta;
        p.k_dtype = p.v_dtype = dtype;
        p.seq_lens = d_lens;
        p.query_start = d_qs;
        p.num_seqs = batch;
        p.num_tokens = batch;
        p.max_blocks_per_seq = bps;
        p.num_blocks = num_blocks;
        p.num_heads = kHeads;
        p.num_kv_heads = kKvHeads;
        p.block_size = kBlockSize;
        p.head_dim = kHeadDim;
        p.scale = 1.f / std::sqrt(static_cast<float>(kHeadDim));
        p.max_seq_len = context;
        p.max_query_len = 1;
        const int64_t ws = kvgrid::kernels::cuda::PagedAttentionWorkspaceBytes(p);
        void* d_ws = nullptr;
        if (ws > 0) BENCH_CUDA(cudaMalloc(&d_ws, ws));
        p.workspace = d_ws;
        p.workspace_bytes = ws;

        int64_t call = 0;
        auto launch = [&]() {
          p.block_tables = d_tables + (call++ % sets) * batch * bps;
          const absl::Status st = kvgrid::kernels::cuda::LaunchPagedAttention(p, stream);
          if (!st.ok()) {
            std::fprintf(stderr, "cuda_attention_bench: %s\n", std::string(st.message()).c_str());
            std::exit(1);
          }
        };
        // Warm up, then size the timed run to about min_ms.
        for (int i = 0; i < 3; ++i) launch();
        BENCH_CUDA(cudaEventRecord(start, stream));
        for (int i = 0; i < 5; ++i) launch();
        BENCH_CUDA(cudaEventRecord(stop, stream));
        BENCH_CUDA(cudaEventSynchronize(stop));
        float probe_ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&probe_ms, start, stop));
        const int64_t iters = std::clamp<int64_t>(
            static_cast<int64_t>(min_ms / std::max(probe_ms / 5, 1e-3f)), 10, 10000);
        BENCH_CUDA(cudaEventRecord(start, stream));
        for (int64_t i = 0; i < iters; ++i) launch();
        BENCH_CUDA(cudaEventRecord(stop, stream));
        BENCH_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));

        Result r;
        r.dtype = std::string(kvgrid::kernels::KvDTypeName(dtype));
        r.batch = batch;
        r.context = context;
        r.table_sets = sets;
        r.us_per_call = 1e3 * ms / static_cast<double>(iters);
        r.kv_bytes = static_cast<double>(batch) * context * kKvHeads * 2 * l.total();
        r.gbs = r.kv_bytes / (r.us_per_call * 1e3);
        results.push_back(r);
        if (!json) {
          std::printf("%-5s batch %3lld ctx %6lld: %9.1f us  %8.1f GB/s  %5.1f%% of peak\n",
                      r.dtype.c_str(), static_cast<long long>(batch),
                      static_cast<long long>(context), r.us_per_call, r.gbs, 100.0 * r.gbs / peak);
          std::fflush(stdout);
        }

        cudaFree(d_ws);
        cudaFree(d_tables);
        cudaFree(d_lens);
        cudaFree(d_qs);
        cudaFree(d_q);
        cudaFree(d_out);
      }
    }
    cudaFree(k);
    cudaFree(v);
    cudaFree(k_meta);
    cudaFree(v_meta);
  }

  if (json) {
    std::printf(
        "{\"device\": \"%s\", \"sm_count\": %d, \"device_peak_gbs\": %.1f, "
        "\"peak_gbs\": %.1f, \"peak_source\": \"%s\", \"heads\": %lld, "
        "\"kv_heads\": %lld, \"head_dim\": %lld, \"block_size\": %lld, \"results\": [",
        prop.name, prop.multiProcessorCount, device_peak, peak,
        peak_flag > 0 ? "--peak-gbs" : "device attributes", static_cast<long long>(kHeads),
        static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim),
        static_cast<long long>(kBlockSize));
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf(
          "%s\n  {\"k_dtype\": \"%s\", \"v_dtype\": \"%s\", \"batch\": %lld, "
          "\"context\": %lld, \"table_sets\": %lld, \"us_per_call\": %.3f, "
          "\"kv_bytes\": %.0f, \"gb_per_s\": %.1f, \"fraction_of_peak\": %.4f}",
          i == 0 ? "" : ",", r.dtype.c_str(), r.dtype.c_str(), static_cast<long long>(r.batch),
          static_cast<long long>(r.context), static_cast<long long>(r.table_sets), r.us_per_call,
          r.kv_bytes, r.gbs, r.gbs / peak);
    }
    std::printf("\n]}\n");
  } else {
    std::printf("peak %.1f GB/s (%s; device attributes say %.1f)\n", peak,
                peak_flag > 0 ? "--peak-gbs" : "device attributes", device_peak);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  return 0;
}
