#include "worker/kv/kv_planner.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

absl::StatusOr<int64_t> WeightBytesPerParam(std::string_view weight_dtype,
                                            const model::ModelConfig& config) {
  const bool from_config = weight_dtype == "auto";
  const std::string name = from_config ? config.torch_dtype : std::string(weight_dtype);
  if (from_config && name.empty()) return 4;  // no torch_dtype: transformers loads fp32
  if (name == "fp32" || name == "float32") return 4;
  if (name == "fp16" || name == "float16" || name == "bf16" || name == "bfloat16") return 2;
  if (from_config) {
    return absl::InvalidArgumentError(
        absl::StrCat("the config's torch_dtype \"", name,
                     "\" has no known size (give the weight dtype explicitly: fp32, fp16, bf16)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight dtype '", name, "' (accepted: auto, fp32, fp16, bf16)"));
}

absl::StatusOr<std::vector<KvPlanRow>> PlanKvCapacity(const model::ModelConfig& config,
                                                      int64_t memory_bytes, int64_t context,
                                                      int64_t block_size,
                                                      int64_t weight_bytes_per_param) {
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
  // Real weight types are at most 8 bytes; the bound keeps the product far from overflow.
  if (weight_bytes_per_param <= 0 || weight_bytes_per_param > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes per weight parameter must be in [1, 16], got ", weight_bytes_per_param));
  }
  const int64_t params = CountParameters(config);
  const int64_t weight_bytes = params * weight_bytes_per_param;
  if (weight_bytes >= memory_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the weights alone need ", weight_bytes, " bytes (", GiB(weight_bytes), ": ",
                     params, " parameters x ", weight_bytes_per_param,
                     " bytes), which leaves no room for the KV cache in ", memory_bytes, " bytes (",
                     GiB(memory_bytes), ")"));
  }
  const int64_t kv_budget = memory_bytes - weight_bytes;
  const int64_t blocks_per_sequence = context / block_size + (context % block_size != 0 ? 1 : 0);

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
    row.weight_params = params;
    row.weight_bytes = weight_bytes;
    row.kv_budget_bytes = kv_budget;
    row.blocks = kv_budget / row.bytes_per_block;
    row.max_tokens = row.blocks * block_size;
    row.context = context;
    row.blocks_per_sequence = blocks_per_sequence;
    row.max_sequences = row.blocks / blocks_per_sequence;
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace kvgrid::worker
