// long_decode_bench: whole-model decode speed at long contexts for each KV dtype, on
// a Qwen2-0.5B-shaped model with random weights. The cache is filled directly with random K/V
// rows through KvWrite (quantized as the dtype requires) instead of prefilling thousands of
// tokens: decode cost does not depend on what the cached values are. Each (context, dtype)
// then decodes --steps tokens; dtypes alternate within each repeat, best of --repeats.
//
//   build/bin/long_decode_bench [--json] [--contexts 1024,4096,8192] [--steps 8] [--repeats 2]
//                               [--batch 1] [--weight-dtype fp32|q8_0|q4_0]
// With --batch B, B sequences each at the context decode together (output tokens/s counted).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/kv_write.h"
#include "bench/bench_models.h"
#include "nlohmann/json.hpp"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvgrid::kernels::KvDType;

// Output tokens per second decoding `steps` tokens for each of `batch` sequences after a
// synthetic context of `context` tokens each.
double DecodeRate(kvgrid::worker::LlamaModel& model, KvDType dtype, int64_t context,
                  int64_t steps, int64_t batch) {
  const kvgrid::worker::KvGeometry g = model.KvGeometryFor(16, dtype, dtype);
  const int64_t tokens = context + steps;
  auto pool = kvgrid::worker::KvPool::Create(g, batch * (tokens / 16 + 2) * g.BytesPerBlock());
  if (!pool.ok()) return 0;
  kvgrid::worker::BlockManager blocks((*pool)->num_blocks(), 16);
  std::vector<kvgrid::worker::SequenceId> seqs;
  for (int64_t s = 1; s <= batch; ++s) {
    if (!blocks.Reserve(s, tokens).ok()) return 0;
    seqs.push_back(s);
  }

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  const int64_t row = g.num_kv_heads * g.head_dim;
  std::vector<float> k(context * row), v(context * row);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  std::vector<int64_t> slots(context);
  for (int64_t seq = 1; seq <= batch; ++seq) {  // every sequence holds the same context
    for (int64_t p = 0; p < context; ++p) slots[p] = blocks.Slot(seq, p);
    for (int64_t layer = 0; layer < g.num_layers; ++layer) {
      auto s = kvgrid::kernels::cpu::KvWrite({.key = k.data(),
                                              .value = v.data(),
                                              .slots = slots.data(),
                                              .k_cache = (*pool)->k(layer),
                                              .v_cache = (*pool)->v(layer),
                                              .k_meta = (*pool)->k_meta(layer),
                                              .v_meta = (*pool)->v_meta(layer),
                                              .k_dtype = dtype,
                                              .v_dtype = dtype,
                                              .num_tokens = context,
                                              .num_blocks = (*pool)->num_blocks(),
                                              .num_kv_heads = g.num_kv_heads,
                                              .block_size = 16,
                                              .head_dim = g.head_dim});
      if (!s.ok()) return 0;
    }
  }
  std::vector<float> logits;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t pos = context + i;
    std::vector<int32_t> next;
    for (int64_t s = 1; s <= batch; ++s) {
      next.push_back(static_cast<int32_t>((pos * 7919 + s) % 150000));
    }
    const kvgrid::worker::ForwardBatch b = kvgrid::worker::DecodeBatch(blocks, seqs, pos, next);
    if (!model.Forward(b, **pool, &logits).ok()) return 0;
  }
  return static_cast<double>(steps * batch) /
         std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::vector<int64_t> contexts = {1024, 4096, 8192};
  int64_t steps = 8, repeats = 2, batch = 1;
  kvgrid::kernels::cpu::WeightDType weight_dtype = kvgrid::kernels::cpu::WeightDType::kF32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--contexts" && i + 1 < argc) {
      contexts.clear();
      std::stringstream ss(argv[++i]);
      for (std::string part; std::getline(ss, part, ',');) contexts.push_back(std::atoll(part.c_str()));
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::max<int64_t>(1, std::atoll(argv[++i]));
    } else if (a == "--weight-dtype" && i + 1 < argc) {
      auto d = kvgrid::kernels::cpu::ParseWeightDType(argv[++i]);
      if (!d.ok()) {
        std::fprintf(stderr, "long_decode_bench: --%s\n", std::string(d.status().message()).c_str());
        return 2;
      }
      weight_dtype = *d;
    } else {
      std::fprintf(stderr, "usage: long_decode_bench [--json] [--contexts 1024,4096,8192] "
                           "[--steps N] [--repeats N] [--batch N] [--weight-dtype W]\n");
      return 2;
    }
  }
  const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
  auto model = kvgrid::worker::LlamaModel::FromWeights(
      config, kvgrid::worker::LlamaModel::RandomWeights(config, 1234));
  if (!model.ok() || !(*model)->QuantizeWeights(weight_dtype).ok()) {
    std::fprintf(stderr, "long_decode_bench: cannot build the model\n");
    return 1;
  }
  const std::pair<const char*, KvDType> dtypes[] = {{"fp32", KvDType::kF32},
                                                    {"fp16", KvDType::kF16},
                                                    {"bf16", KvDType::kBF16},
                                                    {"int8", KvDType::kInt8},
                                                    {"int4", KvDType::kInt4}};
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t context : contexts) {
    std::map<std::string, double> best;
    for (int64_t r = 0; r < repeats; ++r) {
      for (const auto& [name, dtype] : dtypes) {
        best[name] = std::max(best[name], DecodeRate(**model, dtype, context, steps, batch));
      }
    }
    for (const auto& [name, dtype] : dtypes) {
      rows.push_back({{"context", context},
                      {"kv_dtype", name},
                      {"decode_tokens_per_s", best[name]},
                      {"vs_fp16", best[name] / best["fp16"]}});
    }
  }
  nlohmann::json j = {{"model", "qwen2-0.5b-shape (random weights)"},
                      {"weight_dtype", std::string(kvgrid::kernels::cpu::WeightDTypeName(weight_dtype))},
                      {"batch", batch},
                      {"steps", steps},
                      {"repeats", repeats},
                      {"results", rows}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
