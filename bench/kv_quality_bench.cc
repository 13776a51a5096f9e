// kv_quality_bench: what each KV-cache dtype costs in quality on the embedded trained model.
// For every dtype (and int8 K + int4 V), held-out perplexity and top-1 agreement with the fp16
// cache (the share of predicted positions whose most likely token is the same), all through
// the paged cache with the evaluation windowing of `kvgrid perplexity`. Int8 runs twice where
// the CPU has integer dot products: with the fast kernels (queries and softmax weights rounded
// to int8) and the exact ones (fp32 math on the decoded rows).
//
//   build/bin/kv_quality_bench [--json] [--model DIR] [--text-file F] [--max-tokens N]
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "worker/executor/llama_model.h"
#include "worker/executor/perplexity.h"

namespace {

using kvgrid::kernels::KvDType;

int Fail(const std::string& message) {
  std::fprintf(stderr, "kv_quality_bench: %s\n", message.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  std::string model_dir = std::string(KVGRID_SOURCE_DIR) + "/models/kjv-tiny";
  std::string text_file;
  int64_t max_tokens = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--model" && i + 1 < argc) {
      model_dir = argv[++i];
    } else if (a == "--text-file" && i + 1 < argc) {
      text_file = argv[++i];
    } else if (a == "--max-tokens" && i + 1 < argc) {
      max_tokens = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: kv_quality_bench [--json] [--model DIR] [--text-file F] "
                           "[--max-tokens N]\n");
      return 2;
    }
  }
  if (text_file.empty()) text_file = model_dir + "/heldout.txt";
  std::ifstream in(text_file, std::ios::binary);
  if (!in) return Fail("cannot open " + text_file);
  std::stringstream text;
  text << in.rdbuf();
  auto tokenizer = kvgrid::model::Tokenizer::FromFile(model_dir + "/tokenizer.json");
  if (!tokenizer.ok()) return Fail(std::string(tokenizer.status().message()));
  std::vector<int32_t> tokens = (*tokenizer)->Encode(text.str());
  if (max_tokens > 0 && static_cast<int64_t>(tokens.size()) > max_tokens) tokens.resize(max_tokens);
  auto model = kvgrid::worker::LlamaModel::Load(model_dir);
  if (!model.ok()) return Fail(std::string(model.status().message()));

  using kvgrid::kernels::cpu::KvKernelPrecision;
  struct Variant {
    const char* name;
    KvDType k, v;
    KvKernelPrecision precision = KvKernelPrecision::kFast;
  };
  const Variant variants[] = {{"fp16", KvDType::kF16, KvDType::kF16},
                              {"fp32", KvDType::kF32, KvDType::kF32},
                              {"bf16", KvDType::kBF16, KvDType::kBF16},
                              {"int8", KvDType::kInt8, KvDType::kInt8},
                              {"int8 (exact kernels)", KvDType::kInt8, KvDType::kInt8,
                               KvKernelPrecision::kExact},
                              {"int4", KvDType::kInt4, KvDType::kInt4},
                              {"int8k-int4v", KvDType::kInt8, KvDType::kInt4},
                              {"fp8_e4m3", KvDType::kFp8E4m3, KvDType::kFp8E4m3}};
  nlohmann::json rows = nlohmann::json::array();
  kvgrid::worker::EvaluationResult reference;
  for (const Variant& var : variants) {
    kvgrid::worker::EvaluationOptions o;
    o.window = std::min<int64_t>(512, (*model)->config().max_position_embeddings);
    o.k_dtype = var.k;
    o.v_dtype = var.v;
    o.keep_argmax = true;
    (*model)->SetAttentionPrecision(var.precision);
    const std::string kernels =
        kvgrid::kernels::cpu::KvRowKernelsFor(var.k, var.precision).name;
    auto r = kvgrid::worker::EvaluateTokens(**model, tokens, o);
    if (!r.ok()) return Fail(std::string(var.name) + ": " + std::string(r.status().message()));
    if (rows.empty()) reference = *r;
    int64_t same = 0;
    for (size_t i = 0; i < r->argmax.size(); ++i) same += r->argmax[i] == reference.argmax[i];
    rows.push_back({{"kv_dtype", var.name},
                    {"k_kernels", kernels},
                    {"perplexity", r->perplexity},
                    {"tokens", r->predicted},
                    {"perplexity_vs_fp16", r->perplexity / reference.perplexity - 1.0},
                    {"top1_agreement_vs_fp16",
                     static_cast<double>(same) / static_cast<double>(r->predicted)}});
  }
  nlohmann::json j = {{"model", model_dir}, {"text_file", text_file}, {"results", rows}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
