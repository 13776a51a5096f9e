// kvgrid run: generate a continuation of one prompt and stream it to stdout.
#include <chrono>
#include <fstream>
#include <functional>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "model/special_tokens.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "tools/kvgrid/sampling_flags.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid run [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F)\n"
    "                  [flags]\n"
    "\n"
    "  --model DIR                 Hugging Face model directory (default: $KVGRID_MODEL, else\n"
    "                              the embedded models/kjv-tiny)\n"
    "  --prompt TEXT               prompt text, tokenized with the model's tokenizer\n"
    "  --prompt-ids IDS            prompt as comma-separated token ids\n"
    "  --prompts-file F            offline batch: one prompt per line, all through one engine;\n"
    "                              prints each result (one JSON object per line with --json)\n"
    "  --add-bos                   prepend the tokenizer's BOS token to a text prompt\n"
    "  --max-new-tokens N          default: generation_config.json, else 64\n"
    "  --temperature T             0 = greedy (default: generation_config.json, else 1)\n"
    "  --top-p P --top-k K --min-p P --repetition-penalty R --seed S\n"
    "  --presence-penalty P --frequency-penalty F   OpenAI's, over the generated tokens\n"
    "  --logit-bias ID:BIAS,...    add BIAS (in [-100, 100]) to each token id's logit\n"
    "  --ignore-eos                keep generating past EOS\n"
    "  --stop-token-ids IDS        extra token ids that end the sequence\n"
    "  --stop TEXT                 a stop string (left out of the text unless\n"
    "                              --include-stop-str-in-output)\n"
    "  --min-tokens N              no EOS, stop id or stop string before N tokens\n"
    "  --weight-dtype D            fp32 (default), q8_0 or q4_0: quantize the layers' weights\n"
    "                              at load (round to nearest)\n"
    "  --kv-cache-dtype D          fp32 (default), fp16, bf16, int8, int4, fp8_e4m3, or auto\n"
    "                              (the model's dtype); --k-cache-dtype / --v-cache-dtype\n"
    "                              choose separately\n"
    "  --kv-cache-memory BYTES     KV pool size, e.g. 256MiB (default 256MiB)\n"
    "  --block-size 8|16|32        tokens per KV block (default 16)\n"
    "  --max-model-len N           context window (default: max_position_embeddings)\n"
    "  --swap-space BYTES          host space for preempted sequences' blocks (default 0:\n"
    "                              preempted sequences are recomputed)\n"
    "  --preemption-mode M         auto (default: swap or recompute, whichever the engine\n"
    "                              measures as cheaper), swap or recompute\n"
    "  --watermark F               share of the KV pool kept free when admitting new\n"
    "                              requests while others run (default 0.01)\n"
    "  --enable-prefix-caching B   share cached prompt blocks (default true)\n"
    "  --json                      print one JSON object at the end instead of streaming\n";

struct RunResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;
};

// Offline batch mode: every non-empty line of `path` is a prompt; all go through one engine
// together. A prompt the engine refuses gets an "error" entry; the others still run.
absl::Status RunBatch(
    const std::string& path, const worker::GenerationRequest& base,
    const std::function<absl::StatusOr<std::vector<int32_t>>(const std::string&)>& encode,
    worker::Engine& engine, bool json) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--prompts-file: cannot open ", path));
  struct Item {
    std::string prompt;
    RunResult result;
    std::string error;
  };
  std::vector<Item> items;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    items.push_back({line, {}, {}});
  }
  if (items.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--prompts-file: ", path, " has no prompts"));
  }
  const auto start = std::chrono::steady_clock::now();
  absl::flat_hash_map<std::string, size_t> by_id;
  for (size_t i = 0; i < items.size(); ++i) {
    worker::GenerationRequest r = base;
    r.id = absl::StrCat("prompt-", i);
    absl::StatusOr<std::vector<int32_t>> ids = encode(items[i].prompt);
    if (!ids.ok()) return ids.status();
    r.prompt = *std::move(ids);
    items[i].result.prompt_ids = r.prompt;
    if (absl::Status s = engine.AddRequest(std::move(r)); !s.ok()) {
      items[i].error = std::string(s.message());
      continue;
    }
    by_id[absl::StrCat("prompt-", i)] = i;
  }
  int64_t generated = 0;
  while (engine.HasWork()) {
    KVGRID_ASSIGN_OR_RETURN(std::vector<worker::TokenOutput> outputs, engine.Step());
    for (const worker::TokenOutput& out : outputs) {
      Item& item = items[by_id.at(out.request_id)];
      item.result.token_ids.push_back(out.token_id);
      ++generated;
      item.result.text += out.text;
      if (out.finish != worker::FinishReason::kNone) {
        item.result.finish_reason = std::string(worker::FinishReasonName(out.finish));
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    if (json) {
      nlohmann::json j = {{"index", i}, {"prompt", item.prompt}};
      if (!item.error.empty()) {
        j["error"] = item.error;
      } else {
        j["text"] = item.result.text;
        j["tokens"] = item.result.token_ids.size();
        j["token_ids"] = item.result.token_ids;
        j["prompt_tokens"] = item.result.prompt_ids.size();
        j["finish_reason"] = item.result.finish_reason;
      }
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    } else if (!item.error.empty()) {
      std::printf("### %zu: %s\n[error: %s]\n\n", i, item.prompt.c_str(), item.error.c_str());
    } else {
      std::printf("### %zu: %s\n%s\n[%zu tokens, %s]\n\n", i, item.prompt.c_str(),
                  item.result.text.c_str(), item.result.token_ids.size(),
                  item.result.finish_reason.c_str());
    }
  }
  std::fflush(stdout);
  const worker::EngineStats stats = engine.Stats();
  std::fprintf(stderr,
               "[%zu prompts, %lld tokens generated in %.2f s: %.1f tokens/s; preemptions: "
               "%lld swaps, %lld recomputes]\n",
               items.size(), static_cast<long long>(generated), seconds, generated / seconds,
               static_cast<long long>(stats.num_swap_outs),
               static_cast<long long>(stats.num_recomputes));
  return absl::OkStatus();
}

absl::Status Run(Args& args) {
  const std::filesystem::path dir = ResolveModelDir(args);
  const std::optional<std::string> prompt_text = args.GetString("prompt");
  const std::optional<std::string> prompts_file = args.GetString("prompts-file");
  KVGRID_ASSIGN_OR_RETURN(auto prompt_ids_flag, args.GetIntList("prompt-ids"));
  KVGRID_ASSIGN_OR_RETURN(bool add_bos, args.GetBool("add-bos", false));
  KVGRID_ASSIGN_OR_RETURN(bool json, args.GetBool("json", false));
  KVGRID_ASSIGN_OR_RETURN(const SamplingFlags f, ReadSamplingFlags(args));
  KVGRID_ASSIGN_OR_RETURN(worker::EngineOptions options, EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const KvDTypeFlags kv_dtypes, KvDTypesFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const kernels::cpu::WeightDType weight_dtype, WeightDTypeFromArgs(args));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (prompt_text.has_value() + prompt_ids_flag.has_value() + prompts_file.has_value() != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --prompt, --prompt-ids and --prompts-file");
  }

  KVGRID_ASSIGN_OR_RETURN(LoadedModel loaded, LoadModelDir(dir, {}, weight_dtype));
  kv_dtypes.ApplyTo(loaded.model->config(), &options);
  const model::GenerationConfig& gen = loaded.generation;

  // Text -> prompt ids (optionally after BOS).
  auto encode = [&](const std::string& text) -> absl::StatusOr<std::vector<int32_t>> {
    if (!loaded.tokenizer) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir.string(), " has no tokenizer (no tokenizer.json, nor one embedded in a .gguf "
          "file); use --prompt-ids instead"));
    }
    std::vector<int32_t> ids;
    if (add_bos) {
      const std::optional<int32_t> bos =
          model::ResolveBosTokenId(loaded.tokenizer.get(), gen, loaded.model->config());
      if (!bos) return absl::InvalidArgumentError("--add-bos: the model defines no BOS token");
      ids.push_back(*bos);
    }
    std::vector<int32_t> text_ids = loaded.tokenizer->Encode(text);
    ids.insert(ids.end(), text_ids.begin(), text_ids.end());
    return ids;
  };

  worker::GenerationRequest request;
  request.id = "run";
  if (prompt_text) {
    KVGRID_ASSIGN_OR_RETURN(request.prompt, encode(*prompt_text));
  } else if (prompt_ids_flag) {
    request.prompt = *prompt_ids_flag;
  }

  // Defaults: generation_config.json (do_sample=false means greedy), then the flags.
  worker::SamplingParams& sp = request.sampling;
  if (gen.temperature) sp.temperature = *gen.temperature;
  if (gen.do_sample && !*gen.do_sample) sp.temperature = 0.0;
  if (gen.top_p) sp.top_p = *gen.top_p;
  if (gen.top_k) sp.top_k = *gen.top_k;
  if (gen.min_p) sp.min_p = *gen.min_p;
  if (gen.repetition_penalty) sp.repetition_penalty = *gen.repetition_penalty;
  if (f.temperature) sp.temperature = *f.temperature;
  if (f.top_p) sp.top_p = *f.top_p;
  if (f.top_k) sp.top_k = *f.top_k;
  if (f.min_p) sp.min_p = *f.min_p;
  if (f.repetition_penalty) sp.repetition_penalty = *f.repetition_penalty;
  if (f.presence_penalty) sp.presence_penalty = *f.presence_penalty;
  if (f.frequency_penalty) sp.frequency_penalty = *f.frequency_penalty;
  sp.logit_bias = f.logit_bias;
  if (f.seed) sp.seed = static_cast<uint64_t>(*f.seed);
  request.stopping.max_new_tokens = f.max_new_tokens ? *f.max_new_tokens
                                    : gen.max_new_tokens ? *gen.max_new_tokens
                                                         : 64;
  request.stopping.ignore_eos = f.ignore_eos;
  if (f.stop_token_ids) request.stopping.stop_token_ids = *f.stop_token_ids;
  if (f.stop) request.stopping.stop_strings = {*f.stop};
  request.stopping.include_stop_str_in_output = f.include_stop_str_in_output;
  if (f.min_tokens) request.stopping.min_tokens = *f.min_tokens;

  options.eos_token_ids = model::ResolveEosTokenIds(gen, loaded.model->config());

  options.tokenizer = loaded.tokenizer.get();  // text and stop strings come from the engine
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<worker::Engine> engine,
                          worker::Engine::Create(std::move(loaded.model), options));
  if (prompts_file) {
    return RunBatch(*prompts_file, request, encode, *engine, json);
  }

  RunResult result;
  result.prompt_ids = request.prompt;
  KVGRID_RETURN_IF_ERROR(engine->AddRequest(std::move(request)));

  const bool has_text = loaded.tokenizer != nullptr;
  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first_token;
  while (engine->HasWork()) {
    KVGRID_ASSIGN_OR_RETURN(std::vector<worker::TokenOutput> outputs, engine->Step());
    for (const worker::TokenOutput& out : outputs) {
      if (result.token_ids.empty()) first_token = std::chrono::steady_clock::now();
      result.token_ids.push_back(out.token_id);
      result.text += out.text;
      if (!json && !out.text.empty()) {
        std::fwrite(out.text.data(), 1, out.text.size(), stdout);
        std::fflush(stdout);
      }
      if (out.finish != worker::FinishReason::kNone) {
        result.finish_reason = std::string(worker::FinishReasonName(out.finish));
      }
    }
  }
  const auto end = std::chrono::steady_clock::now();
  const double total_s = std::chrono::duration<double>(end - start).count();
  const double decode_s = std::chrono::duration<double>(end - first_token).count();

  if (json) {
    nlohmann::json j;
    j["prompt_ids"] = result.prompt_ids;
    j["token_ids"] = result.token_ids;
    j["text"] = result.text;
    j["finish_reason"] = result.finish_reason;
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    if (!has_text) {
      for (int32_t id : result.token_ids) std::printf("%d ", id);
    }
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr,
                 "[%zu prompt tokens, %zu generated, finish: %s, %.2f s, %.1f tokens/s decode]\n",
                 result.prompt_ids.size(), result.token_ids.size(), result.finish_reason.c_str(),
                 total_s,
                 result.token_ids.size() > 1 ? (result.token_ids.size() - 1) / decode_s : 0.0);
    const worker::EngineStats st = engine->Stats();
    std::fprintf(stderr,
                 "[KV cache %s/%s: %d blocks of %lld tokens, %lld bytes/token, holds %lld tokens; "
                 "prefix hits %lld of %lld tokens, %lld preemptions]\n",
                 std::string(kernels::KvDTypeName(options.k_dtype)).c_str(),
                 std::string(kernels::KvDTypeName(options.v_dtype)).c_str(), st.blocks_total,
                 static_cast<long long>(options.block_size),
                 static_cast<long long>(st.bytes_per_token),
                 static_cast<long long>(st.tokens_capacity),
                 static_cast<long long>(st.prefix_hit_tokens),
                 static_cast<long long>(st.prefix_query_tokens),
                 static_cast<long long>(st.num_preemptions));
  }
  return absl::OkStatus();
}

}  // namespace

int RunCommand(Args& args) { return RunSubcommand(args, "run", kHelp, &Run); }

}  // namespace kvgrid::cli
