// kv_waste_bench: how many sequences a fixed KV budget holds, and how much of the reserved
// memory is wasted, under three allocation schemes fed the same request stream — plus how many
// tokens each KV dtype fits in the same bytes.
//
// Workload (a modelled distribution resembling chat traffic, not a measured trace):
//   prompt length  lognormal, median 300 tokens, sigma 1.0 (mean ~495), clamped to [1, 4096]
//   output length  lognormal, median 200 tokens, sigma 0.9 (mean ~300), clamped to [1, 2048]
//   drawn from mt19937_64 with a fixed seed through our own Box-Muller transform, so every
//   standard library produces the same stream. The queue never runs dry (saturated load).
//
// Engine model (one loop for all three allocators): at admission a sequence's prompt is
// written at once (prefill); then every step each running sequence appends one token (decode)
// until it reaches prompt + output tokens, when it finishes and releases its memory. Lengths
// are random, so sequences finish in random order. After the finishes of a step, waiting
// sequences are admitted first-come-first-served until the head of the queue does not fit
// (no skipping ahead). Figures are averaged over the steps after a warm-up.
//
// Allocators, all over the same budget of B tokens:
//   paged       the real worker::BlockManager, block 16. A sequence holds only the blocks its
//               current length needs and takes one more block when it grows past a block
//               boundary, so only its last block is partly filled. Admission needs the
//               prompt's blocks plus a 1% watermark of free blocks; when a growing sequence
//               finds no free block, the newest running sequence is preempted (its blocks
//               freed, re-queued at the front, its prompt + generated tokens recomputed).
//   max-len     contiguous reservation of the longest possible sequence (4096 + 2048 tokens)
//               per sequence: floor(B / 6144) fixed slots.
//   exact       contiguous reservation of exactly prompt + output tokens, first-fit over one
//               linear address space with a coalescing free list. It is told each sequence's
//               final length in advance — an oracle no server has — so it is the best case
//               for contiguous allocation. Holes appear as sequences finish out of order.
//
// Internal waste = 1 - tokens stored / tokens reserved (both summed over the measured steps).
// External fragmentation (exact only) = 1 - largest free hole / free tokens, averaged over
// steps with free space; also the share of steps whose queue head is refused although the
// free total would hold it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "kernels/kv_dtype.h"
#include "model/model_config.h"
#include "nlohmann/json.hpp"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_planner.h"

namespace {

using kvgrid::kernels::KvDType;

constexpr int64_t kMaxPrompt = 4096;
constexpr int64_t kMaxOutput = 2048;
constexpr int64_t kMaxLen = kMaxPrompt + kMaxOutput;
constexpr int32_t kBlockSize = 16;

struct Request {
  int64_t prompt = 0;
  int64_t output = 0;
};

// The workload of the file comment; the same seed gives the same requests in the same order.
class RequestStream {
 public:
  explicit RequestStream(uint64_t seed) : rng_(seed) {}
  Request Next() {
    Request r;
    r.prompt = Draw(300.0, 1.0, kMaxPrompt);
    r.output = Draw(200.0, 0.9, kMaxOutput);
    return r;
  }

 private:
  double Uniform() {  // (0, 1)
    return (static_cast<double>(rng_() >> 11) + 0.5) * 0x1.0p-53;
  }
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(Uniform()));
    const double t = 2.0 * std::numbers::pi * Uniform();
    spare_ = r * std::sin(t);
    has_spare_ = true;
    return r * std::cos(t);
  }
  int64_t Draw(double median, double sigma, int64_t cap) {
    const double x = median * std::exp(sigma * Normal());
    return std::clamp<int64_t>(std::llround(x), 1, cap);
  }
  std::mt19937_64 rng_;
  bool has_spare_ = false;
  double spare_ = 0;
};

// What the simulation asks of an allocator. Ids are unique per admission.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual const char* name() const = 0;
  // Admits a sequence of `len` tokens now that will reach `final_len`; false if it does not fit.
  virtual bool Admit(uint64_t id, int64_t len, int64_t final_len) = 0;
  // Makes room for `len` tokens; false when memory is exhausted (the caller preempts).
  virtual bool Grow(uint64_t id, int64_t len) = 0;
  virtual void Release(uint64_t id) = 0;
  // Tokens' worth of memory held by sequences.
  virtual int64_t reserved_tokens() const = 0;
  // Free tokens, and the largest run of them one contiguous reservation could take.
  virtual int64_t free_tokens() const = 0;
  virtual int64_t largest_free_extent() const { return free_tokens(); }
  // Tokens an admission of a `len`/`final_len` sequence would need.
  virtual int64_t NeedFor(int64_t len, int64_t final_len) const = 0;
};

class PagedAllocator : public Allocator {
 public:
  explicit PagedAllocator(int64_t budget_tokens)
      : manager_(static_cast<int32_t>(budget_tokens / kBlockSize), kBlockSize),
        watermark_blocks_(std::max<int32_t>(1, manager_.num_blocks() / 100)) {}
  const char* name() const override { return "paged"; }
  bool Admit(uint64_t id, int64_t len, int64_t /*final_len*/) override {
    if (manager_.num_free_blocks() - manager_.BlocksFor(len) < watermark_blocks_) return false;
    return manager_.Reserve(id, len).ok();
  }
  bool Grow(uint64_t id, int64_t len) override { return manager_.Reserve(id, len).ok(); }
  void Release(uint64_t id) override { manager_.Free(id); }
  int64_t reserved_tokens() const override {
    return static_cast<int64_t>(manager_.num_used_blocks()) * kBlockSize;
  }
  int64_t free_tokens() const override {
    return static_cast<int64_t>(manager_.num_free_blocks()) * kBlockSize;
  }
  int64_t NeedFor(int64_t len, int64_t /*final_len*/) const override {
    return (manager_.BlocksFor(len) + watermark_blocks_) * kBlockSize;
  }

 private:
  kvgrid::worker::BlockManager manager_;
  int32_t watermark_blocks_;
};

class MaxLengthAllocator : public Allocator {
 public:
  explicit MaxLengthAllocator(int64_t budget_tokens) : slots_(budget_tokens / kMaxLen) {}
  const char* name() const override { return "max-len"; }
  bool Admit(uint64_t /*id*/, int64_t /*len*/, int64_t /*final_len*/) override {
    if (used_ == slots_) return false;
    ++used_;
    return true;
  }
  bool Grow(uint64_t, int64_t) override { return true; }
  void Release(uint64_t) override { --used_; }
  int64_t reserved_tokens() const override { return used_ * kMaxLen; }
  int64_t free_tokens() const override { return (slots_ - used_) * kMaxLen; }
  int64_t NeedFor(int64_t, int64_t) const override { return kMaxLen; }

 private:
  int64_t slots_;
  int64_t used_ = 0;
};

// First-fit over [0, budget) with a free list of holes kept in address order and coalesced.
class FirstFitAllocator : public Allocator {
 public:
  explicit FirstFitAllocator(int64_t budget_tokens)
      : budget_(budget_tokens), free_total_(budget_tokens) {
    holes_[0] = budget_tokens;
  }
  const char* name() const override { return "exact"; }
  bool Admit(uint64_t id, int64_t /*len*/, int64_t final_len) override {
    for (auto it = holes_.begin(); it != holes_.end(); ++it) {
      if (it->second < final_len) continue;
      const int64_t start = it->first;
      const int64_t rest = it->second - final_len;
      holes_.erase(it);
      if (rest > 0) holes_[start + final_len] = rest;
      owned_[id] = {start, final_len};
      free_total_ -= final_len;
      return true;
    }
    return false;
  }
  bool Grow(uint64_t, int64_t) override { return true; }
  void Release(uint64_t id) override {
    auto o = owned_.find(id);
    int64_t start = o->second.first;
    int64_t size = o->second.second;
    owned_.erase(o);
    free_total_ += size;
    auto next = holes_.lower_bound(start);
    if (next != holes_.end() && next->first == start + size) {
      size += next->second;
      next = holes_.erase(next);
    }
    if (next != holes_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        prev->second += size;
        return;
      }
    }
    holes_[start] = size;
  }
  int64_t reserved_tokens() const override { return budget_ - free_total_; }
  int64_t free_tokens() const override { return free_total_; }
  int64_t largest_free_extent() const override {
    int64_t best = 0;
    for (const auto& [start, size] : holes_) best = std::max(best, size);
    return best;
  }
  int64_t NeedFor(int64_t, int64_t final_len) const override { return final_len; }

 private:
  std::map<int64_t, int64_t> holes_;                       // start -> size
  std::map<uint64_t, std::pair<int64_t, int64_t>> owned_;  // id -> (start, size)
  int64_t budget_;
  int64_t free_total_;
};

struct Running {
  uint64_t id;
  int64_t len;
  int64_t final_len;
};

struct SimResult {
  std::string name;
  int64_t initial_fill = 0;  // sequences admitted before the first refusal
  double mean_concurrent = 0;
  int64_t min_concurrent = 0;
  int64_t max_concurrent = 0;
  double internal_waste = 0;  // 1 - stored / reserved
  double utilization = 0;     // stored / budget
  double external_fragmentation = 0;
  double blocked_by_fragmentation = 0;  // share of measured steps
  int64_t finished = 0;                 // during the measured steps
  int64_t preemptions = 0;
  int64_t recomputed_tokens = 0;
};

SimResult Simulate(Allocator& alloc, int64_t budget_tokens, uint64_t seed, int64_t warmup_steps,
                   int64_t measured_steps) {
  RequestStream stream(seed);
  std::deque<Running> waiting;   // front = next to admit
  std::vector<Running> running;  // admission order: back = newest
  uint64_t next_id = 1;
  SimResult out;
  out.name = alloc.name();

  auto admit = [&]() {
    while (true) {
      if (waiting.empty()) {
        const Request r = stream.Next();
        waiting.push_back({0, r.prompt, r.prompt + r.output});
      }
      Running s = waiting.front();
      s.id = next_id;
      if (!alloc.Admit(s.id, s.len, s.final_len)) return;
      ++next_id;
      waiting.pop_front();
      running.push_back(s);
    }
  };
  admit();
  out.initial_fill = static_cast<int64_t>(running.size());
  out.min_concurrent = INT64_MAX;

  double sum_concurrent = 0, sum_stored = 0, sum_reserved = 0, sum_frag = 0;
  int64_t frag_steps = 0, blocked_steps = 0;
  for (int64_t step = 0; step < warmup_steps + measured_steps; ++step) {
    const bool measured = step >= warmup_steps;
    // Decode: every running sequence appends one token, oldest first.
    for (size_t i = 0; i < running.size();) {
      Running& s = running[i];
      bool preempted_self = false;
      while (!alloc.Grow(s.id, s.len + 1)) {
        // Preempt the newest running sequence (recompute later from its tokens so far).
        Running victim = running.back();
        running.pop_back();
        alloc.Release(victim.id);
        waiting.push_front({0, victim.len, victim.final_len});
        ++out.preemptions;
        out.recomputed_tokens += victim.len;
        if (running.size() == i) {
          preempted_self = true;
          break;
        }
      }
      if (preempted_self) break;
      ++s.len;
      if (s.len == s.final_len) {
        alloc.Release(s.id);
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
        if (measured) ++out.finished;
      } else {
        ++i;
      }
    }
    admit();
    if (!measured) continue;

    const int64_t n = static_cast<int64_t>(running.size());
    int64_t stored = 0;
    for (const Running& s : running) stored += s.len;
    sum_concurrent += static_cast<double>(n);
    out.min_concurrent = std::min(out.min_concurrent, n);
    out.max_concurrent = std::max(out.max_concurrent, n);
    sum_stored += static_cast<double>(stored);
    sum_reserved += static_cast<double>(alloc.reserved_tokens());
    const int64_t free = alloc.free_tokens();
    if (free > 0) {
      sum_frag +=
          1.0 - static_cast<double>(alloc.largest_free_extent()) / static_cast<double>(free);
      ++frag_steps;
    }
    const Running& head = waiting.front();
    if (alloc.NeedFor(head.len, head.final_len) <= free) ++blocked_steps;
  }
  out.mean_concurrent = sum_concurrent / static_cast<double>(measured_steps);
  out.internal_waste = 1.0 - sum_stored / sum_reserved;
  out.utilization =
      sum_stored / (static_cast<double>(budget_tokens) * static_cast<double>(measured_steps));
  out.external_fragmentation = frag_steps ? sum_frag / static_cast<double>(frag_steps) : 0.0;
  out.blocked_by_fragmentation =
      static_cast<double>(blocked_steps) / static_cast<double>(measured_steps);
  return out;
}

struct WorkloadStats {
  double mean_prompt = 0, mean_output = 0, mean_total = 0;
  int64_t p50_total = 0, p99_total = 0, max_total = 0;
  double capped_prompt_share = 0, capped_output_share = 0;
};

WorkloadStats DescribeWorkload(uint64_t seed, int64_t n) {
  RequestStream stream(seed);
  std::vector<int64_t> totals;
  WorkloadStats w;
  int64_t capped_p = 0, capped_o = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Request r = stream.Next();
    w.mean_prompt += static_cast<double>(r.prompt);
    w.mean_output += static_cast<double>(r.output);
    totals.push_back(r.prompt + r.output);
    capped_p += r.prompt == kMaxPrompt;
    capped_o += r.output == kMaxOutput;
  }
  w.mean_prompt /= static_cast<double>(n);
  w.mean_output /= static_cast<double>(n);
  w.mean_total = w.mean_prompt + w.mean_output;
  std::sort(totals.begin(), totals.end());
  w.p50_total = totals[totals.size() / 2];
  w.p99_total = totals[totals.size() * 99 / 100];
  w.max_total = totals.back();
  w.capped_prompt_share = static_cast<double>(capped_p) / static_cast<double>(n);
  w.capped_output_share = static_cast<double>(capped_o) / static_cast<double>(n);
  return w;
}

struct DTypeCapacity {
  int64_t head_dim;
  std::string dtype;
  int64_t bytes_per_token;
  int64_t tokens;
  double vs_fp16;
};

// Tokens each dtype holds in the bytes that `budget_tokens` fp16 tokens take, in whole blocks,
// for a Llama-3-8B-shaped cache (32 layers, 8 KV heads) at the given head_dim.
std::vector<DTypeCapacity> CapacityByDType(int64_t budget_tokens, int64_t head_dim) {
  kvgrid::model::ModelConfig c;
  c.num_hidden_layers = 32;
  c.num_key_value_heads = 8;
  c.head_dim = head_dim;
  const int64_t budget_bytes =
      budget_tokens * kvgrid::worker::KvBytesPerToken(c, KvDType::kF16, KvDType::kF16);
  std::vector<DTypeCapacity> out;
  int64_t fp16_tokens = 0;
  for (const auto& pair : kvgrid::worker::PlannedKvDTypes()) {
    const int64_t bpt = kvgrid::worker::KvBytesPerToken(c, pair.k, pair.v);
    const int64_t tokens = budget_bytes / (bpt * kBlockSize) * kBlockSize;
    if (pair.name == "fp16") fp16_tokens = tokens;
    out.push_back({head_dim, std::string(pair.name), bpt, tokens, 0});
  }
  for (DTypeCapacity& d : out)
    d.vs_fp16 = static_cast<double>(d.tokens) / static_cast<double>(fp16_tokens);
  return out;
}

int64_t FlagInt(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], name)) return std::atoll(argv[i + 1]);
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::printf(
          "usage: kv_waste_bench [--json] [--budget-tokens 65536] [--steps 40000]\n"
          "                      [--warmup 5000] [--seed 20261129]\n");
      return 0;
    }
  }
  const int64_t budget = FlagInt(argc, argv, "--budget-tokens", 65536);
  const int64_t steps = FlagInt(argc, argv, "--steps", 40000);
  const int64_t warmup = FlagInt(argc, argv, "--warmup", 5000);
  const uint64_t seed = static_cast<uint64_t>(FlagInt(argc, argv, "--seed", 20261129));
  if (budget < kMaxLen || budget % kBlockSize != 0 || steps <= 0 || warmup < 0) {
    std::fprintf(stderr,
                 "kv_waste_bench: --budget-tokens must be a multiple of %d and at least "
                 "%lld; --steps > 0; --warmup >= 0\n",
                 kBlockSize, static_cast<long long>(kMaxLen));
    return 2;
  }

  const WorkloadStats w = DescribeWorkload(seed, 200000);
  std::vector<std::unique_ptr<Allocator>> allocators;
  allocators.push_back(std::make_unique<PagedAllocator>(budget));
  allocators.push_back(std::make_unique<MaxLengthAllocator>(budget));
  allocators.push_back(std::make_unique<FirstFitAllocator>(budget));
  std::vector<SimResult> results;
  for (auto& a : allocators) results.push_back(Simulate(*a, budget, seed, warmup, steps));
  std::vector<DTypeCapacity> caps = CapacityByDType(budget, 128);
  for (const DTypeCapacity& d : CapacityByDType(budget, 64)) caps.push_back(d);

  const SimResult& paged = results[0];
  const SimResult& maxlen = results[1];
  const double paged_vs_maxlen = paged.mean_concurrent / maxlen.mean_concurrent;

  nlohmann::json j;
  j["budget_tokens"] = budget;
  j["block_size"] = kBlockSize;
  j["seed"] = seed;
  j["warmup_steps"] = warmup;
  j["measured_steps"] = steps;
  j["workload"] = {{"model", "modelled chat-like distribution, not a measured trace"},
                   {"prompt", "lognormal median 300 sigma 1.0, clamp [1, 4096]"},
                   {"output", "lognormal median 200 sigma 0.9, clamp [1, 2048]"},
                   {"mean_prompt", w.mean_prompt},
                   {"mean_output", w.mean_output},
                   {"mean_total", w.mean_total},
                   {"p50_total", w.p50_total},
                   {"p99_total", w.p99_total},
                   {"max_total", w.max_total},
                   {"capped_prompt_share", w.capped_prompt_share},
                   {"capped_output_share", w.capped_output_share}};
  for (const SimResult& r : results) {
    j["allocators"].push_back({{"name", r.name},
                               {"initial_fill", r.initial_fill},
                               {"mean_concurrent", r.mean_concurrent},
                               {"min_concurrent", r.min_concurrent},
                               {"max_concurrent", r.max_concurrent},
                               {"internal_waste", r.internal_waste},
                               {"utilization", r.utilization},
                               {"external_fragmentation", r.external_fragmentation},
                               {"blocked_by_fragmentation", r.blocked_by_fragmentation},
                               {"finished", r.finished},
                               {"preemptions", r.preemptions},
                               {"recomputed_tokens", r.recomputed_tokens}});
  }
  for (const DTypeCapacity& d : caps) {
    j["dtype_capacity"].push_back({{"head_dim", d.head_dim},
                                   {"dtype", d.dtype},
                                   {"bytes_per_token", d.bytes_per_token},
                                   {"tokens", d.tokens},
                                   {"vs_fp16", d.vs_fp16}});
  }
  j["paged_vs_max_len_concurrency"] = paged_vs_maxlen;
  j["targets"] = {{"paged_internal_waste_below_0.04", paged.internal_waste < 0.04},
                  {"paged_concurrency_at_least_3x_max_len", paged_vs_maxlen >= 3.0}};
  bool dtype_targets = true;
  for (const DTypeCapacity& d : caps) {
    if (d.dtype == "int8" && d.vs_fp16 < 1.9) dtype_targets = false;
    if (d.dtype == "int4" && d.vs_fp16 < 3.5) dtype_targets = false;
  }
  j["targets"]["int8_1.9x_int4_3.5x_fp16"] = dtype_targets;

  if (json) {
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("budget %lld tokens, block %d, seed %llu, %lld measured steps after %lld warm-up\n",
              static_cast<long long>(budget), kBlockSize, static_cast<unsigned long long>(seed),
              static_cast<long long>(steps), static_cast<long long>(warmup));
  std::printf("workload: mean prompt %.0f, mean output %.0f, total p50 %lld p99 %lld max %lld\n\n",
              w.mean_prompt, w.mean_output, static_cast<long long>(w.p50_total),
              static_cast<long long>(w.p99_total), static_cast<long long>(w.max_total));
  std::printf("%-8s %6s %10s %9s %9s %8s %8s %9s %8s\n", "alloc", "fill", "mean seqs", "waste",
              "util", "ext frag", "blocked", "finished", "preempt");
  for (const SimResult& r : results) {
    std::printf("%-8s %6lld %10.1f %8.1f%% %8.1f%% %7.1f%% %7.1f%% %9lld %8lld\n", r.name.c_str(),
                static_cast<long long>(r.initial_fill), r.mean_concurrent, 100 * r.internal_waste,
                100 * r.utilization, 100 * r.external_fragmentation,
                100 * r.blocked_by_fragmentation, static_cast<long long>(r.finished),
                static_cast<long long>(r.preemptions));
  }
  std::printf("\npaged / max-len concurrency: %.2fx\n\n", paged_vs_maxlen);
  std::printf("%-8s %-12s %12s %10s %8s\n", "head_dim", "dtype", "bytes/token", "tokens",
              "vs fp16");
  for (const DTypeCapacity& d : caps) {
    std::printf("%-8lld %-12s %12lld %10lld %7.3fx\n", static_cast<long long>(d.head_dim),
                d.dtype.c_str(), static_cast<long long>(d.bytes_per_token),
                static_cast<long long>(d.tokens), d.vs_fp16);
  }
  return 0;
}
