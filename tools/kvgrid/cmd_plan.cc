// kvgrid plan: for a model's config.json and a memory budget, what the KV cache holds per
// dtype once the weights are in: bytes per token, max tokens, max concurrent sequences at a
// context length. Reads config.json only, so it works without the weights; for a GGUF file, its
// metadata and tensor directory (the weights as stored, quantized blocks included). With
// --tp T the budget is each card's of a tensor-parallel group, which holds rank 0's share of
// the weights (the largest) and its KV heads of every token; with --cp C, C such cards split
// each sequence's blocks, so a sequence may be C times as long.
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/quant_linear.h"
#include "model/gguf.h"
#include "model/gguf_config.h"
#include "model/model_config.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/kv_planner.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid plan [--model DIR|config.json|model.gguf] --memory 24GiB [--context N]\n"
    "                   [--weight-dtype auto|fp32|bf16|fp16|q8_0|q4_0|q4_1] [--block-size 8|16|32]\n"
    "                   [--tp T] [--cp C] [--max-num-batched-tokens 8192] [--json]\n"
    "per KV dtype (fp32, fp16, bf16, int8, int4, int8 keys + int4 values, fp8_e4m3): bytes per\n"
    "token, max tokens and max concurrent sequences at --context (default: the model's\n"
    "max_position_embeddings), in what --memory leaves after the weights.\n"
    "Weights: parameters counted from config.json at --weight-dtype. auto: an AWQ/GPTQ\n"
    "config's 4-bit layers (as kvgrid holds them: 20 bytes per 32 weights), else the config's\n"
    "torch_dtype (fp32 when absent). q8_0/q4_0/q4_1: the layers' linear weights in blocks of\n"
    "32 (34/18/20 bytes) and the head in Q8_0, as --weight-dtype quantizes at load; the rest\n"
    "at torch_dtype. A .gguf model: its tensors as kvgrid holds them, blocks of any type it may\n"
    "hold (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K) at their size as stored (mixed\n"
    "q/k/v or gate/up types and the embedding too), F16/BF16 matrices in 16 bits, F32\n"
    "tensors and every norm or bias as fp32\n"
    "(--weight-dtype must be auto). --tp T: --memory is each card's of a tensor-parallel\n"
    "group of T (as kvgrid-worker\n"
    "--tensor-parallel-size shards: heads, KV heads and MLP columns split, KV heads replicated\n"
    "when T exceeds them, the vocabulary split when T divides it); a card holds its share of\n"
    "the weights and of every token's KV, so the token and sequence figures are the group's.\n"
    "--cp C: C cards (of T each) hold the same weights and split every sequence's KV blocks\n"
    "(as kvgrid-worker --context-parallel-size): blocks, tokens and the context one sequence\n"
    "may reach are the group's, C times a card's.\n"
    "Sliding-window models whose every layer slides (Mistral) hold only the window and one\n"
    "step's tokens (--max-num-batched-tokens) per sequence: max sequences counts such\n"
    "sequences and the context is not bounded by the KV cache. Models where only some layers\n"
    "slide (Qwen2 with max_window_layers) free nothing and are planned as full attention.\n"
    "--json: one JSON object per dtype per line.\n";

// A GGUF file's weights as LlamaModel::LoadGguf holds them: matrices in blocks or F16/BF16 at
// their size as stored (every one: mixed-type layers are held as parts, the embedding in its
// blocks), F32 tensors and vectors as fp32.
worker::WeightFootprint GgufFootprint(const model::GgufFile& file) {
  worker::WeightFootprint f{.dtype = "gguf"};
  for (const auto& [name, tensor] : file.tensors()) {
    f.params += tensor.NumElements();
    // As LoadGguf holds them: matrices in their blocks or 16-bit floats as stored; F32
    // tensors, and vectors (norms, biases) of any type, as fp32.
    const bool as_stored = tensor.ne.size() >= 2 && kernels::cpu::HeldDTypeOfGgml(tensor.type);
    f.bytes += as_stored ? static_cast<int64_t>(tensor.data.size())
                         : tensor.NumElements() * static_cast<int64_t>(sizeof(float));
  }
  return f;
}

std::string GiB(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / static_cast<double>(1ll << 30));
}

absl::Status Plan(Args& args) {
  const std::filesystem::path path = ResolveModelDir(args);
  const std::optional<std::string> memory_flag = args.GetString("memory");
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> context_flag, args.GetInt("context"));
  const std::string weight_dtype = args.GetString("weight-dtype").value_or("auto");
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> block_size_flag, args.GetInt("block-size"));
  KVGRID_ASSIGN_OR_RETURN(const bool json, args.GetBool("json", false));
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> tp_flag, args.GetInt("tp"));
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> cp_flag, args.GetInt("cp"));
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> chunk_flag, args.GetInt("max-num-batched-tokens"));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  const int64_t prefill_chunk = chunk_flag.value_or(8192);
  if (prefill_chunk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-num-batched-tokens: must be >= 1, got ", prefill_chunk));
  }

  if (!memory_flag) {
    return absl::InvalidArgumentError("--memory: required (the device memory budget, e.g. 24GiB)");
  }
  KVGRID_ASSIGN_OR_RETURN(const int64_t memory, ParseBytes(*memory_flag, "memory"));
  const int64_t block_size = block_size_flag.value_or(16);
  if (block_size != 8 && block_size != 16 && block_size != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("--block-size: must be 8, 16 or 32, got ", block_size));
  }
  std::unique_ptr<model::GgufFile> gguf;
  if (path.extension() == ".gguf") {
    if (weight_dtype != "auto") {
      return absl::InvalidArgumentError(
          "--weight-dtype: a GGUF file's weights are planned as stored (leave it at auto)");
    }
    KVGRID_ASSIGN_OR_RETURN(gguf, model::GgufFile::Open(path));
  }
  absl::StatusOr<model::ModelConfig> loaded =
      gguf ? model::ModelConfigFromGguf(*gguf) : model::LoadModelConfig(path);
  if (absl::IsNotFound(loaded.status())) {
    return absl::NotFoundError(absl::StrCat("--model: ", std::string(loaded.status().message()),
                                            " (expected a model directory or its config.json)"));
  }
  KVGRID_ASSIGN_OR_RETURN(const model::ModelConfig config, std::move(loaded));
  const int64_t tp = tp_flag.value_or(1);
  if (tp < 1 || tp > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--tp: must be in [1, 64], got ", tp));
  }
  const int64_t cp = cp_flag.value_or(1);
  if (cp < 1 || cp > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--cp: must be in [1, 64], got ", cp));
  }
  if (tp > 1 && gguf) {
    return absl::InvalidArgumentError("--tp: GGUF models are served by one rank (tp 1)");
  }
  if (tp > 1 && config.quantization.quantized()) {
    return absl::InvalidArgumentError(
        "--tp: 4-bit AWQ/GPTQ checkpoints are served by one rank (tp 1)");
  }
  // What rank 0 of the group holds: the config as it sees the model.
  model::ModelConfig shard = config;
  if (tp > 1) {
    const worker::TensorParallel group{.rank = 0, .size = static_cast<int>(tp)};
    if (absl::Status s = group.ValidateSplit(config); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tp: ", std::string(s.message())));
    }
    const worker::ShardDims d = worker::ShardDimsOf(config, group);
    shard.num_attention_heads = d.heads;
    shard.num_key_value_heads = d.kv_heads;
    shard.intermediate_size = d.inter;
    shard.vocab_size = d.vocab_local;
  }
  const int64_t context = context_flag.value_or(config.max_position_embeddings);
  if (context <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--context: must be positive, got ", context));
  }
  absl::StatusOr<worker::WeightFootprint> weights =
      gguf ? GgufFootprint(*gguf) : worker::PlanWeights(shard, weight_dtype);
  if (!weights.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight-dtype: ", std::string(weights.status().message())));
  }
  absl::StatusOr<std::vector<worker::KvPlanRow>> rows =
      worker::PlanKvCapacity(shard, memory, context, block_size, *weights, prefill_chunk);
  if (!rows.ok()) {
    // Flags were validated above: what is left is weights that do not fit.
    return absl::InvalidArgumentError(
        absl::StrCat("--memory ", *memory_flag, ": ", std::string(rows.status().message())));
  }
  worker::ApplyContextParallel(cp, &*rows);

  if (json) {
    for (const worker::KvPlanRow& r : *rows) {
      nlohmann::json j;
      j["dtype"] = r.dtype;
      j["k_dtype"] = std::string(kernels::KvDTypeName(r.k_dtype));
      j["v_dtype"] = std::string(kernels::KvDTypeName(r.v_dtype));
      j["bytes_per_token"] = r.bytes_per_token;
      j["bytes_per_block"] = r.bytes_per_block;
      j["block_size"] = r.block_size;
      j["blocks"] = r.blocks;
      j["max_tokens"] = r.max_tokens;
      j["context"] = r.context;
      j["blocks_per_sequence"] = r.blocks_per_sequence;
      j["max_sequences"] = r.max_sequences;
      j["memory_bytes"] = r.memory_bytes;
      j["weight_dtype"] = r.weight_dtype;
      j["weight_params"] = r.weight_params;
      j["weight_bytes"] = r.weight_bytes;
      j["kv_budget_bytes"] = r.kv_budget_bytes;
      j["tensor_parallel_size"] = tp;
      j["context_parallel_size"] = cp;
      j["kv_window"] = r.kv_window;
      j["prefill_chunk"] = r.prefill_chunk;
      j["max_context"] = r.max_context;
      std::printf("%s\n", j.dump().c_str());
    }
    return absl::OkStatus();
  }

  const worker::KvPlanRow& first = rows->front();
  std::printf("model: %s (%s, %lld layers, %lld KV heads x head_dim %lld)\n", path.string().c_str(),
              config.model_type.c_str(), static_cast<long long>(config.num_hidden_layers),
              static_cast<long long>(config.num_key_value_heads),
              static_cast<long long>(config.head_dim));
  if (tp > 1) {
    std::printf("tensor parallel: %lld cards; per card %lld of %lld q heads, %lld KV heads, "
                "%lld of %lld vocabulary rows; figures below are one card's, tokens the "
                "group's\n",
                static_cast<long long>(tp), static_cast<long long>(shard.num_attention_heads),
                static_cast<long long>(config.num_attention_heads),
                static_cast<long long>(shard.num_key_value_heads),
                static_cast<long long>(shard.vocab_size),
                static_cast<long long>(config.vocab_size));
  }
  if (cp > 1) {
    std::printf("context parallel: %lld groups of cards split each sequence's blocks; blocks, "
                "tokens and sequences below are the %lld cards' together\n",
                static_cast<long long>(cp), static_cast<long long>(cp * tp));
  }
  std::printf("memory     %lld B (%s)\n", static_cast<long long>(memory), GiB(memory).c_str());
  std::printf("weights    %lld B (%s) = %lld parameters as %s (%.3f B each)\n",
              static_cast<long long>(first.weight_bytes), GiB(first.weight_bytes).c_str(),
              static_cast<long long>(first.weight_params), weights->dtype.c_str(),
              static_cast<double>(weights->bytes) / static_cast<double>(weights->params));
  std::printf("KV budget  %lld B (%s)\n", static_cast<long long>(first.kv_budget_bytes),
              GiB(first.kv_budget_bytes).c_str());
  std::printf("context %lld tokens = %lld blocks of %lld per sequence%s\n\n",
              static_cast<long long>(context), static_cast<long long>(first.blocks_per_sequence),
              static_cast<long long>(block_size),
              context > config.max_position_embeddings ? " (beyond max_position_embeddings)" : "");
  if (first.kv_window > 0) {
    std::printf("sliding window %lld on every layer: a sequence holds at most %lld blocks (the\n"
                "window and a step of %lld tokens); the context is not bounded by the KV cache\n\n",
                static_cast<long long>(first.kv_window),
                static_cast<long long>(first.blocks_per_sequence),
                static_cast<long long>(prefill_chunk));
  } else if (config.sliding_window > 0) {
    std::printf("sliding window %lld on some layers only: nothing is freed (one block id\n"
                "indexes every layer), planned as full attention\n\n",
                static_cast<long long>(config.sliding_window));
  }
  std::printf("%-12s %14s %10s %12s %14s\n", "kv dtype", "bytes/token", "blocks", "max tokens",
              "max sequences");
  for (const worker::KvPlanRow& r : *rows) {
    std::printf("%-12s %14lld %10lld %12lld %14lld\n", r.dtype.c_str(),
                static_cast<long long>(r.bytes_per_token), static_cast<long long>(r.blocks),
                static_cast<long long>(r.max_tokens), static_cast<long long>(r.max_sequences));
  }
  std::printf(
      "\nint8k-int4v: int8 keys, int4 values (--k-cache-dtype int8 --v-cache-dtype int4)\n");
  return absl::OkStatus();
}

}  // namespace

int PlanCommand(Args& args) { return RunSubcommand(args, "plan", kHelp, &Plan); }

}  // namespace kvgrid::cli
