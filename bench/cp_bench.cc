// cp_bench: what context parallelism buys and costs.
//
// 1. Tokens one sequence can hold vs ranks (arithmetic, no weights), for Llama-3-8B, Qwen2-7B
//    and Llama-3-70B shapes with bf16 weights and fp16 KV on 80 GiB cards (90% usable): tensor
//    parallelism alone (tp = N: a rank's share of the KV heads, replicated past num_kv_heads)
//    against TP x CP (T = min(N, num_kv_heads) splits the heads, C = N / T ranks split each
//    sequence's blocks; a CP rank holds its TP shard's weights, so weights are replicated C
//    times).
// 2. Measured on this machine: decode steps of a Qwen2-0.5B-shaped random model at cp 1 and
//    cp 2 (ranks are threads of this process, Gloo over loopback TCP, one kernel thread per
//    rank), with the time spent in collectives (the per-layer all-gather of partial outputs
//    and log-sum-exp).
//
//   build/bin/cp_bench [--json] [--batch 4] [--context 4096] [--steps 6]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_models.h"
#include "bench/decode_steps.h"
#include "bench/timed_communicator.h"
#include "gloo/rendezvous/hash_store.h"
#include "kernels/cpu/gemm.h"
#include "nlohmann/json.hpp"
#include "worker/comm/gloo_communicator.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace {

using kvgrid::bench::StepTimes;
using kvgrid::bench::TimeDecodeSteps;
using kvgrid::bench::TimedCommunicator;
using kvgrid::worker::Communicator;

struct Shape {
  const char* name;
  int64_t layers, kv_heads, head_dim, params;
};

// Tokens of one sequence a group holds when each rank keeps `kv_heads_per_rank` heads and
// `weights` bytes, and `cp` ranks split the sequence's blocks.
int64_t SequenceTokens(const Shape& s, int64_t kv_heads_per_rank, double weights, int64_t cp) {
  constexpr double kCard = 80.0 * (1ll << 30), kUsable = 0.9;
  const int64_t bytes_per_token = s.layers * 2 * kv_heads_per_rank * s.head_dim * 2;  // fp16
  const double budget = kCard * kUsable - weights;
  return budget > 0 ? cp * static_cast<int64_t>(budget / static_cast<double>(bytes_per_token))
                    : 0;
}

nlohmann::json Capacity() {
  const Shape shapes[] = {{"llama-3-8b", 32, 8, 128, 8030000000ll},
                          {"qwen2-7b", 28, 4, 128, 7620000000ll},
                          {"llama-3-70b", 80, 8, 128, 70550000000ll}};
  nlohmann::json rows = nlohmann::json::array();
  for (const Shape& s : shapes) {
    for (int64_t n : {1, 2, 4, 8, 16, 32}) {
      const double params_bytes = 2.0 * static_cast<double>(s.params);  // bf16
      const int64_t tp_alone =
          SequenceTokens(s, std::max<int64_t>(1, s.kv_heads / n), params_bytes / n, 1);
      const int64_t t = std::min(n, s.kv_heads), c = n / t;
      const int64_t tp_cp = SequenceTokens(s, s.kv_heads / t, params_bytes / t, c);
      rows.push_back({{"model", s.name},
                      {"ranks", n},
                      {"tp_alone_tokens", tp_alone},
                      {"tp", t},
                      {"cp", c},
                      {"tp_cp_tokens", tp_cp},
                      {"weights_gib_per_rank_tp_cp", params_bytes / t / (1ll << 30)}});
    }
  }
  return rows;
}

// Decode steps of `batch` sequences at `context` tokens on rank `rank` of a context-parallel
// group of `cp` (each rank holds the whole model and every cp-th block of each sequence).
StepTimes Decode(const kvgrid::model::ModelConfig& config, const kvgrid::worker::LlamaWeights& w,
                 int rank, int cp, Communicator* comm, int64_t batch, int64_t context,
                 int64_t steps) {
  kvgrid::kernels::cpu::UseConfiguredThreads();
  TimedCommunicator timed(comm);
  auto model = kvgrid::worker::LlamaModel::FromWeights(config, w);
  if (!model.ok()) return {};
  if (cp > 1 && !(*model)->SetContextParallel({.rank = rank, .size = cp, .comm = &timed}).ok()) {
    return {};
  }
  const auto g = (*model)->KvGeometryFor(16, kvgrid::kernels::KvDType::kF16,
                                         kvgrid::kernels::KvDType::kF16);
  const int64_t group_blocks = batch * ((context + steps) / 16 + 2);
  const int32_t per_rank = static_cast<int32_t>((group_blocks + cp - 1) / cp);
  auto pool = kvgrid::worker::KvPool::Create(g, per_rank * g.BytesPerBlock());
  if (!pool.ok()) return {};
  kvgrid::worker::BlockManager blocks({.num_blocks = per_rank, .block_size = 16, .cp_size = cp});
  return TimeDecodeSteps(**model, **pool, blocks, timed, batch, context, steps);
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int64_t batch = 4, context = 4096, steps = 6;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--context" && i + 1 < argc) {
      context = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::max<int64_t>(2, std::atoll(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: cp_bench [--json] [--batch N] [--context N] [--steps N]\n");
      return 2;
    }
  }
  const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
  const kvgrid::worker::LlamaWeights w = kvgrid::worker::LlamaModel::RandomWeights(config, 1234);
  kvgrid::kernels::cpu::SetNumThreads(1);  // one kernel thread per rank

  nlohmann::json measured = nlohmann::json::array();
  const StepTimes one = Decode(config, w, 0, 1, nullptr, batch, context, steps);
  if (one.step_s <= 0) {
    std::fprintf(stderr, "cp_bench: the cp 1 run failed\n");
    return 1;
  }
  measured.push_back({{"cp", 1}, {"ms_per_step", 1e3 * one.step_s}, {"collective_share", 0.0}});
  {
    gloo::rendezvous::HashStore store;
    std::vector<StepTimes> per_rank(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        auto comm = kvgrid::worker::GlooCommunicator::Connect(r, 2, store, "127.0.0.1",
                                                              std::chrono::seconds(60));
        if (!comm.ok()) return;
        per_rank[r] = Decode(config, w, r, 2, comm->get(), batch, context, steps);
      });
    }
    for (auto& t : ranks) t.join();
    if (per_rank[0].step_s <= 0) {
      std::fprintf(stderr, "cp_bench: the cp 2 run failed\n");
      return 1;
    }
    measured.push_back({{"cp", 2},
                        {"ms_per_step", 1e3 * per_rank[0].step_s},
                        {"collective_ms_per_step", 1e3 * per_rank[0].collective_s},
                        {"collective_share", per_rank[0].collective_s / per_rank[0].step_s},
                        {"vs_cp1", one.step_s / per_rank[0].step_s}});
  }
  nlohmann::json j = {{"sequence_capacity", Capacity()},
                      {"decode", {{"model", "qwen2-0.5b-shape (random fp32 weights), fp16 KV"},
                                  {"batch", batch},
                                  {"context", context},
                                  {"threads_per_rank", 1},
                                  {"results", measured}}}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
