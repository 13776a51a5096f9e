// kvgrid perplexity: held-out perplexity of a model on a text file, computed through the paged
// KV cache (so the KV dtype's effect on quality is what is measured).
//
// The text is tokenized whole (no BOS) and cut into consecutive, non-overlapping windows of
// --window tokens (the last may be shorter); each window starts from an empty cache, its first
// token is context only, and every later token is predicted from the tokens before it in the
// window. perplexity = exp(mean negative log-likelihood over all predicted tokens). Windows are
// fed in chunks of --chunk tokens, each chunk attending to the earlier ones in the cache.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "worker/executor/perplexity.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid perplexity [--model DIR] --text-file F [--window N] [--chunk N]\n"
    "                         [--kv-cache-dtype D] [--weight-dtype W] [--block-size B]\n"
    "                         [--max-tokens N] [--json]\n"
    "  --window N      tokens per window (default min(512, max_position_embeddings))\n"
    "  --chunk N       tokens per forward pass inside a window (default 128)\n"
    "  --max-tokens N  evaluate only the first N tokens of the file\n"
    "  --weight-dtype W    fp32 (default), fp16, bf16, q8_0 or q4_0 (weights so from load)\n"
    "  --exact-linear      fp32 inputs to Q8_0/Q4_0/Q4_1 weights in decode-sized steps\n"
    "                  (--chunk 4 or less) instead of 8-bit ones and integer dot products\n"
    "  --kv-cache-dtype D  fp32 (default), fp16, bf16, int8, int4, fp8_e4m3, or auto (the\n"
    "                  model's dtype); --k-cache-dtype / --v-cache-dtype choose separately\n";

absl::Status Perplexity(Args& args) {
  const std::filesystem::path dir = ResolveModelDir(args);
  const std::optional<std::string> text_file = args.GetString("text-file");
  KVGRID_ASSIGN_OR_RETURN(auto window_flag, args.GetInt("window"));
  KVGRID_ASSIGN_OR_RETURN(auto chunk_flag, args.GetInt("chunk"));
  KVGRID_ASSIGN_OR_RETURN(auto max_tokens, args.GetInt("max-tokens"));
  KVGRID_ASSIGN_OR_RETURN(bool json, args.GetBool("json", false));
  KVGRID_ASSIGN_OR_RETURN(worker::EngineOptions options, EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const KvDTypeFlags kv_dtypes, KvDTypesFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const kernels::cpu::WeightDType weight_dtype, WeightDTypeFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const bool exact_linear, args.GetBool("exact-linear", false));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (!text_file) return absl::InvalidArgumentError("--text-file: required");

  std::ifstream in(*text_file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--text-file: cannot open ", *text_file));
  std::stringstream buffer;
  buffer << in.rdbuf();

  KVGRID_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModelDir(dir, {}, weight_dtype));
  kv_dtypes.ApplyTo(loaded.model->config(), &options);
  if (!loaded.tokenizer) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir.string(), " has no tokenizer (no tokenizer.json, nor one embedded in a .gguf file)"));
  }
  std::vector<int32_t> tokens = loaded.tokenizer->Encode(buffer.str());
  if (max_tokens && *max_tokens > 0 && static_cast<int64_t>(tokens.size()) > *max_tokens) {
    tokens.resize(*max_tokens);
  }
  worker::LlamaModel& model = *loaded.model;
  if (exact_linear) model.SetLinearPrecision(kernels::cpu::LinearPrecision::kExact);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= model.config().vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir.string(), ": the tokenizer produced token id ", tokens[i],
          " outside the model's vocabulary of ", model.config().vocab_size));
    }
  }
  if (tokens.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--text-file: ", *text_file, " has fewer than 2 tokens"));
  }
  worker::EvaluationOptions eval;
  eval.window = window_flag ? *window_flag
                            : std::min<int64_t>(512, model.config().max_position_embeddings);
  eval.chunk = chunk_flag ? *chunk_flag : 128;
  eval.block_size = options.block_size;
  eval.k_dtype = options.k_dtype;
  eval.v_dtype = options.v_dtype;
  absl::StatusOr<worker::EvaluationResult> result = worker::EvaluateTokens(model, tokens, eval);
  if (!result.ok()) {
    // Name the flag a bad window or chunk came from.
    return absl::Status(result.status().code(), absl::StrCat("--", result.status().message()));
  }
  const double ppl = result->perplexity;
  const int64_t predicted = result->predicted;
  const int64_t window = eval.window;
  if (json) {
    nlohmann::json j = {{"perplexity", ppl},
                        {"tokens", predicted},
                        {"window", window},
                        {"k_cache_dtype", std::string(kernels::KvDTypeName(options.k_dtype))},
                        {"v_cache_dtype", std::string(kernels::KvDTypeName(options.v_dtype))}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("perplexity %.4f over %lld predicted tokens (window %lld)\n", ppl,
                static_cast<long long>(predicted), static_cast<long long>(window));
  }
  return absl::OkStatus();
}

}  // namespace

int PerplexityCommand(Args& args) { return RunSubcommand(args, "perplexity", kHelp, &Perplexity); }

}  // namespace kvgrid::cli
