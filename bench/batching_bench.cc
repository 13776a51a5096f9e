// batching_bench: what continuous batching buys. Output tokens/s and per-token latency with
// 1, 4, 16 and 64 concurrent sequences, on the embedded trained model and on a
// Qwen2-0.5B-shaped model with random weights (fp32 weights and KV, greedy, EOS ignored).
// All requests are queued at once; the engine admits them together and decodes them in one
// batch per step. Throughput counts every generated token over the whole run (prefill
// included); latency is the mean time of the decode-only steps.
//
//   build/bin/batching_bench [--json] [--concurrency 1,4,16,64] [--skip-qwen]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/bench_models.h"
#include "nlohmann/json.hpp"
#include "worker/engine/engine.h"
#include "worker/executor/llama_model.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  int64_t concurrency;
  double tokens_per_s;
  double ms_per_step;
};

// Runs `concurrency` requests of `prompt_len` + `new_tokens` tokens through `engine`.
Row Measure(kvgrid::worker::Engine& engine, int64_t concurrency, int64_t prompt_len,
            int64_t new_tokens, int32_t vocab) {
  for (int64_t i = 0; i < concurrency; ++i) {
    kvgrid::worker::GenerationRequest r;
    r.id = absl::StrCat("c", concurrency, "-", i);
    for (int64_t j = 0; j < prompt_len; ++j) {
      r.prompt.push_back(static_cast<int32_t>((i * 131 + j * 17 + 7) % vocab));
    }
    r.sampling.temperature = 0;
    r.stopping.max_new_tokens = new_tokens;
    r.stopping.ignore_eos = true;
    if (!engine.AddRequest(std::move(r)).ok()) return {concurrency, 0, 0};
  }
  int64_t tokens = 0, decode_steps = 0;
  double decode_s = 0;
  const auto start = Clock::now();
  while (engine.HasWork()) {
    const int64_t waiting_before = engine.Stats().num_waiting;
    const auto t0 = Clock::now();
    auto out = engine.Step();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!out.ok()) return {concurrency, 0, 0};
    tokens += static_cast<int64_t>(out->size());
    if (waiting_before == 0 && !out->empty()) {  // no admission (prefill) in this step
      decode_s += dt;
      ++decode_steps;
    }
  }
  const double total = std::chrono::duration<double>(Clock::now() - start).count();
  return {concurrency, tokens / total, decode_steps ? 1e3 * decode_s / decode_steps : 0};
}

nlohmann::json RunModel(const std::string& name, std::unique_ptr<kvgrid::worker::LlamaModel> model,
                        const std::vector<int64_t>& concurrency, int64_t prompt_len,
                        int64_t new_tokens) {
  const int32_t vocab = static_cast<int32_t>(model->config().vocab_size);
  kvgrid::worker::EngineOptions o;
  o.max_num_seqs = 64;
  o.kv_cache_memory = 512ll << 20;
  auto engine = kvgrid::worker::Engine::Create(std::move(model), o);
  nlohmann::json rows = nlohmann::json::array();
  if (!engine.ok()) return rows;
  double single = 0;
  for (int64_t c : concurrency) {
    const Row r = Measure(**engine, c, prompt_len, new_tokens, vocab);
    if (c == 1) single = r.tokens_per_s;
    rows.push_back({{"model", name},
                    {"concurrency", c},
                    {"output_tokens_per_s", r.tokens_per_s},
                    {"ms_per_decode_step", r.ms_per_step},
                    {"speedup_vs_1", single > 0 ? r.tokens_per_s / single : 0.0}});
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false, skip_qwen = false;
  std::vector<int64_t> concurrency = {1, 4, 16, 64};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--skip-qwen") {
      skip_qwen = true;
    } else if (a == "--concurrency" && i + 1 < argc) {
      concurrency.clear();
      std::stringstream ss(argv[++i]);
      for (std::string p; std::getline(ss, p, ',');) concurrency.push_back(std::atoll(p.c_str()));
    } else {
      std::fprintf(stderr, "usage: batching_bench [--json] [--concurrency 1,4,16,64] "
                           "[--skip-qwen]\n");
      return 2;
    }
  }
  nlohmann::json results = nlohmann::json::array();
  auto tiny = kvgrid::worker::LlamaModel::Load(std::string(KVGRID_SOURCE_DIR) + "/models/kjv-tiny");
  if (!tiny.ok()) {
    std::fprintf(stderr, "batching_bench: %s\n", std::string(tiny.status().message()).c_str());
    return 1;
  }
  for (auto& r : RunModel("kjv-tiny", *std::move(tiny), concurrency, 16, 64)) results.push_back(r);
  if (!skip_qwen) {
    const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
    auto qwen = kvgrid::worker::LlamaModel::FromWeights(
        config, kvgrid::worker::LlamaModel::RandomWeights(config, 1234));
    if (!qwen.ok()) return 1;
    for (auto& r : RunModel("qwen2-0.5b-shape", *std::move(qwen), concurrency, 16, 16)) {
      results.push_back(r);
    }
  }
  nlohmann::json j = {{"results", results}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
