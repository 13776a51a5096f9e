// gguf_quant_bench: a GGUF model file as kvgrid runs it on the CPU, in figures that compare
// with llama.cpp's own tools on the same file (bench/kquant_vs_llamacpp.sh runs both):
//
//   perplexity  llama-perplexity's protocol: the text tokenized whole (BOS in front when the
//               file's tokenizer adds one), cut into chunks of --ctx tokens (the remainder
//               dropped), each chunk's first token replaced by BOS when the tokenizer adds one,
//               and only the predictions of the second half of each chunk scored:
//               exp(mean NLL of tokens ctx/2 + 1 .. ctx - 1 of every chunk).
//   decode      batch-1 decode speed, as llama-bench's tg: --decode-tokens single-token
//               forward passes from an empty cache, logits included (tokens/s, best of
//               --repeats).
//   gemv        per weight type in the file, the decode GEMV (QuantLinear, one token) on the
//               largest layer matrix of that type: microseconds and GB/s of weight bytes;
//               and (gemv_4096) on a 4096 x 4096 matrix of random blocks of every type.
//
//   build/bin/gguf_quant_bench --model F.gguf --text-file T [--ctx 512] [--chunks N]
//                              [--decode-tokens 64] [--repeats 3] [--json]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/quant_linear.h"
#include "model/gguf.h"
#include "model/gguf_tokenizer.h"
#include "nlohmann/json.hpp"
#include "worker/executor/llama_model.h"
#include "worker/executor/perplexity.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvgrid::kernels::cpu::QuantMatrix;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "gguf_quant_bench: %s\n", what.c_str());
  std::exit(1);
}

struct Flags {
  std::string model, text_file;
  int64_t ctx = 512, chunks = -1, decode_tokens = 64, repeats = 3;
  bool json = false;
};

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Fail(a + ": needs a value");
      return argv[++i];
    };
    if (a == "--model") f.model = value();
    else if (a == "--text-file") f.text_file = value();
    else if (a == "--ctx") f.ctx = std::stoll(value());
    else if (a == "--chunks") f.chunks = std::stoll(value());
    else if (a == "--decode-tokens") f.decode_tokens = std::stoll(value());
    else if (a == "--repeats") f.repeats = std::stoll(value());
    else if (a == "--json") f.json = true;
    else Fail("unknown flag " + a);
  }
  if (f.model.empty()) Fail("--model: required (a .gguf file)");
  if (f.ctx < 4) Fail("--ctx: at least 4");
  return f;
}

template <typename T>
T OrFail(absl::StatusOr<T> v) {
  if (!v.ok()) Fail(std::string(v.status().message()));
  return *std::move(v);
}

}  // namespace

int main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  std::unique_ptr<kvgrid::worker::LlamaModel> model =
      OrFail(kvgrid::worker::LlamaModel::LoadGguf(flags.model));
  std::unique_ptr<kvgrid::model::GgufFile> file =
      OrFail(kvgrid::model::GgufFile::Open(flags.model));
  nlohmann::json out = {{"model", flags.model}, {"weight_bytes", model->WeightBytes()}};
  std::map<std::string, int64_t> type_counts;
  for (const auto& [name, t] : file->tensors()) ++type_counts[kvgrid::model::GgmlTypeName(t.type)];
  out["tensor_types"] = type_counts;

  if (!flags.text_file.empty()) {
    std::unique_ptr<kvgrid::model::Tokenizer> tok =
        OrFail(kvgrid::model::LoadModelTokenizer(flags.model));
    if (!tok) Fail("the file has no tokenizer");
    std::ifstream in(flags.text_file, std::ios::binary);
    if (!in) Fail("cannot open " + flags.text_file);
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int32_t> tokens = tok->Encode(text.str(), /*add_special_tokens=*/true);
    const std::optional<int32_t> bos = tok->bos_token_id();
    const bool add_bos = !tokens.empty() && bos && tokens.front() == *bos;
    int64_t n_chunks = static_cast<int64_t>(tokens.size()) / flags.ctx;
    if (flags.chunks > 0) n_chunks = std::min(n_chunks, flags.chunks);
    const int64_t first = flags.ctx / 2;
    double nll = 0;
    int64_t scored = 0;
    const auto t0 = Clock::now();
    for (int64_t c = 0; c < n_chunks; ++c) {
      std::vector<int32_t> chunk(tokens.begin() + c * flags.ctx,
                                 tokens.begin() + (c + 1) * flags.ctx);
      if (add_bos) chunk[0] = *bos;
      kvgrid::worker::EvaluationOptions o{.window = flags.ctx, .chunk = flags.ctx};
      // All predictions of the chunk, less those of its first half (the same forward pass
      // over the same prefix): the second half's.
      const auto all = OrFail(kvgrid::worker::EvaluateTokens(*model, chunk, o));
      const auto head = OrFail(kvgrid::worker::EvaluateTokens(
          *model, std::span<const int32_t>(chunk.data(), static_cast<size_t>(first + 1)), o));
      nll += all.nll - head.nll;
      scored += all.predicted - head.predicted;
    }
    out["perplexity"] = {{"ctx", flags.ctx}, {"chunks", n_chunks},
                         {"tokens", static_cast<int64_t>(tokens.size())},
                         {"add_bos", add_bos}, {"scored", scored},
                         {"ppl", scored > 0 ? std::exp(nll / static_cast<double>(scored)) : 0.0},
                         {"seconds", Seconds(t0, Clock::now())}};
  }

  {
    // Decode: single-token forward passes (window = decode_tokens, chunk = 1).
    std::vector<int32_t> ids(static_cast<size_t>(flags.decode_tokens));
    for (size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int32_t>((i * 2654435761u) % model->config().vocab_size);
    }
    kvgrid::worker::EvaluationOptions o{.window = flags.decode_tokens, .chunk = 1};
    double best = 0;
    for (int64_t r = 0; r < flags.repeats; ++r) {
      const auto t0 = Clock::now();
      OrFail(kvgrid::worker::EvaluateTokens(*model, ids, o));
      best = std::max(best, static_cast<double>(flags.decode_tokens) / Seconds(t0, Clock::now()));
    }
    out["decode"] = {{"tokens", flags.decode_tokens}, {"tokens_per_s", best}};
  }

  {
    // The decode GEMV per block type: the largest 2-D tensor of each.
    std::map<std::string, const kvgrid::model::GgufTensor*> largest;
    for (const auto& [name, t] : file->tensors()) {
      if (t.ne.size() != 2 || !kvgrid::kernels::cpu::WeightDTypeOfGgml(t.type)) continue;
      const std::string type = kvgrid::model::GgmlTypeName(t.type);
      if (!largest.contains(type) || largest[type]->data.size() < t.data.size()) largest[type] = &t;
    }
    nlohmann::json gemv = nlohmann::json::array();
    for (const auto& [type, t] : largest) {
      const QuantMatrix w = OrFail(kvgrid::kernels::cpu::QuantMatrixFromGguf(*t));
      std::vector<float> x(static_cast<size_t>(w.cols), 0.5f), y(static_cast<size_t>(w.rows));
      const kvgrid::kernels::cpu::QuantLinearParams p{
          .input = x.data(), .weight = &w, .output = y.data(), .num_tokens = 1};
      // Best of --repeats batches of 20 calls: the machine is shared, the minimum is the
      // figure that repeats.
      double us = 1e30;
      for (int64_t r = 0; r < std::max<int64_t>(flags.repeats, 5); ++r) {
        const auto t0 = Clock::now();
        for (int i = 0; i < 20; ++i) {
          if (absl::Status s = kvgrid::kernels::cpu::QuantLinear(p); !s.ok()) {
            Fail(std::string(s.message()));
          }
        }
        us = std::min(us, 1e6 * Seconds(t0, Clock::now()) / 20);
      }
      gemv.push_back({{"type", type}, {"tensor", t->name}, {"rows", w.rows}, {"cols", w.cols},
                      {"us", us},
                      {"gb_per_s", static_cast<double>(w.data.size()) / us * 1e-3}});
    }
    out["gemv"] = gemv;
  }

  {
    // The same GEMV on a 4096 x 4096 matrix of random valid blocks of every block type kvgrid
    // reads (a 7B-class layer: the per-row costs amortized as in a real model), fp32 inputs.
    nlohmann::json gemv = nlohmann::json::array();
    const int64_t n = 4096, k = 4096;
    std::mt19937 rng(1);
    for (kvgrid::model::GgmlType type :
         {kvgrid::model::GgmlType::kQ8_0, kvgrid::model::GgmlType::kQ4_0,
          kvgrid::model::GgmlType::kQ4_1, kvgrid::model::GgmlType::kQ5_0,
          kvgrid::model::GgmlType::kQ5_1, kvgrid::model::GgmlType::kIQ4_NL,
          kvgrid::model::GgmlType::kQ2_K, kvgrid::model::GgmlType::kQ3_K,
          kvgrid::model::GgmlType::kQ4_K, kvgrid::model::GgmlType::kQ5_K,
          kvgrid::model::GgmlType::kQ6_K}) {
      QuantMatrix w{.dtype = *kvgrid::kernels::cpu::WeightDTypeOfGgml(type), .rows = n, .cols = k};
      w.data.resize(static_cast<size_t>(n * w.RowBytes()));
      // Small random bytes: every fp16 field then holds a finite value (exponent <= 7).
      for (uint8_t& b : w.data) b = static_cast<uint8_t>(rng() & 0x1F);
      std::vector<float> x(static_cast<size_t>(k), 0.5f), y(static_cast<size_t>(n));
      const kvgrid::kernels::cpu::QuantLinearParams p{
          .input = x.data(), .weight = &w, .output = y.data(), .num_tokens = 1};
      double us = 1e30;
      for (int64_t r = 0; r < std::max<int64_t>(flags.repeats, 5); ++r) {
        const auto t0 = Clock::now();
        for (int i = 0; i < 5; ++i) {
          if (absl::Status s = kvgrid::kernels::cpu::QuantLinear(p); !s.ok()) {
            Fail(std::string(s.message()));
          }
        }
        us = std::min(us, 1e6 * Seconds(t0, Clock::now()) / 5);
      }
      gemv.push_back({{"type", kvgrid::model::GgmlTypeName(type)}, {"rows", n}, {"cols", k},
                      {"us", us}, {"weights_per_ns", static_cast<double>(n * k) / us * 1e-3},
                      {"gb_per_s", static_cast<double>(w.data.size()) / us * 1e-3}});
    }
    out["gemv_4096"] = gemv;
  }

  if (flags.json) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    if (out.contains("perplexity")) {
      std::printf("perplexity (ctx %lld, %lld chunks): %.4f\n",
                  static_cast<long long>(flags.ctx),
                  static_cast<long long>(out["perplexity"]["chunks"].get<int64_t>()),
                  out["perplexity"]["ppl"].get<double>());
    }
    std::printf("decode: %.1f tokens/s\n", out["decode"]["tokens_per_s"].get<double>());
    for (const auto& g : out["gemv"]) {
      std::printf("gemv %-6s %-28s %6.1f us %6.2f GB/s\n", g["type"].get<std::string>().c_str(),
                  g["tensor"].get<std::string>().c_str(), g["us"].get<double>(),
                  g["gb_per_s"].get<double>());
    }
    for (const auto& g : out["gemv_4096"]) {
      std::printf("gemv 4096x4096 %-6s %8.1f us %6.2f GB/s %5.2f weights/ns\n",
                  g["type"].get<std::string>().c_str(), g["us"].get<double>(),
                  g["gb_per_s"].get<double>(), g["weights_per_ns"].get<double>());
    }
  }
  return 0;
}
