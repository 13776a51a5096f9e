#include "worker/kv/kv_planner.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/quant_linear.h"

namespace kvgrid::worker {
namespace {

using kernels::KvDType;

std::string GiB(int64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / static_cast<double>(1ll << 30));
}

}  // namespace

const std::vector<KvDTypePair>& PlannedKvDTypes() {
  static const std::vector<KvDTypePair> kPairs = {
      {"fp32", KvDType::kF32, KvDType::kF32},   {"fp16", KvDType::kF16, KvDType::kF16},
      {"bf16", KvDType::kBF16, KvDType::kBF16}, {"int8", KvDType::kInt8, KvDType::kInt8},
      {"int4", KvDType::kInt4, KvDType::kInt4}, {"int8k-int4v", KvDType::kInt8, KvDType::kInt4},
      {"fp8_e4m3", KvDType::kFp8E4m3, KvDType::kFp8E4m3},
  };
  return kPairs;
}

int64_t CountParameters(const model::ModelConfig& c) {
  const int64_t hidden = c.hidden_size;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  const int64_t inter = c.intermediate_size;

  int64_t layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden;  // q, k, v, o
  if (c.attention_bias) {
    layer += q_dim + 2 * kv_dim;
    // transformers' Llama/Mistral attention puts attention_bias on o_proj as well.
    if (c.model_type != "qwen2") layer += hidden;
  }
  layer += 3 * hidden * inter;  // gate, up, down
  if (c.mlp_bias) layer += 2 * inter + hidden;
  layer += 2 * hidden;  // input and post-attention RMSNorm
  if (c.qk_norm) layer += 2 * c.head_dim;  // Qwen3's q and k norms, shared by the heads

  int64_t total = c.num_hidden_layers * layer + hidden;  // + final norm
  total += c.vocab_size * hidden;                        // embeddings
  if (!c.tie_word_embeddings) total += c.vocab_size * hidden;
  return total;
}

int64_t KvBytesPerToken(const model::ModelConfig& c, KvDType k, KvDType v) {
  return c.num_hidden_layers * c.num_key_value_heads *
         (kernels::KvRowLayoutFor(k, c.head_dim).total() +
          kernels::KvRowLayoutFor(v, c.head_dim).total());
}

namespace {

// Bytes per parameter of an unquantized dtype name; 0 when it is not one.
int64_t PlainBytes(std::string_view name) {
  if (name == "fp32" || name == "float32") return 4;
  if (name == "fp16" || name == "float16" || name == "bf16" || name == "bfloat16") return 2;
  return 0;
}

}  // namespace

absl::StatusOr<WeightFootprint> PlanWeights(const model::ModelConfig& c,
                                            std::string_view weight_dtype) {
  WeightFootprint f;
  f.params = CountParameters(c);
  const int64_t base = c.torch_dtype.empty() ? 4 : PlainBytes(c.torch_dtype);
  const model::QuantizationConfig& q = c.quantization;
  if (weight_dtype == "auto" && !q.quantized()) {
    if (base == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the config's torch_dtype \"", c.torch_dtype,
          "\" has no known size (give the weight dtype explicitly: fp32, fp16, bf16)"));
    }
    f.dtype = c.torch_dtype.empty() ? "fp32" : c.torch_dtype;
    f.bytes = f.params * base;
    return f;
  }
  if (const int64_t plain = PlainBytes(weight_dtype); plain > 0) {
    f.dtype = std::string(weight_dtype);
    f.bytes = f.params * plain;
    return f;
  }
  const int64_t rest_bytes = base > 0 ? base : 4;
  kernels::cpu::WeightDType blocks;
  if (weight_dtype == "auto") {
    f.dtype = q.method == model::QuantMethod::kAwq ? "awq" : "gptq";
    blocks = kernels::cpu::WeightDType::kQ4_Z;
  } else {
    absl::StatusOr<kernels::cpu::WeightDType> parsed = kernels::cpu::ParseWeightDType(weight_dtype);
    if (!parsed.ok() || *parsed == kernels::cpu::WeightDType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown weight dtype '", std::string(weight_dtype),
          "' (accepted: auto, fp32, fp16, bf16, q8_0, q4_0, q4_1)"));
    }
    f.dtype = std::string(weight_dtype);
    blocks = *parsed;
  }
  const int64_t block_bytes = kernels::cpu::QuantMatrix::BlockBytes(blocks);
  // A [rows, cols] linear weight: blocks when its input width allows, else unquantized.
  const auto linear = [&](int64_t rows, int64_t cols) -> int64_t {
    bool fits = cols % kernels::cpu::kQuantBlock == 0;
    if (q.method == model::QuantMethod::kAwq && weight_dtype == "auto") {
      fits = fits && cols % q.group_size == 0;  // else the checkpoint left it unconverted
    }
    return fits ? rows * cols / kernels::cpu::kQuantBlock * block_bytes : rows * cols * rest_bytes;
  };
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
  const int64_t q_dim = c.num_attention_heads * c.head_dim;
  const int64_t kv_dim = c.num_key_value_heads * c.head_dim;
  const int64_t linear_params =
      c.num_hidden_layers * (hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter);
  const int64_t linear_bytes =
      c.num_hidden_layers * (linear(q_dim + 2 * kv_dim, hidden) + linear(hidden, q_dim) +
                             linear(2 * inter, hidden) + linear(hidden, inter));
  f.bytes = (f.params - linear_params) * rest_bytes + linear_bytes;
  if (weight_dtype != "auto" && hidden % kernels::cpu::kQuantBlock == 0) {
    // The head in Q8_0: in place of lm_head, or a copy beside the tied embedding.
    const int64_t head_q8 = c.vocab_size * hidden / kernels::cpu::kQuantBlock *
                            kernels::cpu::QuantMatrix::BlockBytes(kernels::cpu::WeightDType::kQ8_0);
    f.bytes += head_q8 - (c.tie_word_embeddings ? 0 : c.vocab_size * hidden * rest_bytes);
  }
  return f;
}

int64_t SequenceBlocks(int64_t context, int64_t block_size, int64_t kv_window,
                       int64_t prefill_chunk) {
  auto blocks_for = [block_size](int64_t tokens) { return (tokens + block_size - 1) / block_size; };
  const int64_t all = blocks_for(context);
  if (kv_window <= 0) return all;
  return std::min(all, blocks_for(kv_window - 1 + std::min(prefill_chunk, context)) + 1);
}

absl::StatusOr<std::vector<KvPlanRow>> PlanKvCapacity(const model::ModelConfig& config,
                                                      int64_t memory_bytes, int64_t context,
                                                      int64_t block_size,
                                                      const WeightFootprint& weights,
                                                      int64_t prefill_chunk) {
  if (memory_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("memory must be positive, got ", memory_bytes));
  }
  if (context <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("context must be positive, got ", context));
  }
  if (block_size != 8 && block_size != 16 && block_size != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("block size must be 8, 16 or 32, got ", block_size));
  }
  if (prefill_chunk <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill chunk must be positive, got ", prefill_chunk));
  }
  if (weights.bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight bytes must be positive, got ", weights.bytes));
  }
  const int64_t params = weights.params;
  const int64_t weight_bytes = weights.bytes;
  if (weight_bytes >= memory_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the weights alone need ", weight_bytes, " bytes (", GiB(weight_bytes), ": ",
                     params, " parameters as ", weights.dtype,
                     "), which leaves no room for the KV cache in ", memory_bytes, " bytes (",
                     GiB(memory_bytes), ")"));
  }
  const int64_t kv_budget = memory_bytes - weight_bytes;
  const int64_t kv_window = config.KvWindow();
  const int64_t blocks_per_sequence =
      SequenceBlocks(context, block_size, kv_window, prefill_chunk);
  // The most blocks a windowed sequence of any length holds.
  const int64_t window_blocks =
      SequenceBlocks(std::numeric_limits<int32_t>::max(), block_size, kv_window, prefill_chunk);

  std::vector<KvPlanRow> rows;
  for (const KvDTypePair& pair : PlannedKvDTypes()) {
    KvPlanRow row;
    row.dtype = std::string(pair.name);
    row.k_dtype = pair.k;
    row.v_dtype = pair.v;
    row.bytes_per_token = KvBytesPerToken(config, pair.k, pair.v);
    row.bytes_per_block = row.bytes_per_token * block_size;
    row.block_size = block_size;
    row.memory_bytes = memory_bytes;
    row.weight_dtype = weights.dtype;
    row.weight_params = params;
    row.weight_bytes = weight_bytes;
    row.kv_budget_bytes = kv_budget;
    row.blocks = kv_budget / row.bytes_per_block;
    row.max_tokens = row.blocks * block_size;
    row.context = context;
    row.blocks_per_sequence = blocks_per_sequence;
    row.max_sequences = row.blocks / blocks_per_sequence;
    row.kv_window = kv_window;
    row.prefill_chunk = prefill_chunk;
    row.max_positions = config.max_position_embeddings;
    if (kv_window > 0) {
      row.max_context = row.blocks >= window_blocks ? config.max_position_embeddings : 0;
    } else {
      row.max_context = row.max_tokens;
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

void ApplyContextParallel(int64_t cp_size, std::vector<KvPlanRow>* rows) {
  if (cp_size <= 1) return;
  for (KvPlanRow& r : *rows) {
    const int64_t per_card = r.blocks;
    const int64_t per_card_per_sequence = (r.blocks_per_sequence + cp_size - 1) / cp_size;
    r.blocks = per_card * cp_size;
    r.max_tokens = r.blocks * r.block_size;
    r.max_sequences = per_card_per_sequence > 0 ? per_card / per_card_per_sequence : 0;
    if (r.kv_window == 0) {
      r.max_context = r.max_tokens;
    } else {
      const int64_t window_blocks = SequenceBlocks(std::numeric_limits<int32_t>::max(),
                                                   r.block_size, r.kv_window, r.prefill_chunk);
      r.max_context = per_card >= (window_blocks + cp_size - 1) / cp_size ? r.max_positions : 0;
    }
  }
}

int64_t StepWorkspaceBytes(const model::ModelConfig& config, int64_t max_tokens,
                           int64_t max_logit_rows) {
  const int64_t q = config.num_attention_heads * config.head_dim;
  const int64_t kv = config.num_key_value_heads * config.head_dim;
  // Floats per token: x, h, fused qkv, q/k/v, attention output, gate_up, act, a 16-bit cast
  // copy of the widest input (counted as fp32).
  const int64_t per_token = 2 * config.hidden_size + 2 * (q + 2 * kv) + q +
                            3 * config.intermediate_size +
                            std::max(config.hidden_size, config.intermediate_size);
  constexpr int64_t kFixed = 256ll << 20;
  return 4 * (max_tokens * per_token + max_logit_rows * (config.hidden_size + config.vocab_size)) +
         kFixed;
}

absl::StatusOr<int64_t> GpuKvBudget(int64_t total_bytes, int64_t free_bytes, double utilization,
                                    int64_t workspace_bytes) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu-memory-utilization: must be in (0, 1], got ", utilization));
  }
  const int64_t allowed = static_cast<int64_t>(utilization * static_cast<double>(total_bytes));
  const int64_t in_use = total_bytes - free_bytes;
  const int64_t budget = allowed - in_use - workspace_bytes;
  if (budget <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu-memory-utilization ", utilization, ": ", allowed, " of the card's ", total_bytes,
        " bytes leave nothing for the KV cache after ", in_use, " bytes in use (weights, "
        "context) and a ", workspace_bytes, "-byte step workspace"));
  }
  return budget;
}

}  // namespace kvgrid::worker
