// kvgrid run: generate a continuation of one prompt and stream it to stdout.
#include <chrono>
#include <fstream>
#include <functional>
#include <optional>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/gemm.h"
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
    "                              prints each result (one JSON object per line with --json,\n"
    "                              then one line {\"timings\": ...} for the whole batch)\n"
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
    "  --weight-dtype D            fp32 (default), fp16, bf16, q8_0 or q4_0: hold the layers'\n"
    "                              weights so from load (round to nearest; 16-bit: the\n"
    "                              embedding and head too)\n"
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
    "  --threads N                 CPU threads for the kernels (default: every core, or\n"
    "                              $OMP_NUM_THREADS)\n"
    "  --json                      print one JSON object at the end instead of streaming,\n"
    "                              with \"timings\": load_ms, prompt_tokens, prefill_ms (until\n"
    "                              the first token), generated_tokens, decode_tokens (those\n"
    "                              after the first), decode_ms and the rates of both phases\n";

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// What a run measured, split where the first token appears: prefill is everything up to it
// (the prompt's forward pass and the first sampling), decode everything after. Each token is
// counted in exactly one phase, so the rates divide what a phase produced by its own time.
struct PhaseTimings {
  double load_ms = 0;         // loading the weights and creating the engine (KV pool)
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // of those, found in the prefix cache (not computed)
  double prefill_ms = 0;
  int64_t generated_tokens = 0;
  int64_t decode_tokens = 0;  // generated after the prefill phase ended
  double decode_ms = 0;

  nlohmann::json ToJson() const {
    const auto rate = [](int64_t tokens, double ms) { return ms > 0 ? 1e3 * tokens / ms : 0.0; };
    return {{"load_ms", load_ms},
            {"prompt_tokens", prompt_tokens},
            {"cached_prompt_tokens", cached_prompt_tokens},
            {"prefill_ms", prefill_ms},
            {"generated_tokens", generated_tokens},
            {"decode_tokens", decode_tokens},
            {"decode_ms", decode_ms},
            {"total_ms", prefill_ms + decode_ms},
            {"prefill_tokens_per_s", rate(prompt_tokens, prefill_ms)},
            {"decode_tokens_per_s", rate(decode_tokens, decode_ms)}};
  }
};

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
    worker::Engine& engine, bool json, double load_ms) {
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
  const Clock::time_point start = Clock::now();
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
  // The batch's prefill phase ends with the step in which the last admitted prompt got its
  // first token; the tokens of that step and the ones before (other sequences' early decodes
  // included) belong to it, the later steps' tokens to the decode phase.
  PhaseTimings timings;
  timings.load_ms = load_ms;
  int64_t generated = 0, prefill_phase_tokens = 0;
  size_t started = 0;
  Clock::time_point prefill_end = start;
  bool prefill_done = by_id.empty();
  while (engine.HasWork()) {
    KVGRID_ASSIGN_OR_RETURN(std::vector<worker::TokenOutput> outputs, engine.Step());
    for (const worker::TokenOutput& out : outputs) {
      Item& item = items[by_id.at(out.request_id)];
      if (item.result.token_ids.empty()) ++started;
      item.result.token_ids.push_back(out.token_id);
      ++generated;
      item.result.text += out.text;
      if (out.finish != worker::FinishReason::kNone) {
        item.result.finish_reason = std::string(worker::FinishReasonName(out.finish));
        timings.cached_prompt_tokens += out.usage.cached_prompt_tokens;
      }
    }
    if (!prefill_done) {
      prefill_phase_tokens = generated;
      if (started == by_id.size()) {
        prefill_done = true;
        prefill_end = Clock::now();
      }
    }
  }
  const Clock::time_point end = Clock::now();
  if (!prefill_done) prefill_end = end;
  const double seconds = Ms(start, end) / 1e3;
  for (const auto& [id, i] : by_id) {
    timings.prompt_tokens += static_cast<int64_t>(items[i].result.prompt_ids.size());
  }
  timings.prefill_ms = Ms(start, prefill_end);
  timings.generated_tokens = generated;
  timings.decode_tokens = generated - prefill_phase_tokens;
  timings.decode_ms = Ms(prefill_end, end);
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
  if (json) {
    const nlohmann::json summary = {{"prompts", by_id.size()},
                                    {"errors", items.size() - by_id.size()},
                                    {"timings", timings.ToJson()}};
    std::printf("%s\n", summary.dump().c_str());
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
  KVGRID_ASSIGN_OR_RETURN(const std::optional<int64_t> threads, args.GetInt("threads"));
  KVGRID_ASSIGN_OR_RETURN(const SamplingFlags f, ReadSamplingFlags(args));
  KVGRID_ASSIGN_OR_RETURN(worker::EngineOptions options, EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const KvDTypeFlags kv_dtypes, KvDTypesFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const kernels::cpu::WeightDType weight_dtype, WeightDTypeFromArgs(args));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (prompt_text.has_value() + prompt_ids_flag.has_value() + prompts_file.has_value() != 1) {
    return absl::InvalidArgumentError(
        "give exactly one of --prompt, --prompt-ids and --prompts-file");
  }
  if (threads) {
    if (*threads < 1 || *threads > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--threads: must be in [1, 1024], got ", *threads));
    }
    kernels::cpu::SetNumThreads(static_cast<int>(*threads));
  }

  const Clock::time_point load_start = Clock::now();
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
  const double load_ms = Ms(load_start, Clock::now());
  if (prompts_file) {
    return RunBatch(*prompts_file, request, encode, *engine, json, load_ms);
  }

  RunResult result;
  result.prompt_ids = request.prompt;
  PhaseTimings timings;
  timings.load_ms = load_ms;
  timings.prompt_tokens = static_cast<int64_t>(request.prompt.size());

  const bool has_text = loaded.tokenizer != nullptr;
  const Clock::time_point start = Clock::now();
  KVGRID_RETURN_IF_ERROR(engine->AddRequest(std::move(request)));
  std::optional<Clock::time_point> first_token;
  int64_t first_step_tokens = 0;
  while (engine->HasWork()) {
    KVGRID_ASSIGN_OR_RETURN(std::vector<worker::TokenOutput> outputs, engine->Step());
    // The first token is stamped once its step returns, before any of its text is written.
    if (!first_token && !outputs.empty()) {
      first_token = Clock::now();
      first_step_tokens = static_cast<int64_t>(outputs.size());
    }
    for (const worker::TokenOutput& out : outputs) {
      result.token_ids.push_back(out.token_id);
      result.text += out.text;
      if (!json && !out.text.empty()) {
        std::fwrite(out.text.data(), 1, out.text.size(), stdout);
        std::fflush(stdout);
      }
      if (out.finish != worker::FinishReason::kNone) {
        result.finish_reason = std::string(worker::FinishReasonName(out.finish));
        timings.cached_prompt_tokens = out.usage.cached_prompt_tokens;
      }
    }
  }
  const Clock::time_point end = Clock::now();
  const Clock::time_point prefill_end = first_token.value_or(end);
  timings.prefill_ms = Ms(start, prefill_end);
  timings.generated_tokens = static_cast<int64_t>(result.token_ids.size());
  timings.decode_tokens = timings.generated_tokens - first_step_tokens;
  timings.decode_ms = Ms(prefill_end, end);
  const double total_s = Ms(start, end) / 1e3;
  const double decode_s = timings.decode_ms / 1e3;

  if (json) {
    nlohmann::json j;
    j["prompt_ids"] = result.prompt_ids;
    j["token_ids"] = result.token_ids;
    j["text"] = result.text;
    j["finish_reason"] = result.finish_reason;
    j["timings"] = timings.ToJson();
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
