// attention_bench: decode attention (one query token per sequence) over the paged KV cache, per
// KV dtype, in the shape of Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128,
// 16-token blocks), at several context lengths.
//
// Each measurement decodes a batch of sequences whose caches together hold --total-tokens
// tokens (scattered blocks), so the cache is read from memory rather than from the last-level
// cache. The dtypes of one context length are timed in turn, --repeats rounds, and each keeps
// its best round (the machine may be shared). A "call" is one sequence's attention for one new
// token in one layer; GB/s counts the K and V bytes (values and metadata) those calls read.
//
//   build/bin/attention_bench [--json] [--contexts 1024,4096,8192] [--total-tokens 32768]
//                             [--min-seconds 0.3] [--repeats 3] [--dtypes fp16,int8,int8/int4]
//                             [--huge-pages] [--heads 32] [--kv-heads 8] [--head-dim 128]
//                             [--flush-mb 512]
// (--huge-pages: madvise the arena planes MADV_HUGEPAGE, which KvPool does not do)
// (--dtypes: K dtype, or K/V; default fp32, fp16, bf16, int8, int4, int8/int4 and fp8_e4m3)
// (--heads/--kv-heads/--head-dim: another shape, e.g. Qwen2-0.5B's 14/2/64)
// (--flush-mb: read that much other memory before each call and time the calls alone: the
//  cache then comes from DRAM, as in batch-1 decode, where the weights pass in between; the
//  calls are then timed for a tenth of --min-seconds)
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/kv_write.h"
#include "kernels/kv_dtype.h"
#include "nlohmann/json.hpp"

namespace {

using kvgrid::kernels::KvDType;
using kvgrid::kernels::KvRowLayout;
using kvgrid::kernels::KvRowLayoutFor;
using Clock = std::chrono::steady_clock;

// The attention shape: Llama-3-8B's unless --heads/--kv-heads/--head-dim say otherwise.
int64_t kHeads = 32;
int64_t kKvHeads = 8;
int64_t kHeadDim = 128;
constexpr int64_t kBlockSize = 16;

// An arena plane allocated as KvPool allocates it: an anonymous mapping, zero-filled (and,
// with --huge-pages, backed by transparent huge pages where the kernel allows).
class Plane {
 public:
  Plane(int64_t bytes, bool huge) : bytes_(static_cast<size_t>(bytes)) {
    if (bytes_ == 0) return;
    data_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data_ == MAP_FAILED) {
      std::fprintf(stderr, "mmap of %zu bytes failed\n", bytes_);
      std::exit(1);
    }
    if (huge) madvise(data_, bytes_, MADV_HUGEPAGE);
  }
  ~Plane() {
    if (data_) munmap(data_, bytes_);
  }
  Plane(const Plane&) = delete;
  Plane& operator=(const Plane&) = delete;
  void* data() const { return data_; }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

bool g_huge_pages = false;  // KvPool does not ask for them either

// --flush-mb: memory read between timed calls, so that the cache is read from DRAM.
std::vector<int64_t> g_flush;
volatile int64_t g_flush_sink = 0;
void Flush() {
  int64_t sum = 0;
#pragma omp parallel for reduction(+ : sum)
  for (size_t i = 0; i < g_flush.size(); i += 8) sum += g_flush[i];
  g_flush_sink = g_flush_sink + sum;
}

struct Result {
  std::string k_dtype, v_dtype;
  int64_t context = 0;
  int64_t seqs = 0;
  double seconds_per_call = 0;
  double calls_per_s = 0;
  double gb_per_s = 0;
};

// One dtype at one context length: the arena filled with random rows and the batch's params.
class Case {
 public:
  Case(KvDType k_dtype, KvDType v_dtype, int64_t context, int64_t total_tokens)
      : k_dtype_(k_dtype),
        v_dtype_(v_dtype),
        context_(context),
        seqs_(std::max<int64_t>(1, total_tokens / context)),
        kl_(KvRowLayoutFor(k_dtype, kHeadDim)),
        vl_(KvRowLayoutFor(v_dtype, kHeadDim)) {
    const int64_t blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
    const int64_t num_blocks = seqs_ * blocks_per_seq;
    const int64_t rows = num_blocks * kKvHeads * kBlockSize;
    k_ = std::make_unique<Plane>(rows * kl_.value_bytes, g_huge_pages);
    v_ = std::make_unique<Plane>(rows * vl_.value_bytes, g_huge_pages);
    k_meta_ = std::make_unique<Plane>(rows * kl_.meta_bytes, g_huge_pages);
    v_meta_ = std::make_unique<Plane>(rows * vl_.meta_bytes, g_huge_pages);

    std::mt19937_64 rng(1);
    tables_.resize(num_blocks);  // [seqs, blocks_per_seq]: a random permutation of the arena
    std::iota(tables_.begin(), tables_.end(), 0);
    std::shuffle(tables_.begin(), tables_.end(), rng);

    // Fill every slot with random rows, one sequence at a time.
    std::normal_distribution<float> normal(0.f, 1.f);
    std::vector<float> kv(context * kKvHeads * kHeadDim);
    std::vector<int64_t> slots(context);
    for (int64_t s = 0; s < seqs_; ++s) {
      for (float& x : kv) x = normal(rng);
      for (int64_t p = 0; p < context; ++p) {
        slots[p] =
            static_cast<int64_t>(tables_[s * blocks_per_seq + p / kBlockSize]) * kBlockSize +
            p % kBlockSize;
      }
      Check(kvgrid::kernels::cpu::KvWrite({.key = kv.data(),
                                           .value = kv.data(),
                                           .slots = slots.data(),
                                           .k_cache = k_->data(),
                                           .v_cache = v_->data(),
                                           .k_meta = k_meta_->data(),
                                           .v_meta = v_meta_->data(),
                                           .k_dtype = k_dtype,
                                           .v_dtype = v_dtype,
                                           .num_tokens = context,
                                           .num_blocks = num_blocks,
                                           .num_kv_heads = kKvHeads,
                                           .block_size = kBlockSize,
                                           .head_dim = kHeadDim}),
            "KvWrite");
    }

    query_.resize(seqs_ * kHeads * kHeadDim);
    out_.resize(query_.size());
    for (float& x : query_) x = normal(rng);
    seq_lens_.assign(seqs_, static_cast<int32_t>(context));
    query_start_.resize(seqs_ + 1);
    std::iota(query_start_.begin(), query_start_.end(), 0);
    params_ = {.query = query_.data(),
               .output = out_.data(),
               .k_cache = k_->data(),
               .v_cache = v_->data(),
               .k_meta = k_meta_->data(),
               .v_meta = v_meta_->data(),
               .k_dtype = k_dtype,
               .v_dtype = v_dtype,
               .block_tables = tables_.data(),
               .seq_lens = seq_lens_.data(),
               .query_start = query_start_.data(),
               .num_seqs = seqs_,
               .num_tokens = seqs_,
               .max_blocks_per_seq = blocks_per_seq,
               .num_blocks = num_blocks,
               .num_heads = kHeads,
               .num_kv_heads = kKvHeads,
               .block_size = kBlockSize,
               .head_dim = kHeadDim,
               .scale = 1.f / std::sqrt(static_cast<float>(kHeadDim))};
    Check(kvgrid::kernels::cpu::PagedAttention(params_), "PagedAttention");  // warm-up
  }

  // Runs the batch for at least `min_seconds` (and 3 times); keeps the best rate seen. With
  // --flush-mb, each call first reads that much other memory (untimed), as a decode step's
  // weights pass between one layer's attention and the next step's.
  void Time(double min_seconds) {
    if (!g_flush.empty()) {
      double in_calls = 0;
      int64_t iters = 0;
      while (iters < 3 || in_calls < min_seconds / 10) {
        Flush();
        const auto t0 = Clock::now();
        Check(kvgrid::kernels::cpu::PagedAttention(params_), "PagedAttention");
        in_calls += std::chrono::duration<double>(Clock::now() - t0).count();
        ++iters;
      }
      best_calls_per_s_ =
          std::max(best_calls_per_s_, static_cast<double>(iters * seqs_) / in_calls);
      return;
    }
    int64_t iters = 0;
    const auto t0 = Clock::now();
    double elapsed = 0;
    while (iters < 3 || elapsed < min_seconds) {
      Check(kvgrid::kernels::cpu::PagedAttention(params_), "PagedAttention");
      ++iters;
      elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    }
    best_calls_per_s_ = std::max(best_calls_per_s_, static_cast<double>(iters * seqs_) / elapsed);
  }

  Result result() const {
    const double bytes_per_call =
        static_cast<double>(context_ * kKvHeads * (kl_.total() + vl_.total()));
    Result r;
    r.k_dtype = std::string(kvgrid::kernels::KvDTypeName(k_dtype_));
    r.v_dtype = std::string(kvgrid::kernels::KvDTypeName(v_dtype_));
    r.context = context_;
    r.seqs = seqs_;
    r.seconds_per_call = 1.0 / best_calls_per_s_;
    r.calls_per_s = best_calls_per_s_;
    r.gb_per_s = bytes_per_call * best_calls_per_s_ / 1e9;
    return r;
  }

 private:
  static void Check(const absl::Status& st, const char* what) {
    if (!st.ok()) {
      std::fprintf(stderr, "%s: %s\n", what, std::string(st.message()).c_str());
      std::exit(1);
    }
  }

  KvDType k_dtype_, v_dtype_;
  int64_t context_, seqs_;
  KvRowLayout kl_, vl_;
  std::unique_ptr<Plane> k_, v_, k_meta_, v_meta_;
  std::vector<int32_t> tables_, seq_lens_, query_start_;
  std::vector<float> query_, out_;
  kvgrid::kernels::cpu::PagedAttentionParams params_;
  double best_calls_per_s_ = 0;
};

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::vector<int64_t> contexts = {1024, 4096, 8192};
  int64_t total_tokens = 32768;
  double min_seconds = 0.3;
  int repeats = 3;
  std::vector<std::pair<KvDType, KvDType>> combos = {
      {KvDType::kF32, KvDType::kF32},   {KvDType::kF16, KvDType::kF16},
      {KvDType::kBF16, KvDType::kBF16}, {KvDType::kInt8, KvDType::kInt8},
      {KvDType::kInt4, KvDType::kInt4}, {KvDType::kInt8, KvDType::kInt4},
      {KvDType::kFp8E4m3, KvDType::kFp8E4m3}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json") {
      json = true;
    } else if (a == "--contexts") {
      contexts.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) contexts.push_back(std::stoll(item));
    } else if (a == "--total-tokens") {
      total_tokens = std::stoll(next());
    } else if (a == "--min-seconds") {
      min_seconds = std::stod(next());
    } else if (a == "--repeats") {
      repeats = std::max(1, std::stoi(next()));
    } else if (a == "--heads") {
      kHeads = std::stoll(next());
    } else if (a == "--kv-heads") {
      kKvHeads = std::stoll(next());
    } else if (a == "--head-dim") {
      kHeadDim = std::stoll(next());
    } else if (a == "--flush-mb") {
      g_flush.assign(std::stoll(next()) * (1 << 20) / sizeof(int64_t), 1);
    } else if (a == "--huge-pages") {
      g_huge_pages = true;
    } else if (a == "--dtypes") {
      combos.clear();
      std::stringstream ss(next());
      for (std::string item; std::getline(ss, item, ',');) {
        const size_t slash = item.find('/');
        auto k = kvgrid::kernels::ParseKvDType(item.substr(0, slash));
        auto v = kvgrid::kernels::ParseKvDType(
            slash == std::string::npos ? item : item.substr(slash + 1));
        if (!k.ok() || !v.ok()) {
          std::fprintf(stderr, "--dtypes: bad entry '%s'\n", item.c_str());
          return 2;
        }
        combos.emplace_back(*k, *v);
      }
    } else {
      std::fprintf(stderr,
                   "usage: attention_bench [--json] [--contexts 1024,4096,8192] "
                   "[--total-tokens N] [--min-seconds S] [--repeats R] [--dtypes K[/V],...] "
                   "[--huge-pages] [--heads 32] [--kv-heads 8] [--head-dim 128] [--flush-mb MB]\n");
      return 2;
    }
  }

  const std::string load_before = LoadAverage();
  std::vector<Result> results;
  for (int64_t context : contexts) {
    std::vector<std::unique_ptr<Case>> cases;
    for (auto [kd, vd] : combos) {
      cases.push_back(std::make_unique<Case>(kd, vd, context, total_tokens));
    }
    for (int rep = 0; rep < repeats; ++rep) {
      for (auto& c : cases) c->Time(min_seconds);
    }
    for (auto& c : cases) {
      results.push_back(c->result());
      const Result& r = results.back();
      if (!json) {
        std::printf("K %-4s V %-4s ctx %6lld  seqs %3lld  %9.1f calls/s  %8.3f ms/call  "
                    "%6.2f GB/s\n",
                    r.k_dtype.c_str(), r.v_dtype.c_str(), static_cast<long long>(r.context),
                    static_cast<long long>(r.seqs), r.calls_per_s, r.seconds_per_call * 1e3,
                    r.gb_per_s);
        std::fflush(stdout);
      }
    }
  }

  // Speed of each dtype relative to fp16 at the same context, measured in this run.
  nlohmann::json rows = nlohmann::json::array();
  for (const Result& r : results) {
    double fp16 = 0;
    for (const Result& o : results) {
      if (o.context == r.context && o.k_dtype == "fp16" && o.v_dtype == "fp16") {
        fp16 = o.calls_per_s;
      }
    }
    rows.push_back({{"k_dtype", r.k_dtype},
                    {"v_dtype", r.v_dtype},
                    {"context", r.context},
                    {"seqs", r.seqs},
                    {"calls_per_s", r.calls_per_s},
                    {"ms_per_call", r.seconds_per_call * 1e3},
                    {"gb_per_s", r.gb_per_s},
                    {"speed_vs_fp16", fp16 > 0 ? r.calls_per_s / fp16 : 0.0}});
    if (!json && !(r.k_dtype == "fp16" && r.v_dtype == "fp16") && fp16 > 0) {
      std::printf("ctx %6lld  K %-4s V %-4s  %.2fx fp16\n", static_cast<long long>(r.context),
                  r.k_dtype.c_str(), r.v_dtype.c_str(), r.calls_per_s / fp16);
    }
  }
  if (json) {
    nlohmann::json j = {{"bench", "attention"},
                        {"shape",
                         {{"num_heads", kHeads},
                          {"num_kv_heads", kKvHeads},
                          {"head_dim", kHeadDim},
                          {"block_size", kBlockSize}}},
                        {"total_tokens", total_tokens},
                        {"repeats", repeats},
                        {"min_seconds", min_seconds},
                        {"huge_pages", g_huge_pages},
                        {"flush_mb", static_cast<int64_t>(g_flush.size() * sizeof(int64_t) >> 20)},
                        {"threads", omp_get_max_threads()},
                        {"loadavg_before", load_before},
                        {"loadavg_after", LoadAverage()},
                        {"results", rows}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("threads %d, load average before %s, after %s\n", omp_get_max_threads(),
                load_before.c_str(), LoadAverage().c_str());
  }
  return 0;
}
