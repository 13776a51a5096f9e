// weight_kv_bench: memory and decode speed of every weight dtype with every KV dtype, side by
// side in one run, on a Qwen2-0.5B-shaped model with random weights: fp32 weights; Q8_0; Q4_0
// (GGUF's 4-bit blocks); Q4_Z (the 4-bit blocks AWQ/GPTQ checkpoints load into) — the
// quantized ones with the head in Q8_0 as --weight-dtype does — each with fp16, int8 and int4
// KV. Memory = the weights held + the KV of --batch sequences at --context tokens. Decode
// fills the cache with random rows (bench/decode_rate.h) and times --steps tokens; KV dtypes
// alternate within each repeat, best of --repeats.
//
//   build/bin/weight_kv_bench [--json] [--context 4096] [--batch 1] [--steps 8] [--repeats 2]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

#include "bench/bench_models.h"
#include "bench/decode_rate.h"
#include "kernels/cpu/quant_linear.h"
#include "nlohmann/json.hpp"
#include "worker/executor/llama_model.h"

int main(int argc, char** argv) {
  using kvgrid::kernels::KvDType;
  using kvgrid::kernels::cpu::WeightDType;
  bool json = false;
  int64_t context = 4096, batch = 1, steps = 8, repeats = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int64_t {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "weight_kv_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::max<int64_t>(1, std::atoll(argv[++i]));
    };
    if (a == "--json") json = true;
    else if (a == "--context") context = value();
    else if (a == "--batch") batch = value();
    else if (a == "--steps") steps = value();
    else if (a == "--repeats") repeats = value();
    else {
      std::fprintf(stderr, "usage: weight_kv_bench [--json] [--context N] [--batch N] "
                           "[--steps N] [--repeats N]\n");
      return 2;
    }
  }
  const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
  const std::pair<const char*, KvDType> kv_dtypes[] = {
      {"fp16", KvDType::kF16}, {"int8", KvDType::kInt8}, {"int4", KvDType::kInt4}};
  nlohmann::json rows = nlohmann::json::array();
  for (WeightDType wd : {WeightDType::kF32, WeightDType::kQ8_0, WeightDType::kQ4_0,
                         WeightDType::kQ4_Z}) {
    auto model = kvgrid::worker::LlamaModel::FromWeights(
        config, kvgrid::worker::LlamaModel::RandomWeights(config, 1234));
    if (!model.ok() || !(*model)->QuantizeWeights(wd).ok()) {
      std::fprintf(stderr, "weight_kv_bench: cannot build the %s model\n",
                   std::string(kvgrid::kernels::cpu::WeightDTypeName(wd)).c_str());
      return 1;
    }
    std::map<std::string, double> best;
    for (int64_t r = 0; r < repeats; ++r) {
      for (const auto& [name, kv] : kv_dtypes) {
        const double rate = kvgrid::bench::DecodeRate(**model, kv, context, steps, batch);
        if (rate <= 0) {
          std::fprintf(stderr, "weight_kv_bench: decode failed (%s KV)\n", name);
          return 1;
        }
        best[name] = std::max(best[name], rate);
      }
    }
    const int64_t weight_bytes = (*model)->WeightBytes();
    for (const auto& [name, kv] : kv_dtypes) {
      const kvgrid::worker::KvGeometry g = (*model)->KvGeometryFor(16, kv, kv);
      const int64_t kv_bytes = batch * ((context + 15) / 16) * g.BytesPerBlock();
      rows.push_back({{"weight_dtype", std::string(kvgrid::kernels::cpu::WeightDTypeName(wd))},
                      {"kv_dtype", name},
                      {"weight_bytes", weight_bytes},
                      {"kv_bytes", kv_bytes},
                      {"memory_bytes", weight_bytes + kv_bytes},
                      {"decode_tokens_per_s", best[name]}});
    }
    std::fprintf(stderr, "weight_kv_bench: %s done\n",
                 std::string(kvgrid::kernels::cpu::WeightDTypeName(wd)).c_str());
  }
  const double base = rows[0]["decode_tokens_per_s"].get<double>();  // fp32 weights, fp16 KV
  for (auto& row : rows) row["vs_fp32_fp16"] = row["decode_tokens_per_s"].get<double>() / base;
  nlohmann::json j = {{"model", "qwen2-0.5b-shape (random weights)"},
                      {"context", context},
                      {"batch", batch},
                      {"steps", steps},
                      {"repeats", repeats},
                      {"results", rows}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
