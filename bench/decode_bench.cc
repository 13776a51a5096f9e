// decode_bench: prefill and decode speed of the CPU engine at batch 1 on a Qwen2-0.5B-shaped
// model with random weights, against this machine's memory bandwidth (STREAM-style triad) and
// the roofline it implies for decode: the bytes one step reads, which are every weight byte
// except the embedding table when the head has its own matrix (the lookup reads one row), plus
// the context's K/V. --exact-linear runs the quantized layers on fp32 inputs instead of 8-bit
// ones (kernels/cpu/quant_linear.h's LinearPrecision).
//
//   build/bin/decode_bench [--json] [--prompt-len 128] [--decode-tokens 32] [--repeats 5]
//                          [--weight-dtype fp32|fp16|bf16|q8_0|q4_0] [--exact-linear]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_models.h"
#include "nlohmann/json.hpp"
#include "worker/engine/engine.h"
#include "worker/executor/llama_model.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Triad a = b + s * c over arrays far larger than the caches; best of `repeats` runs, counting
// the three streams STREAM counts (two reads, one write).
double TriadBandwidth(int repeats) {
  const int64_t n = int64_t{64} << 20;  // 64 Mi floats = 256 MiB per array
  std::vector<float> a(n), b(n), c(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    a[i] = 0.f;
    b[i] = 1.f;
    c[i] = 2.f;
  }
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    const float s = 3.f;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    const double dt = Seconds(t0, Clock::now());
    best = std::max(best, 3.0 * sizeof(float) * n / dt);
  }
  if (a[n / 2] != 7.f) std::fprintf(stderr, "triad check failed\n");
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int64_t prompt_len = 128, decode_tokens = 32, repeats = 5;
  kvgrid::kernels::cpu::WeightDType weight_dtype = kvgrid::kernels::cpu::WeightDType::kF32;
  bool exact_linear = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "decode_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--json") json = true;
    else if (a == "--exact-linear") exact_linear = true;
    else if (a == "--prompt-len") prompt_len = next();
    else if (a == "--decode-tokens") decode_tokens = next();
    else if (a == "--repeats") repeats = next();
    else if (a == "--weight-dtype" && i + 1 < argc) {
      auto d = kvgrid::kernels::cpu::ParseWeightDType(argv[++i]);
      if (!d.ok()) {
        std::fprintf(stderr, "decode_bench: --%s\n", std::string(d.status().message()).c_str());
        return 2;
      }
      weight_dtype = *d;
    }
    else {
      std::fprintf(stderr, "usage: decode_bench [--json] [--prompt-len N] [--decode-tokens N] "
                           "[--repeats N] [--weight-dtype fp32|fp16|bf16|q8_0|q4_0] "
                           "[--exact-linear]\n");
      return 2;
    }
  }
  if (prompt_len < 1 || decode_tokens < 2 || repeats < 1) {
    std::fprintf(stderr, "decode_bench: --prompt-len >= 1, --decode-tokens >= 2, --repeats >= 1\n");
    return 2;
  }

  const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
  auto model = kvgrid::worker::LlamaModel::FromWeights(
      config, kvgrid::worker::LlamaModel::RandomWeights(config, 1234));
  if (!model.ok()) {
    std::fprintf(stderr, "decode_bench: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  if (auto s = (*model)->QuantizeWeights(weight_dtype); !s.ok()) {
    std::fprintf(stderr, "decode_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  if (exact_linear) (*model)->SetLinearPrecision(kvgrid::kernels::cpu::LinearPrecision::kExact);
  const int64_t weight_bytes = (*model)->WeightBytes();
  // A step reads the embedding table only when the head is tied to it.
  const kvgrid::worker::LlamaWeights& w = (*model)->weights();
  const bool head_on_embedding = w.lm_head.empty() && w.lm_head_q.empty();
  const int64_t embedding_bytes =
      static_cast<int64_t>(w.embed.size() * sizeof(float) + w.embed_q.data.size());
  const int64_t step_weight_bytes = weight_bytes - (head_on_embedding ? 0 : embedding_bytes);
  kvgrid::worker::EngineOptions options;
  options.kv_cache_memory = 64ll << 20;
  auto engine = kvgrid::worker::Engine::Create(*std::move(model), options);
  if (!engine.ok()) {
    std::fprintf(stderr, "decode_bench: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  const int64_t kv_bytes_per_token = (*engine)->Stats().bytes_per_token;

  // The host is shared and its bandwidth drifts, so each repeat measures the triad right before
  // its decode run and the ratio is taken within the repeat; the median ratio is reported.
  const double context = prompt_len + decode_tokens / 2.0;
  const double bytes_per_token = step_weight_bytes + context * kv_bytes_per_token;
  double best_prefill = 0, best_decode = 0, best_bandwidth = 0;
  std::vector<double> fractions;
  for (int64_t r = 0; r < repeats; ++r) {
    const double bandwidth = TriadBandwidth(3);
    best_bandwidth = std::max(best_bandwidth, bandwidth);
    kvgrid::worker::GenerationRequest req;
    req.id = "bench" + std::to_string(r);
    for (int64_t i = 0; i < prompt_len; ++i) req.prompt.push_back(static_cast<int32_t>((i * 7919 + r) % 150000));
    req.sampling.temperature = 0;
    req.stopping.max_new_tokens = decode_tokens;
    req.stopping.ignore_eos = true;
    if (auto s = (*engine)->AddRequest(std::move(req)); !s.ok()) {
      std::fprintf(stderr, "decode_bench: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    const auto t0 = Clock::now();
    auto first = (*engine)->Step();  // prefill + first token
    const auto t1 = Clock::now();
    int64_t steps = 0;
    while ((*engine)->HasWork()) {
      auto out = (*engine)->Step();
      if (!out.ok()) {
        std::fprintf(stderr, "decode_bench: %s\n", std::string(out.status().message()).c_str());
        return 1;
      }
      ++steps;
    }
    const auto t2 = Clock::now();
    if (!first.ok()) return 1;
    best_prefill = std::max(best_prefill, prompt_len / Seconds(t0, t1));
    const double decode = steps / Seconds(t1, t2);
    best_decode = std::max(best_decode, decode);
    fractions.push_back(decode / (bandwidth / bytes_per_token));
  }
  std::sort(fractions.begin(), fractions.end());
  const double median_fraction = fractions[fractions.size() / 2];

  // Per decode token: every weight a step reads once, plus the K/V of the context.
  const double roofline = best_bandwidth / bytes_per_token;
  nlohmann::json j = {
      {"model", "qwen2-0.5b-shape (random weights)"},
      {"weight_dtype", std::string(kvgrid::kernels::cpu::WeightDTypeName(weight_dtype))},
      {"threads", omp_get_max_threads()},
      {"prompt_len", prompt_len},
      {"decode_tokens", decode_tokens},
      {"exact_linear", exact_linear},
      {"weight_bytes", weight_bytes},
      {"step_weight_bytes", step_weight_bytes},
      {"kv_bytes_per_token", kv_bytes_per_token},
      {"triad_bandwidth_gbs", best_bandwidth / 1e9},
      {"prefill_tokens_per_s", best_prefill},
      {"decode_tokens_per_s", best_decode},
      {"decode_roofline_tokens_per_s", roofline},
      {"decode_fraction_of_roofline_best", best_decode / roofline},
      {"decode_fraction_of_roofline_median", median_fraction},
  };
  if (json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("%s\n", j.dump(2).c_str());
  }
  return 0;
}
