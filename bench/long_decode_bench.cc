// long_decode_bench: whole-model decode speed at long contexts for each KV dtype, on
// a Qwen2-0.5B-shaped model with random weights (or a checkpoint given by --model), the cache
// filled with random rows (bench/decode_rate.h). Each (context, dtype) decodes --steps tokens;
// dtypes alternate within each repeat, best of --repeats.
//
//   build/bin/long_decode_bench [--json] [--contexts 1024,4096,8192] [--steps 8] [--repeats 2]
//                               [--batch 1] [--weight-dtype fp32|q8_0|q4_0] [--model DIR]
// With --batch B, B sequences each at the context decode together (output tokens/s counted).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_models.h"
#include "bench/decode_rate.h"
#include "nlohmann/json.hpp"
#include "worker/executor/llama_model.h"

namespace {

using kvgrid::bench::DecodeRate;
using kvgrid::kernels::KvDType;

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::vector<int64_t> contexts = {1024, 4096, 8192};
  int64_t steps = 8, repeats = 2, batch = 1;
  kvgrid::kernels::cpu::WeightDType weight_dtype = kvgrid::kernels::cpu::WeightDType::kF32;
  std::string model_dir;
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
    } else if (a == "--model" && i + 1 < argc) {
      model_dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: long_decode_bench [--json] [--contexts 1024,4096,8192] "
                           "[--steps N] [--repeats N] [--batch N] [--weight-dtype W] "
                           "[--model DIR]\n");
      return 2;
    }
  }
  absl::StatusOr<std::unique_ptr<kvgrid::worker::LlamaModel>> model;
  if (model_dir.empty()) {
    const kvgrid::model::ModelConfig config = kvgrid::bench::Qwen2HalfBConfig();
    model = kvgrid::worker::LlamaModel::FromWeights(
        config, kvgrid::worker::LlamaModel::RandomWeights(config, 1234));
  } else {
    model = kvgrid::worker::LlamaModel::Load(model_dir);
  }
  if (!model.ok()) {
    std::fprintf(stderr, "long_decode_bench: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  if (absl::Status s = (*model)->QuantizeWeights(weight_dtype); !s.ok()) {
    std::fprintf(stderr, "long_decode_bench: %s\n", std::string(s.message()).c_str());
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
  const std::string model_name =
      model_dir.empty() ? "qwen2-0.5b-shape (random weights)" : model_dir;
  nlohmann::json j = {{"model", model_name},
                      {"weight_dtype", std::string(kvgrid::kernels::cpu::WeightDTypeName(weight_dtype))},
                      {"batch", batch},
                      {"steps", steps},
                      {"repeats", repeats},
                      {"results", rows}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
