// tp_bench: what tensor parallelism buys and costs.
//
// 1. KV per rank vs tp (arithmetic, no weights): for Llama-3-8B, Qwen2-7B and Llama-3-70B
//    shapes with bf16 weights and fp16 KV on 80 GiB cards (90% usable), each rank's KV bytes
//    per token (its share of the KV heads; replicated once tp exceeds them), its weights, and
//    the context the group's pools hold.
// 2. Measured on this machine: decode steps of a Qwen2-0.5B-shaped random model at tp 1 and
//    tp 2 (ranks are threads of this process, Gloo over loopback TCP, one kernel thread per
//    rank), with the share of the step spent in collectives (all-reduces and the step plan).
//
//   build/bin/tp_bench [--json] [--batch 8] [--context 512] [--steps 8]
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
using kvgrid::worker::Communicator;

using kvgrid::bench::TimedCommunicator;

struct Shape {
  const char* name;
  int64_t layers, kv_heads, head_dim, params;
};

nlohmann::json KvPerRank() {
  constexpr double kCard = 80.0 * (1ll << 30), kUsable = 0.9;
  const Shape shapes[] = {{"llama-3-8b", 32, 8, 128, 8030000000ll},
                          {"qwen2-7b", 28, 4, 128, 7620000000ll},
                          {"llama-3-70b", 80, 8, 128, 70550000000ll}};
  nlohmann::json rows = nlohmann::json::array();
  for (const Shape& s : shapes) {
    for (int tp : {1, 2, 4, 8}) {
      const int64_t kv_local = s.kv_heads >= tp ? s.kv_heads / tp : 1;
      const int64_t bytes_per_token = s.layers * 2 * kv_local * s.head_dim * 2;  // fp16 K and V
      const double weights = 2.0 * static_cast<double>(s.params) / tp;         // bf16
      const double kv_budget = kCard * kUsable - weights;
      rows.push_back({{"model", s.name},
                      {"tp", tp},
                      {"kv_heads_per_rank", kv_local},
                      {"kv_bytes_per_token_per_rank", bytes_per_token},
                      {"weights_gib_per_rank", weights / (1ll << 30)},
                      {"kv_budget_gib_per_rank", kv_budget / (1ll << 30)},
                      {"max_context_tokens",
                       kv_budget > 0 ? static_cast<int64_t>(kv_budget / bytes_per_token) : 0}});
    }
  }
  return rows;
}

// Decode steps of `batch` sequences at `context` tokens on rank `rank` of `tp`.
StepTimes Decode(const kvgrid::model::ModelConfig& config, const kvgrid::worker::LlamaWeights& full,
                 int rank, int tp, Communicator* comm, int64_t batch, int64_t context,
                 int64_t steps) {
  kvgrid::kernels::cpu::UseConfiguredThreads();
  TimedCommunicator timed(comm);
  auto shard = kvgrid::worker::LlamaModel::ShardWeights(
      config, full, {.rank = rank, .size = tp, .comm = comm ? &timed : nullptr});
  if (!shard.ok()) return {};
  auto model = kvgrid::worker::LlamaModel::FromWeights(
      config, *std::move(shard), {.rank = rank, .size = tp, .comm = comm ? &timed : nullptr});
  if (!model.ok()) return {};
  const auto g = (*model)->KvGeometryFor(16, kvgrid::kernels::KvDType::kF16,
                                         kvgrid::kernels::KvDType::kF16);
  const int64_t tokens = batch * (context + steps + 16);
  auto pool = kvgrid::worker::KvPool::Create(g, (tokens / 16 + 1) * g.BytesPerBlock());
  if (!pool.ok()) return {};
  kvgrid::worker::BlockManager blocks((*pool)->num_blocks(), 16);
  return TimeDecodeSteps(**model, **pool, blocks, timed, batch, context, steps);
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int64_t batch = 8, context = 512, steps = 8;
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
      std::fprintf(stderr, "usage: tp_bench [--json] [--batch N] [--context N] [--steps N]\n");
      return 2;
    }
  }
  const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
  const kvgrid::worker::LlamaWeights full =
      kvgrid::worker::LlamaModel::RandomWeights(config, 1234);
  kvgrid::kernels::cpu::SetNumThreads(1);  // one kernel thread per rank

  nlohmann::json measured = nlohmann::json::array();
  const StepTimes one = Decode(config, full, 0, 1, nullptr, batch, context, steps);
  measured.push_back({{"tp", 1}, {"ms_per_step", 1e3 * one.step_s}, {"collective_share", 0.0}});
  {
    gloo::rendezvous::HashStore store;
    std::vector<StepTimes> per_rank(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        auto comm = kvgrid::worker::GlooCommunicator::Connect(r, 2, store, "127.0.0.1",
                                                              std::chrono::seconds(60));
        if (!comm.ok()) return;
        per_rank[r] = Decode(config, full, r, 2, comm->get(), batch, context, steps);
      });
    }
    for (auto& t : ranks) t.join();
    measured.push_back({{"tp", 2},
                        {"ms_per_step", 1e3 * per_rank[0].step_s},
                        {"collective_ms_per_step", 1e3 * per_rank[0].collective_s},
                        {"collective_share", per_rank[0].collective_s / per_rank[0].step_s},
                        {"vs_tp1", one.step_s / per_rank[0].step_s}});
  }
  nlohmann::json j = {{"kv_per_rank", KvPerRank()},
                      {"decode", {{"model", "qwen2-0.5b-shape (random fp32 weights), fp16 KV"},
                                  {"batch", batch},
                                  {"context", context},
                                  {"threads_per_rank", 1},
                                  {"results", measured}}}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
