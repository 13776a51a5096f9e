#include "worker/executor/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/huge_pages.h"
#include "kernels/cpu/interleaved_linear.h"
#include "kernels/cpu/kv_write.h"
#include "kernels/cpu/packed_int4.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/gguf_config.h"
#include "model/safetensors.h"
#include "model/status_macros.h"

namespace kvgrid::worker {
namespace cpu = kernels::cpu;

namespace {

absl::Status CheckSize(const std::vector<float>& t, int64_t expected, const std::string& what) {
  if (static_cast<int64_t>(t.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", what, " has ", t.size(),
                                                   " elements, the config implies ", expected));
  }
  return absl::OkStatus();
}

absl::Status CheckWeights(const model::ModelConfig& c, const LlamaWeights& w,
                          const TensorParallel& tp) {
  const ShardDims d = ShardDimsOf(c, tp);
  if (!w.embed_q.empty()) {
    if (w.embed_q.rows != d.vocab_local || w.embed_q.cols != d.hidden || !w.embed.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight embed_tokens is [", w.embed_q.rows, ", ", w.embed_q.cols, "] in blocks",
          w.embed.empty() ? "" : " and in fp32", ", the config implies [", d.vocab_local, ", ",
          d.hidden, "]"));
    }
  } else {
    KVGRID_RETURN_IF_ERROR(CheckSize(w.embed, d.vocab_local * d.hidden, "embed_tokens"));
  }
  KVGRID_RETURN_IF_ERROR(CheckSize(w.final_norm, d.hidden, "norm"));
  if ((!c.tie_word_embeddings || !w.lm_head.empty()) && w.lm_head_q.empty()) {
    KVGRID_RETURN_IF_ERROR(CheckSize(w.lm_head, d.vocab_local * d.hidden, "lm_head"));
  }
  if (static_cast<int64_t>(w.layers.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("weights have ", w.layers.size(),
                                                   " layers, the config ", c.num_hidden_layers));
  }
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat("layers.", i, ".");
    KVGRID_RETURN_IF_ERROR(CheckSize(l.input_norm, d.hidden, p + "input_layernorm"));
    auto check = [&](const std::vector<float>& w, const cpu::QuantMatrix& q, int64_t rows,
                     int64_t cols, const std::string& what,
                     const std::vector<cpu::QuantMatrix>& parts = {}) -> absl::Status {
      if (!parts.empty()) {
        int64_t stacked = 0;
        for (const cpu::QuantMatrix& part : parts) {
          if (part.cols != cols || part.empty()) {
            return absl::InvalidArgumentError(absl::StrCat("weight ", what, " has a part of [",
                                                           part.rows, ", ", part.cols,
                                                           "], the config implies ", cols,
                                                           " columns"));
          }
          stacked += part.rows;
        }
        if (stacked != rows || !q.empty() || !w.empty()) {
          return absl::InvalidArgumentError(absl::StrCat("weight ", what, " has parts of ",
                                                         stacked, " rows (and no other form), "
                                                         "the config implies ", rows));
        }
        return absl::OkStatus();
      }
      if (q.empty()) return CheckSize(w, rows * cols, what);
      if (q.rows != rows || q.cols != cols) {
        return absl::InvalidArgumentError(absl::StrCat("weight ", what, " is [", q.rows, ", ",
                                                       q.cols, "], the config implies [", rows,
                                                       ", ", cols, "]"));
      }
      return absl::OkStatus();
    };
    KVGRID_RETURN_IF_ERROR(check(l.qkv, l.qkv_q, d.qkv_dim, d.hidden, p + "qkv", l.qkv_parts));
    if (!l.qkv_bias.empty()) KVGRID_RETURN_IF_ERROR(CheckSize(l.qkv_bias, d.qkv_dim, p + "qkv_bias"));
    if (c.qk_norm) {
      KVGRID_RETURN_IF_ERROR(CheckSize(l.q_norm, d.head_dim, p + "self_attn.q_norm"));
      KVGRID_RETURN_IF_ERROR(CheckSize(l.k_norm, d.head_dim, p + "self_attn.k_norm"));
    } else if (!l.q_norm.empty() || !l.k_norm.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("weights ", p, "self_attn.q_norm/k_norm given for a model without them"));
    }
    if (!l.o_bias.empty()) KVGRID_RETURN_IF_ERROR(CheckSize(l.o_bias, d.hidden, p + "o_proj.bias"));
    KVGRID_RETURN_IF_ERROR(check(l.o, l.o_q, d.hidden, d.q_dim, p + "o_proj"));
    KVGRID_RETURN_IF_ERROR(CheckSize(l.post_norm, d.hidden, p + "post_attention_layernorm"));
    KVGRID_RETURN_IF_ERROR(check(l.gate_up, l.gate_up_q, 2 * d.inter, d.hidden, p + "gate_up",
                                 l.gate_up_parts));
    KVGRID_RETURN_IF_ERROR(check(l.down, l.down_q, d.hidden, d.inter, p + "down_proj"));
  }
  return absl::OkStatus();
}

// Reads rows [begin, end) of tensor `name` (full shape `shape`) and appends them to `dst`.
absl::Status AppendRows(const model::Checkpoint& ckpt, const std::string& name,
                        std::vector<int64_t> shape, int64_t begin, int64_t end,
                        std::vector<float>* dst, std::vector<float>* scratch) {
  KVGRID_RETURN_IF_ERROR(ckpt.ReadF32Slice(name, shape, {.dim = 0, .begin = begin, .end = end},
                                           scratch));
  dst->insert(dst->end(), scratch->begin(), scratch->end());
  return absl::OkStatus();
}

// Rows [begin, end) of a row-major matrix with `cols` columns (or of a vector: cols = 1).
std::vector<float> Rows(const std::vector<float>& m, int64_t cols, int64_t begin, int64_t end) {
  return std::vector<float>(m.begin() + begin * cols, m.begin() + end * cols);
}

// Columns [begin, end) of a row-major [rows, cols] matrix.
std::vector<float> Cols(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t begin,
                        int64_t end) {
  std::vector<float> out;
  out.reserve(rows * (end - begin));
  for (int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), m.begin() + r * cols + begin, m.begin() + r * cols + end);
  }
  return out;
}

// Stacks matrices by rows: all quantized alike (same blocks, same input order) become one
// quantized matrix; all quantized but not alike stay as they are, as parts (`quant_parts`);
// else everything becomes fp32.
absl::Status Stack(std::vector<std::pair<std::vector<float>, cpu::QuantMatrix>> parts,
                   int64_t cols, std::vector<float>* fp32, cpu::QuantMatrix* quant,
                   std::vector<cpu::QuantMatrix>* quant_parts) {
  const bool quantized = std::all_of(parts.begin(), parts.end(),
                                     [&](const auto& p) { return !p.second.empty(); });
  const bool alike = std::all_of(parts.begin(), parts.end(), [&](const auto& p) {
    return p.second.dtype == parts.front().second.dtype &&
           p.second.input_perm == parts.front().second.input_perm;
  });
  if (quantized && !alike) {
    for (auto& [f, q] : parts) quant_parts->push_back(std::move(q));
    return absl::OkStatus();
  }
  if (quantized) {
    quant->dtype = parts.front().second.dtype;
    quant->cols = cols;
    quant->input_perm = parts.front().second.input_perm;
    for (auto& [f, q] : parts) {
      quant->rows += q.rows;
      quant->data.insert(quant->data.end(), q.data.begin(), q.data.end());
    }
    return absl::OkStatus();
  }
  for (auto& [f, q] : parts) {
    if (!q.empty()) f = cpu::DequantizeMatrix(q);
    fp32->insert(fp32->end(), f.begin(), f.end());
  }
  return absl::OkStatus();
}

// A tensor of int32 (a 4-bit checkpoint's packed values), copied out of the mapping (whose
// offsets need not be 4-byte aligned). Errors: NOT_FOUND; INVALID_ARGUMENT for another dtype
// or shape.
absl::Status ReadI32(const model::Checkpoint& c, const std::string& name,
                     const std::vector<int64_t>& shape, std::vector<int32_t>* out) {
  KVGRID_ASSIGN_OR_RETURN(const model::TensorView* t, c.Find(name));
  if (t->dtype != model::DType::kI32 || t->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        t->file.string(), ": ", name, ": expected I32 [", absl::StrJoin(shape, ", "),
        "], got ", std::string(model::DTypeName(t->dtype)), " [", absl::StrJoin(t->shape, ", "), "]"));
  }
  out->resize(static_cast<size_t>(t->NumElements()));
  std::memcpy(out->data(), t->data.data(), out->size() * sizeof(int32_t));
  return absl::OkStatus();
}

// Linear layer `module` ([rows, cols]) of a 4-bit AWQ/GPTQ checkpoint: Q4_1 blocks when its
// groups are whole blocks of 32 inputs, else exactly dequantized fp32; fp32 too for a layer the
// checkpoint kept unquantized (modules_to_not_convert).
absl::Status ReadPacked4Bit(const model::Checkpoint& c, const model::QuantizationConfig& qc,
                            const std::string& module, int64_t rows, int64_t cols,
                            std::vector<float>* fp32, cpu::QuantMatrix* quant) {
  if (!c.Contains(module + ".qweight")) {
    return c.ReadF32(module + ".weight", std::vector<int64_t>{rows, cols}, fp32);
  }
  const bool awq = qc.method == model::QuantMethod::kAwq;
  cpu::PackedInt4Params p{.layout = awq ? cpu::PackedInt4Layout::kAwq : cpu::PackedInt4Layout::kGptq,
                          .name = module, .in_features = cols, .out_features = rows,
                          .group_size = qc.group_size, .zeros_minus_one = qc.zeros_minus_one};
  if (rows % 8 != 0 || cols % 8 != 0) return p.Validate();  // names the layer and its shape
  const int64_t groups = p.groups();
  std::vector<int32_t> qweight, qzeros, g_idx;
  std::vector<float> scales;
  const auto group_hint = [&](absl::Status s) {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), " (quantization_config.group_size ",
                                               qc.group_size, ")"));
  };
  KVGRID_RETURN_IF_ERROR(ReadI32(c, module + ".qweight",
                                 awq ? std::vector<int64_t>{cols, rows / 8}
                                     : std::vector<int64_t>{cols / 8, rows},
                                 &qweight));
  KVGRID_RETURN_IF_ERROR(group_hint(
      ReadI32(c, module + ".qzeros", std::vector<int64_t>{groups, rows / 8}, &qzeros)));
  KVGRID_RETURN_IF_ERROR(group_hint(
      c.ReadF32(module + ".scales", std::vector<int64_t>{groups, rows}, &scales)));
  if (!awq && c.Contains(module + ".g_idx")) {
    KVGRID_RETURN_IF_ERROR(ReadI32(c, module + ".g_idx", std::vector<int64_t>{cols}, &g_idx));
  }
  p.qweight = qweight;
  p.qzeros = qzeros;
  p.scales = scales;
  p.g_idx = g_idx;
  KVGRID_RETURN_IF_ERROR(p.Validate());
  if (p.FitsBlocks()) {
    KVGRID_ASSIGN_OR_RETURN(*quant, cpu::QuantMatrixFromPackedInt4(p));
  } else {
    KVGRID_ASSIGN_OR_RETURN(*fp32, cpu::DequantizePackedInt4(p));
  }
  return absl::OkStatus();
}

}  // namespace

ForwardBatch DecodeBatch(const BlockManager& blocks, std::span<const SequenceId> seqs,
                         int64_t position, std::span<const int32_t> tokens) {
  return DecodeBatch(blocks, seqs, std::vector<int64_t>(seqs.size(), position), tokens);
}

ForwardBatch DecodeBatch(const BlockManager& blocks, std::span<const SequenceId> seqs,
                         std::span<const int64_t> positions, std::span<const int32_t> tokens) {
  ForwardBatch b;
  b.query_start.push_back(0);
  for (SequenceId seq : seqs) {
    b.max_blocks_per_seq =
        std::max(b.max_blocks_per_seq, static_cast<int64_t>(blocks.BlockTable(seq).size()));
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    b.token_ids.push_back(tokens[i]);
    b.positions.push_back(static_cast<int32_t>(positions[i]));
    b.slots.push_back(blocks.Slot(seqs[i], positions[i]));
    b.query_start.push_back(static_cast<int32_t>(i + 1));
    b.seq_lens.push_back(static_cast<int32_t>(positions[i] + 1));
    b.logit_rows.push_back(static_cast<int32_t>(i));
    std::vector<int32_t> table = blocks.BlockTable(seqs[i]);
    table.resize(static_cast<size_t>(b.max_blocks_per_seq), 0);
    b.block_tables.insert(b.block_tables.end(), table.begin(), table.end());
  }
  return b;
}

absl::Status ForwardBatch::ValidateSizes() const {
  const int64_t n = static_cast<int64_t>(token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(seq_lens.size());
  if (static_cast<int64_t>(positions.size()) != n || static_cast<int64_t>(slots.size()) != n ||
      static_cast<int64_t>(query_start.size()) != num_seqs + 1 ||
      static_cast<int64_t>(block_tables.size()) != num_seqs * max_blocks_per_seq) {
    return absl::InvalidArgumentError("ForwardBatch: inconsistent sizes");
  }
  for (int32_t row : logit_rows) {
    if (row < 0 || row >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardBatch: logit row ", row, " outside [0, ", n, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status LocalizeContextParallelBatch(const ForwardBatch& b,
                                          const ContextParallelLayout& layout,
                                          int32_t block_size, int32_t rank,
                                          std::vector<int64_t>* slots,
                                          std::vector<int32_t>* tables) {
  KVGRID_RETURN_IF_ERROR(b.ValidateSizes());
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(b.seq_lens.size());
  const int64_t group_blocks = int64_t{layout.cp_size} * layout.blocks_per_rank;
  const int64_t group_slots = group_blocks * block_size;
  slots->resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t slot = b.slots[t];
    if (slot < -1 || slot >= group_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardBatch.slots[", t, "] = ", slot,
                       " is outside the context-parallel group's ", group_slots, " slots"));
    }
    const int32_t holder = layout.RankOfPosition(b.positions[t] / block_size);
    if (slot >= 0 && layout.RankOfBlock(static_cast<int32_t>(slot / block_size)) != holder) {
      return absl::InvalidArgumentError(
          absl::StrCat("ForwardBatch.slots[", t, "] = ", slot, " is not on context-parallel rank ",
                       holder, ", which holds position ", b.positions[t]));
    }
    (*slots)[t] = layout.LocalSlot(slot, block_size, rank);
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t used = std::min<int64_t>(b.max_blocks_per_seq,
                                           (int64_t{b.seq_lens[s]} + block_size - 1) / block_size);
    for (int64_t i = 0; i < used; ++i) {
      const int32_t block = b.block_tables[s * b.max_blocks_per_seq + i];
      if (block == BlockManager::kHole) continue;
      if (block < 0 || block >= group_blocks ||
          layout.RankOfBlock(block) != layout.RankOfPosition(i)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ForwardBatch.block_tables[", s, "][", i, "] = ", block,
            " is not a block of context-parallel rank ", layout.RankOfPosition(i), " of ",
            layout.cp_size, " (", layout.blocks_per_rank, " blocks each)"));
      }
    }
  }
  layout.LocalTable(b.block_tables, rank, tables);
  return absl::OkStatus();
}

ShardDims ShardDimsOf(const model::ModelConfig& c, const TensorParallel& tp) {
  ShardDims d;
  const int64_t t = tp.size, r = tp.rank;
  d.hidden = c.hidden_size;
  d.heads = c.num_attention_heads / t;
  // KV heads split evenly, or (more ranks than KV heads) each rank holds the one its q heads
  // read.
  d.kv_heads = c.num_key_value_heads >= t ? c.num_key_value_heads / t : 1;
  d.head_dim = c.head_dim;
  d.inter = c.intermediate_size / t;
  d.vocab = c.vocab_size;
  d.q_dim = d.heads * d.head_dim;
  d.kv_dim = d.kv_heads * d.head_dim;
  d.qkv_dim = d.q_dim + 2 * d.kv_dim;
  d.head_begin = r * d.heads;
  d.kv_head_begin = c.num_key_value_heads >= t ? r * d.kv_heads : r * c.num_key_value_heads / t;
  d.inter_begin = r * d.inter;
  d.vocab_local = c.vocab_size % t == 0 ? c.vocab_size / t : c.vocab_size;
  d.vocab_begin = c.vocab_size % t == 0 ? r * d.vocab_local : 0;
  return d;
}

absl::Status TensorParallel::ValidateSplit(const model::ModelConfig& c) const {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor parallel: rank ", rank, " is not a rank of a group of ", size));
  }
  if (c.num_attention_heads % size != 0 || c.intermediate_size % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor parallel size ", size, ": must divide num_attention_heads (",
        c.num_attention_heads, ") and intermediate_size (", c.intermediate_size, ")"));
  }
  const int64_t kv = c.num_key_value_heads;
  if ((kv >= size && kv % size != 0) || (kv < size && size % kv != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallel size ", size,
                                                   ": must divide num_key_value_heads (", kv,
                                                   ") or be a multiple of it"));
  }
  return absl::OkStatus();
}

absl::Status TensorParallel::Validate(const model::ModelConfig& c) const {
  KVGRID_RETURN_IF_ERROR(ValidateSplit(c));
  if (size > 1 && comm == nullptr) {
    return absl::InvalidArgumentError("tensor parallel: a group needs a communicator");
  }
  return absl::OkStatus();
}

absl::Status ContextParallel::Validate() const {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("context parallel: rank ", rank, " of a group of ", size));
  }
  if (size > 1 && comm == nullptr) {
    return absl::InvalidArgumentError("context parallel: a group needs a communicator");
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::SetContextParallel(ContextParallel cp) {
  KVGRID_RETURN_IF_ERROR(cp.Validate());
  cp_ = cp;
  return absl::OkStatus();
}

ForwardBatch SingleSequenceBatch(const BlockManager& blocks, SequenceId seq, int64_t begin,
                                 std::span<const int32_t> tokens) {
  ForwardBatch b;
  const int64_t n = static_cast<int64_t>(tokens.size());
  b.token_ids.assign(tokens.begin(), tokens.end());
  for (int64_t pos = begin; pos < begin + n; ++pos) {
    b.positions.push_back(static_cast<int32_t>(pos));
    b.slots.push_back(blocks.Slot(seq, pos));
  }
  b.query_start = {0, static_cast<int32_t>(n)};
  b.seq_lens = {static_cast<int32_t>(begin + n)};
  b.block_tables = blocks.BlockTable(seq);
  b.max_blocks_per_seq = static_cast<int64_t>(b.block_tables.size());
  b.logit_rows = {static_cast<int32_t>(n) - 1};
  return b;
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::filesystem::path& dir,
                                                             TensorParallel tp,
                                                             const LoadProgressFn& progress) {
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  KVGRID_RETURN_IF_ERROR(tp.Validate(*config));
  absl::StatusOr<std::unique_ptr<model::Checkpoint>> ckpt = model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  const model::Checkpoint& c = **ckpt;
  const ShardDims full = ShardDimsOf(*config);
  const ShardDims d = ShardDimsOf(*config, tp);
  const int64_t hd = d.head_dim;
  std::optional<LoadTally> tally;
  if (progress) {
    std::vector<LoadTally::Tensor> tensors;
    for (const std::string& name : c.Names()) {
      absl::StatusOr<const model::TensorView*> t = c.Find(name);
      if (t.ok()) tensors.push_back({name, static_cast<int64_t>((*t)->data.size())});
    }
    tally.emplace(tensors, "model.layers.", config->num_hidden_layers);
  }

  LlamaWeights w;
  std::vector<float> scratch;
  const int64_t v0 = d.vocab_begin, v1 = d.vocab_begin + d.vocab_local;
  KVGRID_RETURN_IF_ERROR(c.ReadF32Slice("model.embed_tokens.weight", std::vector<int64_t>{d.vocab, d.hidden},
                                        {.dim = 0, .begin = v0, .end = v1}, &w.embed));
  KVGRID_RETURN_IF_ERROR(c.ReadF32("model.norm.weight", std::vector<int64_t>{d.hidden}, &w.final_norm));
  // Some tied checkpoints still store lm_head; use it when present.
  if (c.Contains("lm_head.weight")) {
    KVGRID_RETURN_IF_ERROR(c.ReadF32Slice("lm_head.weight", std::vector<int64_t>{d.vocab, d.hidden},
                                          {.dim = 0, .begin = v0, .end = v1}, &w.lm_head));
  } else if (!config->tie_word_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir.string(), ": lm_head.weight is missing and tie_word_embeddings is false"));
  }
  if (config->mlp_bias) {
    return absl::UnimplementedError(
        absl::StrCat((dir / "config.json").string(), ": mlp_bias: MLP biases are not supported"));
  }
  // This rank's rows of q/k/v (its heads) and of gate/up (its columns of the MLP), and the
  // matching input columns of o_proj and down_proj: only these bytes of the mapping are read.
  const int64_t q0 = d.head_begin * hd, q1 = q0 + d.q_dim;
  const int64_t kv0 = d.kv_head_begin * hd, kv1 = kv0 + d.kv_dim;
  const int64_t i0 = d.inter_begin, i1 = i0 + d.inter;
  // The config decides (Qwen2 always has q/k/v biases); a checkpoint that lacks them fails
  // below naming the tensor instead of silently computing something else.
  const bool bias = config->attention_bias;
  const model::QuantizationConfig& quant = config->quantization;
  if (quant.quantized() && tp.size != 1) {
    return absl::UnimplementedError(absl::StrCat(
        dir.string(), ": 4-bit AWQ/GPTQ checkpoints run on one worker (tensor parallel size 1)"));
  }
  if (tally) progress(tally->After(0));
  for (int64_t i = 0; i < config->num_hidden_layers; ++i) {
    LayerWeights l;
    const std::string p = absl::StrCat("model.layers.", i, ".");
    KVGRID_RETURN_IF_ERROR(c.ReadF32(p + "input_layernorm.weight", std::vector<int64_t>{d.hidden}, &l.input_norm));
    KVGRID_RETURN_IF_ERROR(c.ReadF32(p + "post_attention_layernorm.weight", std::vector<int64_t>{d.hidden}, &l.post_norm));
    if (config->qk_norm) {  // Qwen3: one [head_dim] weight for every head, on every rank
      KVGRID_RETURN_IF_ERROR(c.ReadF32(p + "self_attn.q_norm.weight", std::vector<int64_t>{hd}, &l.q_norm));
      KVGRID_RETURN_IF_ERROR(c.ReadF32(p + "self_attn.k_norm.weight", std::vector<int64_t>{hd}, &l.k_norm));
    }
    if (quant.quantized()) {
      // Whole layers (tp 1): q/k/v and gate/up stay in blocks when they agree, as in GGUF.
      std::vector<std::pair<std::vector<float>, cpu::QuantMatrix>> qkv(3), gate_up(2);
      const std::pair<const char*, int64_t> qkv_parts[] = {
          {"self_attn.q_proj", d.q_dim}, {"self_attn.k_proj", d.kv_dim}, {"self_attn.v_proj", d.kv_dim}};
      for (int part = 0; part < 3; ++part) {
        KVGRID_RETURN_IF_ERROR(ReadPacked4Bit(c, quant, p + qkv_parts[part].first, qkv_parts[part].second,
                                              d.hidden, &qkv[part].first, &qkv[part].second));
      }
      KVGRID_RETURN_IF_ERROR(Stack(std::move(qkv), d.hidden, &l.qkv, &l.qkv_q, &l.qkv_parts));
      KVGRID_RETURN_IF_ERROR(ReadPacked4Bit(c, quant, p + "mlp.gate_proj", d.inter, d.hidden,
                                            &gate_up[0].first, &gate_up[0].second));
      KVGRID_RETURN_IF_ERROR(ReadPacked4Bit(c, quant, p + "mlp.up_proj", d.inter, d.hidden,
                                            &gate_up[1].first, &gate_up[1].second));
      KVGRID_RETURN_IF_ERROR(Stack(std::move(gate_up), d.hidden, &l.gate_up, &l.gate_up_q,
                                   &l.gate_up_parts));
      KVGRID_RETURN_IF_ERROR(ReadPacked4Bit(c, quant, p + "self_attn.o_proj", d.hidden, d.q_dim, &l.o, &l.o_q));
      KVGRID_RETURN_IF_ERROR(ReadPacked4Bit(c, quant, p + "mlp.down_proj", d.hidden, d.inter, &l.down, &l.down_q));
    } else {
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.q_proj.weight", {full.q_dim, d.hidden}, q0, q1, &l.qkv, &scratch));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.k_proj.weight", {full.kv_dim, d.hidden}, kv0, kv1, &l.qkv, &scratch));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.v_proj.weight", {full.kv_dim, d.hidden}, kv0, kv1, &l.qkv, &scratch));
      KVGRID_RETURN_IF_ERROR(c.ReadF32Slice(p + "self_attn.o_proj.weight", std::vector<int64_t>{d.hidden, full.q_dim},
                                            {.dim = 1, .begin = q0, .end = q1}, &l.o));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "mlp.gate_proj.weight", {full.inter, d.hidden}, i0, i1, &l.gate_up, &scratch));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "mlp.up_proj.weight", {full.inter, d.hidden}, i0, i1, &l.gate_up, &scratch));
      KVGRID_RETURN_IF_ERROR(c.ReadF32Slice(p + "mlp.down_proj.weight", std::vector<int64_t>{d.hidden, full.inter},
                                            {.dim = 1, .begin = i0, .end = i1}, &l.down));
    }
    // Biases are plain tensors in every checkpoint format.
    if (bias) {
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.q_proj.bias", {full.q_dim}, q0, q1, &l.qkv_bias, &scratch));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.k_proj.bias", {full.kv_dim}, kv0, kv1, &l.qkv_bias, &scratch));
      KVGRID_RETURN_IF_ERROR(AppendRows(c, p + "self_attn.v_proj.bias", {full.kv_dim}, kv0, kv1, &l.qkv_bias, &scratch));
    }
    // Llama with attention_bias also biases o_proj; Qwen2 does not. Added once, by rank 0,
    // since the partial outputs are summed.
    if (c.Contains(p + "self_attn.o_proj.bias") && tp.rank == 0) {
      KVGRID_RETURN_IF_ERROR(c.ReadF32(p + "self_attn.o_proj.bias", std::vector<int64_t>{d.hidden}, &l.o_bias));
    }
    w.layers.push_back(std::move(l));
    if (tally) progress(tally->After(i + 1));
  }
  return FromWeights(*config, std::move(w), tp);
}

namespace {

// One GGUF tensor as fp32 (F32/F16/BF16, or dequantized blocks), checking its GGUF shape
// (ne[0] innermost).
absl::Status GgufF32(const model::GgufFile& f, const std::string& name,
                     std::vector<int64_t> ne, std::vector<float>* out) {
  KVGRID_ASSIGN_OR_RETURN(const model::GgufTensor* t, f.Find(name));
  if (t->ne != ne) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", name, "' has the wrong shape"));
  }
  return cpu::GgufTensorToF32(*t, out);
}

// GGML keeps llama's q/k rows of each head with the two RoPE halves interleaved; HF (and
// kvgrid) keep them as two halves: row r of a head comes from row 2r (first half) or
// 2(r - half) + 1 (second half).
int64_t UnpermutedRow(int64_t row, int64_t head_dim) {
  const int64_t h = row / head_dim, r = row % head_dim, half = head_dim / 2;
  return h * head_dim + (r < half ? 2 * r : 2 * (r - half) + 1);
}

// A linear weight [rows, cols] (GGUF ne {cols, rows}), rows reordered with `source_row` when
// given; quantized blocks and 16-bit floats are kept as they are, F32 is read as fp32.
absl::Status GgufLinear(const model::GgufFile& f, const std::string& name, int64_t rows,
                        int64_t cols, int64_t permute_head_dim, std::vector<float>* fp32,
                        cpu::QuantMatrix* quant) {
  KVGRID_ASSIGN_OR_RETURN(const model::GgufTensor* t, f.Find(name));
  if (t->ne != std::vector<int64_t>{cols, rows}) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", name, "' is not [", rows,
                                                   ", ", cols, "]"));
  }
  const auto src_row = [&](int64_t r) {
    return permute_head_dim > 0 ? UnpermutedRow(r, permute_head_dim) : r;
  };
  // Any block format (rows must be whole blocks), or F16/BF16: held as stored.
  if (cpu::HeldDTypeOfGgml(t->type)) {
    KVGRID_ASSIGN_OR_RETURN(cpu::QuantMatrix stored, cpu::QuantMatrixFromGguf(*t));
    if (permute_head_dim == 0) {
      *quant = std::move(stored);
      return absl::OkStatus();
    }
    *quant = stored;  // rows reordered below
    const int64_t rb = quant->RowBytes();
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(quant->data.data() + r * rb, stored.data.data() + src_row(r) * rb,
                  static_cast<size_t>(rb));
    }
    return absl::OkStatus();
  }
  std::vector<float> all;
  KVGRID_RETURN_IF_ERROR(GgufF32(f, name, {cols, rows}, &all));
  fp32->resize(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(fp32->data() + r * cols, all.data() + src_row(r) * cols, sizeof(float) * cols);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::LoadGguf(const std::filesystem::path& path,
                                                                 TensorParallel tp,
                                                                 const LoadProgressFn& progress) {
  if (tp.size != 1) {
    return absl::UnimplementedError("GGUF models run on one worker (tensor parallel size 1)");
  }
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<model::GgufFile> file, model::GgufFile::Open(path));
  const model::GgufFile& f = *file;
  KVGRID_ASSIGN_OR_RETURN(const model::ModelConfig c, model::ModelConfigFromGguf(f));
  const std::string& arch = c.model_type;
  KVGRID_RETURN_IF_ERROR(tp.Validate(c));
  std::optional<LoadTally> tally;
  if (progress) {
    std::vector<LoadTally::Tensor> tensors;
    for (const auto& [name, t] : f.tensors()) {
      tensors.push_back({name, static_cast<int64_t>(t.data.size())});
    }
    tally.emplace(tensors, "blk.", c.num_hidden_layers);
  }

  const ShardDims d = ShardDimsOf(c);
  const int64_t hd = d.head_dim;
  // GGML permutes llama's q/k for its interleaved RoPE; Qwen2 uses the halves as HF does.
  const int64_t permute = arch == "llama" ? hd : 0;
  LlamaWeights w;
  {
    // The embedding stays in its blocks (or 16-bit floats): only the rows looked up are ever
    // decoded.
    KVGRID_ASSIGN_OR_RETURN(const model::GgufTensor* t, f.Find("token_embd.weight"));
    if (cpu::HeldDTypeOfGgml(t->type)) {
      if (t->ne != std::vector<int64_t>{d.hidden, d.vocab}) {
        return absl::InvalidArgumentError("GGUF tensor 'token_embd.weight' has the wrong shape");
      }
      KVGRID_ASSIGN_OR_RETURN(w.embed_q, cpu::QuantMatrixFromGguf(*t));
    } else {
      KVGRID_RETURN_IF_ERROR(GgufF32(f, "token_embd.weight", {d.hidden, d.vocab}, &w.embed));
    }
  }
  KVGRID_RETURN_IF_ERROR(GgufF32(f, "output_norm.weight", {d.hidden}, &w.final_norm));
  if (!c.tie_word_embeddings) {
    KVGRID_RETURN_IF_ERROR(
        GgufLinear(f, "output.weight", d.vocab, d.hidden, 0, &w.lm_head, &w.lm_head_q));
  }
  if (tally) progress(tally->After(0));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string b = absl::StrCat("blk.", i, ".");
    LayerWeights l;
    KVGRID_RETURN_IF_ERROR(GgufF32(f, b + "attn_norm.weight", {d.hidden}, &l.input_norm));
    KVGRID_RETURN_IF_ERROR(GgufF32(f, b + "ffn_norm.weight", {d.hidden}, &l.post_norm));
    if (c.qk_norm) {
      KVGRID_RETURN_IF_ERROR(GgufF32(f, b + "attn_q_norm.weight", {hd}, &l.q_norm));
      KVGRID_RETURN_IF_ERROR(GgufF32(f, b + "attn_k_norm.weight", {hd}, &l.k_norm));
    }
    std::vector<std::pair<std::vector<float>, cpu::QuantMatrix>> qkv(3), gate_up(2);
    KVGRID_RETURN_IF_ERROR(GgufLinear(f, b + "attn_q.weight", d.q_dim, d.hidden, permute,
                                      &qkv[0].first, &qkv[0].second));
    KVGRID_RETURN_IF_ERROR(GgufLinear(f, b + "attn_k.weight", d.kv_dim, d.hidden, permute,
                                      &qkv[1].first, &qkv[1].second));
    KVGRID_RETURN_IF_ERROR(GgufLinear(f, b + "attn_v.weight", d.kv_dim, d.hidden, 0,
                                      &qkv[2].first, &qkv[2].second));
    KVGRID_RETURN_IF_ERROR(Stack(std::move(qkv), d.hidden, &l.qkv, &l.qkv_q, &l.qkv_parts));
    if (c.attention_bias) {
      std::vector<float> bias;
      for (auto [name, n] : {std::pair{"attn_q.bias", d.q_dim}, std::pair{"attn_k.bias", d.kv_dim},
                             std::pair{"attn_v.bias", d.kv_dim}}) {
        KVGRID_RETURN_IF_ERROR(GgufF32(f, b + name, {n}, &bias));
        l.qkv_bias.insert(l.qkv_bias.end(), bias.begin(), bias.end());
      }
    }
    KVGRID_RETURN_IF_ERROR(
        GgufLinear(f, b + "attn_output.weight", d.hidden, d.q_dim, 0, &l.o, &l.o_q));
    KVGRID_RETURN_IF_ERROR(GgufLinear(f, b + "ffn_gate.weight", d.inter, d.hidden, 0,
                                      &gate_up[0].first, &gate_up[0].second));
    KVGRID_RETURN_IF_ERROR(GgufLinear(f, b + "ffn_up.weight", d.inter, d.hidden, 0,
                                      &gate_up[1].first, &gate_up[1].second));
    KVGRID_RETURN_IF_ERROR(Stack(std::move(gate_up), d.hidden, &l.gate_up, &l.gate_up_q,
                                 &l.gate_up_parts));
    KVGRID_RETURN_IF_ERROR(
        GgufLinear(f, b + "ffn_down.weight", d.hidden, d.inter, 0, &l.down, &l.down_q));
    w.layers.push_back(std::move(l));
    if (tally) progress(tally->After(i + 1));
  }
  return FromWeights(c, std::move(w), tp);
}

absl::StatusOr<LlamaWeights> LlamaModel::ShardWeights(const model::ModelConfig& config,
                                                      const LlamaWeights& full_weights,
                                                      TensorParallel tp) {
  KVGRID_RETURN_IF_ERROR(tp.ValidateSplit(config));
  KVGRID_RETURN_IF_ERROR(CheckWeights(config, full_weights, {}));
  const bool gguf_blocks =
      !full_weights.embed_q.empty() ||
      std::any_of(full_weights.layers.begin(), full_weights.layers.end(), [](const auto& l) {
        return !l.qkv_parts.empty() || !l.gate_up_parts.empty();
      });
  if (gguf_blocks) {
    return absl::UnimplementedError(
        "ShardWeights: an embedding or fused projection held in GGUF blocks is not sliced");
  }
  const ShardDims full = ShardDimsOf(config);
  const ShardDims d = ShardDimsOf(config, tp);
  const int64_t hd = d.head_dim;
  const int64_t q0 = d.head_begin * hd, q1 = q0 + d.q_dim;
  const int64_t kv0 = full.q_dim + d.kv_head_begin * hd, kv1 = kv0 + d.kv_dim;
  const int64_t v0 = kv0 + full.kv_dim, v1 = v0 + d.kv_dim;
  const int64_t i0 = d.inter_begin, i1 = i0 + d.inter;
  LlamaWeights w;
  w.embed = Rows(full_weights.embed, d.hidden, d.vocab_begin, d.vocab_begin + d.vocab_local);
  w.final_norm = full_weights.final_norm;
  if (!full_weights.lm_head.empty()) {
    w.lm_head = Rows(full_weights.lm_head, d.hidden, d.vocab_begin, d.vocab_begin + d.vocab_local);
  }
  for (const LayerWeights& f : full_weights.layers) {
    LayerWeights l;
    l.input_norm = f.input_norm;
    l.post_norm = f.post_norm;
    l.q_norm = f.q_norm;
    l.k_norm = f.k_norm;
    // The fused qkv rows are q (all heads), then k, then v: take this rank's rows of each.
    for (auto [b, e] : {std::pair{q0, q1}, std::pair{kv0, kv1}, std::pair{v0, v1}}) {
      const std::vector<float> rows = Rows(f.qkv, d.hidden, b, e);
      l.qkv.insert(l.qkv.end(), rows.begin(), rows.end());
      if (!f.qkv_bias.empty()) {
        const std::vector<float> bias = Rows(f.qkv_bias, 1, b, e);
        l.qkv_bias.insert(l.qkv_bias.end(), bias.begin(), bias.end());
      }
    }
    l.o = Cols(f.o, d.hidden, full.q_dim, q0, q1);
    if (tp.rank == 0) l.o_bias = f.o_bias;
    for (auto [b, e] : {std::pair{i0, i1}, std::pair{full.inter + i0, full.inter + i1}}) {
      const std::vector<float> rows = Rows(f.gate_up, d.hidden, b, e);
      l.gate_up.insert(l.gate_up.end(), rows.begin(), rows.end());
    }
    l.down = Cols(f.down, d.hidden, full.inter, i0, i1);
    w.layers.push_back(std::move(l));
  }
  return w;
}

absl::Status LlamaModel::CheckWeights(const model::ModelConfig& config,
                                      const LlamaWeights& weights, TensorParallel tp) {
  KVGRID_RETURN_IF_ERROR(tp.ValidateSplit(config));
  return kvgrid::worker::CheckWeights(config, weights, tp);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromWeights(
    const model::ModelConfig& config, LlamaWeights weights, TensorParallel tp) {
  KVGRID_RETURN_IF_ERROR(tp.Validate(config));
  KVGRID_RETURN_IF_ERROR(CheckWeights(config, weights, tp));
  absl::StatusOr<std::vector<double>> inv_freq = cpu::RopeInvFreq(config);
  if (!inv_freq.ok()) return inv_freq.status();
  return std::unique_ptr<LlamaModel>(
      new LlamaModel(config, std::move(weights), *std::move(inv_freq), tp));
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::WithoutWeights(
    const model::ModelConfig& config, TensorParallel tp) {
  KVGRID_RETURN_IF_ERROR(tp.Validate(config));
  KVGRID_RETURN_IF_ERROR(tp.ValidateSplit(config));
  absl::StatusOr<std::vector<double>> inv_freq = cpu::RopeInvFreq(config);
  if (!inv_freq.ok()) return inv_freq.status();
  std::unique_ptr<LlamaModel> m(new LlamaModel(config, LlamaWeights{}, *std::move(inv_freq), tp));
  m->has_weights_ = false;
  return m;
}

LlamaModel::LlamaModel(const model::ModelConfig& config, LlamaWeights weights,
                       std::vector<double> inv_freq, TensorParallel tp)
    : config_(config),
      tp_(tp),
      w_(std::move(weights)),
      inv_freq_(std::move(inv_freq)),
      rope_scale_(cpu::RopeAttentionFactor(config)) {
  PrepareWeights();
}

LlamaWeights LlamaModel::RandomWeights(const model::ModelConfig& c, uint64_t seed) {
  const ShardDims d = ShardDimsOf(c);
  std::mt19937_64 rng(seed);
  // Uniform in [-a, a] has std a/sqrt(3); cheap to draw for half a billion weights.
  auto fill = [&rng](int64_t n, float std_dev) {
    std::vector<float> v(n);
    const float a = std_dev * std::sqrt(3.f);
    std::uniform_real_distribution<float> u(-a, a);
    for (float& x : v) x = u(rng);
    return v;
  };
  auto ones = [](int64_t n) { return std::vector<float>(n, 1.f); };
  LlamaWeights w;
  w.embed = fill(d.vocab * d.hidden, 1.f);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights l;
    l.input_norm = ones(d.hidden);
    l.post_norm = ones(d.hidden);
    l.qkv = fill(d.qkv_dim * d.hidden, 1.f / std::sqrt(static_cast<float>(d.hidden)));
    if (c.attention_bias) l.qkv_bias = fill(d.qkv_dim, 0.02f);
    if (c.qk_norm) {
      l.q_norm = ones(d.head_dim);
      l.k_norm = ones(d.head_dim);
    }
    l.o = fill(d.hidden * d.q_dim, 1.f / std::sqrt(static_cast<float>(d.q_dim)));
    l.gate_up = fill(2 * d.inter * d.hidden, 1.f / std::sqrt(static_cast<float>(d.hidden)));
    l.down = fill(d.hidden * d.inter, 1.f / std::sqrt(static_cast<float>(d.inter)));
    w.layers.push_back(std::move(l));
  }
  w.final_norm = ones(d.hidden);
  if (!c.tie_word_embeddings) {
    w.lm_head = fill(d.vocab * d.hidden, 1.f / std::sqrt(static_cast<float>(d.hidden)));
  }
  return w;
}

namespace {

// Calls f on every matrix `w` (LlamaWeights, const or not) holds in blocks or 16-bit floats:
// the embedding, the head and each layer's projections and their parts.
template <typename Weights, typename F>
void ForEachQuantMatrix(Weights& w, F f) {
  f(w.embed_q);
  f(w.lm_head_q);
  for (auto& l : w.layers) {
    f(l.qkv_q);
    f(l.o_q);
    f(l.gate_up_q);
    f(l.down_q);
    for (auto& q : l.qkv_parts) f(q);
    for (auto& q : l.gate_up_parts) f(q);
  }
}

}  // namespace

int64_t LlamaModel::WeightBytes() const {
  int64_t n = w_.embed.size() + w_.final_norm.size() + w_.lm_head.size();
  for (const LayerWeights& l : w_.layers) {
    n += l.input_norm.size() + l.qkv.size() + l.qkv_bias.size() + l.o.size() + l.o_bias.size() +
         l.post_norm.size() + l.gate_up.size() + l.down.size() + l.q_norm.size() +
         l.k_norm.size();
  }
  int64_t quantized = 0;
  ForEachQuantMatrix(w_, [&quantized](const cpu::QuantMatrix& q) {
    quantized += static_cast<int64_t>(q.data.size());
  });
  return n * static_cast<int64_t>(sizeof(float)) + quantized;
}

void LlamaModel::PrepareWeights() {
  static const bool interleave = cpu::HaveInterleavedInt8();
  std::vector<std::vector<float>*> fp32 = {&w_.embed, &w_.lm_head};
  for (LayerWeights& l : w_.layers) fp32.insert(fp32.end(), {&l.qkv, &l.o, &l.gate_up, &l.down});
  ForEachQuantMatrix(w_, [](cpu::QuantMatrix& q) {
    if (interleave) cpu::InterleaveRows(&q);  // on huge pages already when it moves
    if (!q.interleaved) cpu::MoveToHugePages(&q.data);
  });
  for (std::vector<float>* v : fp32) cpu::MoveToHugePages(v);
  // Heap memory that the allocator reused was on small pages before the advice above saw it.
  // Best effort: where the kernel cannot, the weights stay where they are.
  ForEachQuantMatrix(w_, [](const cpu::QuantMatrix& q) {
    cpu::CollapseToHugePages(q.data.data(), q.data.size()).IgnoreError();
  });
  for (const std::vector<float>* v : fp32) {
    cpu::CollapseToHugePages(v->data(), v->size() * sizeof(float)).IgnoreError();
  }
}

absl::Status LlamaModel::QuantizeWeights(cpu::WeightDType dtype) {
  if (dtype == cpu::WeightDType::kF32) return absl::OkStatus();
  if (!has_weights_) {
    return absl::FailedPreconditionError("the model was made without weights to quantize");
  }
  // The requantization and the fp16 path read row-major blocks; they are interleaved again
  // at the end.
  ForEachQuantMatrix(w_, [](cpu::QuantMatrix& q) {
    if (q.interleaved) q = cpu::RowMajor(q);
  });
  const ShardDims d = ShardDimsOf(config_, tp_);
  auto quantize = [dtype](std::vector<float>& w, int64_t rows, int64_t cols,
                          cpu::QuantMatrix* out) -> absl::Status {
    if (w.empty() && cpu::IsFloat16(out->dtype) && !out->empty() && out->dtype != dtype) {
      w = cpu::DequantizeMatrix(*out);  // a GGUF's F16/BF16 matrix, requantized as asked
    }
    if (w.empty()) return absl::OkStatus();
    // Block formats need whole blocks of inputs; such a matrix stays fp32.
    if (!cpu::IsFloat16(dtype) && cols % cpu::kQuantBlock != 0) return absl::OkStatus();
    KVGRID_ASSIGN_OR_RETURN(*out, cpu::QuantizeMatrix(w.data(), rows, cols, dtype));
    std::vector<float>().swap(w);
    return absl::OkStatus();
  };
  if (cpu::IsFloat16(dtype)) {
    // 16-bit everywhere: the embedding table too (the lookup widens the rows it reads, and a
    // tied head multiplies the same 16-bit rows), and an untied head.
    KVGRID_RETURN_IF_ERROR(quantize(w_.embed, d.vocab_local, d.hidden, &w_.embed_q));
    KVGRID_RETURN_IF_ERROR(quantize(w_.lm_head, d.vocab_local, d.hidden, &w_.lm_head_q));
  }
  // A tied head over an embedding in blocks (GGUF) already runs on those blocks.
  const bool head_on_blocks = w_.lm_head.empty() && !w_.embed_q.empty();
  if (w_.lm_head_q.empty() && !head_on_blocks && d.hidden % cpu::kQuantBlock == 0) {
    const std::vector<float>& head = w_.lm_head.empty() ? w_.embed : w_.lm_head;
    KVGRID_ASSIGN_OR_RETURN(w_.lm_head_q, cpu::QuantizeMatrix(head.data(), d.vocab_local,
                                                              d.hidden, cpu::WeightDType::kQ8_0));
    std::vector<float>().swap(w_.lm_head);
  }
  for (LayerWeights& l : w_.layers) {
    KVGRID_RETURN_IF_ERROR(quantize(l.qkv, d.qkv_dim, d.hidden, &l.qkv_q));
    KVGRID_RETURN_IF_ERROR(quantize(l.o, d.hidden, d.q_dim, &l.o_q));
    KVGRID_RETURN_IF_ERROR(quantize(l.gate_up, 2 * d.inter, d.hidden, &l.gate_up_q));
    KVGRID_RETURN_IF_ERROR(quantize(l.down, d.hidden, d.inter, &l.down_q));
  }
  PrepareWeights();
  return absl::OkStatus();
}

KvGeometry LlamaModel::KvGeometryFor(int64_t block_size, kernels::KvDType k_dtype,
                                     kernels::KvDType v_dtype) const {
  KvGeometry g;
  g.num_layers = config_.num_hidden_layers;
  g.num_kv_heads = ShardDimsOf(config_, tp_).kv_heads;
  g.head_dim = config_.head_dim;
  g.block_size = block_size;
  g.k_dtype = k_dtype;
  g.v_dtype = v_dtype;
  return g;
}

absl::Status LlamaModel::Forward(const ForwardBatch& b, KvPool& pool, std::vector<float>* logits) {
  if (!has_weights_) {
    return absl::FailedPreconditionError(
        "the model was made without weights (a device executor makes them on the device)");
  }
  const ShardDims d = ShardDimsOf(config_, tp_);
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(b.seq_lens.size());
  KVGRID_RETURN_IF_ERROR(b.ValidateSizes());
  const KvGeometry& g = pool.geometry();
  if (g.num_layers != config_.num_hidden_layers || g.num_kv_heads != d.kv_heads ||
      g.head_dim != d.head_dim) {
    return absl::InvalidArgumentError("KV pool geometry does not match the model");
  }
  logits->clear();
  if (n == 0) return absl::OkStatus();
  // Under context parallelism the batch's ids are the group's: this rank writes and reads
  // only its own blocks, in its own pool's ids (-1 elsewhere).
  const int64_t* slots = b.slots.data();
  const int32_t* tables = b.block_tables.data();
  if (cp_.size > 1) {
    KVGRID_RETURN_IF_ERROR(LocalizeContextParallelBatch(
        b, {.cp_size = cp_.size, .blocks_per_rank = static_cast<int32_t>(pool.num_blocks())},
        static_cast<int32_t>(g.block_size), cp_.rank, &cp_slots_, &cp_tables_));
    slots = cp_slots_.data();
    tables = cp_tables_.data();
  }

  x_.resize(n * d.hidden);
  h_.resize(n * d.hidden);
  qkv_.resize(n * d.qkv_dim);
  q_.resize(n * d.q_dim);
  k_.resize(n * d.kv_dim);
  v_.resize(n * d.kv_dim);
  attn_.resize(n * d.q_dim);
  gate_up_.resize(n * 2 * d.inter);
  act_.resize(n * d.inter);
  if (cp_.size > 1) cp_lse_.resize(n * d.heads);

  if (d.vocab_local == d.vocab) {
    KVGRID_RETURN_IF_ERROR(cpu::Embedding({.table = w_.embed_q.empty() ? w_.embed.data() : nullptr,
                                           .blocks = w_.embed_q.empty() ? nullptr : &w_.embed_q,
                                           .ids = b.token_ids.data(),
                                           .output = x_.data(),
                                           .vocab = d.vocab,
                                           .hidden = d.hidden,
                                           .num_tokens = n}));
  } else {
    // Vocabulary-parallel embedding: each rank fills the rows of the ids in its slice and
    // zeros elsewhere; the sum over the group is the full lookup.
    for (int64_t t = 0; t < n; ++t) {
      const int64_t id = b.token_ids[t];
      if (id < 0 || id >= d.vocab) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", id, " at index ", t,
                                                       " is outside the vocabulary [0, ",
                                                       d.vocab, ")"));
      }
      float* row = x_.data() + t * d.hidden;
      if (id >= d.vocab_begin && id < d.vocab_begin + d.vocab_local && !w_.embed_q.empty()) {
        cpu::DequantizeRow(w_.embed_q, id - d.vocab_begin, row);
      } else if (id >= d.vocab_begin && id < d.vocab_begin + d.vocab_local) {
        std::memcpy(row, w_.embed.data() + (id - d.vocab_begin) * d.hidden,
                    sizeof(float) * d.hidden);
      } else {
        std::fill(row, row + d.hidden, 0.f);
      }
    }
    KVGRID_RETURN_IF_ERROR(tp_.comm->AllReduceSum(std::span<float>(x_)));
  }
  const float eps = static_cast<float>(config_.rms_norm_eps);
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    const LayerWeights& l = w_.layers[layer];
    KVGRID_RETURN_IF_ERROR(cpu::RmsNorm({.input = x_.data(),
                                         .weight = l.input_norm.data(),
                                         .output = h_.data(),
                                         .num_tokens = n,
                                         .hidden = d.hidden,
                                         .eps = eps}));
    KVGRID_RETURN_IF_ERROR(FusedLinear(h_.data(), l.qkv, l.qkv_q, l.qkv_parts,
                                       l.qkv_bias.empty() ? nullptr : l.qkv_bias.data(),
                                       qkv_.data(), n, d.hidden, d.qkv_dim));
    for (int64_t t = 0; t < n; ++t) {
      const float* row = qkv_.data() + t * d.qkv_dim;
      std::memcpy(q_.data() + t * d.q_dim, row, sizeof(float) * d.q_dim);
      std::memcpy(k_.data() + t * d.kv_dim, row + d.q_dim, sizeof(float) * d.kv_dim);
      std::memcpy(v_.data() + t * d.kv_dim, row + d.q_dim + d.kv_dim, sizeof(float) * d.kv_dim);
    }
    if (config_.qk_norm) {  // Qwen3: each head's q and k RMS-normalized, before RoPE
      KVGRID_RETURN_IF_ERROR(cpu::RmsNorm({.input = q_.data(),
                                           .weight = l.q_norm.data(),
                                           .output = q_.data(),
                                           .num_tokens = n * d.heads,
                                           .hidden = d.head_dim,
                                           .eps = eps}));
      KVGRID_RETURN_IF_ERROR(cpu::RmsNorm({.input = k_.data(),
                                           .weight = l.k_norm.data(),
                                           .output = k_.data(),
                                           .num_tokens = n * d.kv_heads,
                                           .hidden = d.head_dim,
                                           .eps = eps}));
    }
    KVGRID_RETURN_IF_ERROR(cpu::Rope({.query = q_.data(),
                                      .key = k_.data(),
                                      .positions = b.positions.data(),
                                      .inv_freq = inv_freq_.data(),
                                      .scale = rope_scale_,
                                      .num_tokens = n,
                                      .num_heads = d.heads,
                                      .num_kv_heads = d.kv_heads,
                                      .head_dim = d.head_dim}));
    KVGRID_RETURN_IF_ERROR(cpu::KvWrite({.key = k_.data(),
                                         .value = v_.data(),
                                         .slots = slots,
                                         .k_cache = pool.k(layer),
                                         .v_cache = pool.v(layer),
                                         .k_meta = pool.k_meta(layer),
                                         .v_meta = pool.v_meta(layer),
                                         .k_dtype = g.k_dtype,
                                         .v_dtype = g.v_dtype,
                                         .num_tokens = n,
                                         .num_blocks = pool.num_blocks(),
                                         .num_kv_heads = d.kv_heads,
                                         .block_size = g.block_size,
                                         .head_dim = d.head_dim}));
    KVGRID_RETURN_IF_ERROR(cpu::PagedAttention(
        {.query = q_.data(),
         .output = attn_.data(),
         .k_cache = pool.k(layer),
         .v_cache = pool.v(layer),
         .k_meta = pool.k_meta(layer),
         .v_meta = pool.v_meta(layer),
         .k_dtype = g.k_dtype,
         .v_dtype = g.v_dtype,
         .block_tables = tables,
         .seq_lens = b.seq_lens.data(),
         .query_start = b.query_start.data(),
         .num_seqs = num_seqs,
         .num_tokens = n,
         .max_blocks_per_seq = b.max_blocks_per_seq,
         .num_blocks = pool.num_blocks(),
         .num_heads = d.heads,
         .num_kv_heads = d.kv_heads,
         .block_size = g.block_size,
         .head_dim = d.head_dim,
         .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.head_dim))),
         .window = config_.LayerWindow(layer),
         .precision = attention_precision_,
         .cp_size = cp_.size,
         .cp_rank = cp_.rank,
         .lse = cp_.size > 1 ? cp_lse_.data() : nullptr}));
    if (cp_.size > 1) KVGRID_RETURN_IF_ERROR(MergeContextParallel(n, d.heads, d.head_dim));
    KVGRID_RETURN_IF_ERROR(RowParallelLinear(attn_.data(), l.o, l.o_q, l.o_bias, n, d.q_dim, d.hidden));
    KVGRID_RETURN_IF_ERROR(cpu::RmsNorm({.input = x_.data(),
                                         .weight = l.post_norm.data(),
                                         .output = h_.data(),
                                         .num_tokens = n,
                                         .hidden = d.hidden,
                                         .eps = eps}));
    KVGRID_RETURN_IF_ERROR(FusedLinear(h_.data(), l.gate_up, l.gate_up_q, l.gate_up_parts,
                                       nullptr, gate_up_.data(), n, d.hidden, 2 * d.inter));
    KVGRID_RETURN_IF_ERROR(cpu::SiluAndMul({.gate_up = gate_up_.data(),
                                            .output = act_.data(),
                                            .num_tokens = n,
                                            .intermediate = d.inter}));
    KVGRID_RETURN_IF_ERROR(RowParallelLinear(act_.data(), l.down, l.down_q, {}, n, d.inter, d.hidden));
  }

  // Only the requested rows go through the final norm and the (large) vocabulary projection.
  const int64_t m = static_cast<int64_t>(b.logit_rows.size());
  // Every context-parallel rank now holds the same hidden states: rank 0's group computes
  // the logits.
  if (m == 0 || cp_.rank != 0) return absl::OkStatus();
  rows_.resize(m * d.hidden);
  for (int64_t i = 0; i < m; ++i) {
    std::memcpy(rows_.data() + i * d.hidden, x_.data() + b.logit_rows[i] * d.hidden,
                sizeof(float) * d.hidden);
  }
  KVGRID_RETURN_IF_ERROR(cpu::RmsNorm({.input = rows_.data(),
                                       .weight = w_.final_norm.data(),
                                       .output = rows_.data(),
                                       .num_tokens = m,
                                       .hidden = d.hidden,
                                       .eps = eps}));
  const std::vector<float>& head = w_.lm_head.empty() ? w_.embed : w_.lm_head;
  // The head's blocks: lm_head's, or, for a head tied to an embedding in blocks, the
  // embedding's own (no copy).
  const cpu::QuantMatrix& head_q =
      !w_.lm_head_q.empty() || !w_.lm_head.empty() ? w_.lm_head_q : w_.embed_q;
  if (d.vocab_local < d.vocab) {
    // Vocabulary-parallel head: each rank projects onto its slice of the vocabulary and the
    // slices are gathered, so the largest GEMM of a decode step is split like the layers.
    const int64_t local = d.vocab_local;
    partial_.resize(m * local);
    KVGRID_RETURN_IF_ERROR(AnyLinear(rows_.data(), head, head_q, nullptr, partial_.data(),
                                     m, d.hidden, local, false));
    gathered_.resize(tp_.size * m * local);
    KVGRID_RETURN_IF_ERROR(tp_.comm->AllGather(partial_, std::span<float>(gathered_)));
    if (tp_.rank != 0) return absl::OkStatus();  // only the leader samples
    logits->resize(m * d.vocab);
    for (int64_t r = 0; r < tp_.size; ++r) {
      for (int64_t i = 0; i < m; ++i) {
        std::memcpy(logits->data() + i * d.vocab + r * local,
                    gathered_.data() + (r * m + i) * local, sizeof(float) * local);
      }
    }
    return absl::OkStatus();
  }
  if (tp_.rank != 0) return absl::OkStatus();  // only the leader samples
  logits->resize(m * d.vocab);
  return AnyLinear(rows_.data(), head, head_q, nullptr, logits->data(), m, d.hidden, d.vocab,
                   false);
}

absl::Status LlamaModel::MergeContextParallel(int64_t n, int64_t heads, int64_t head_dim) {
  // One all-gather per layer: each rank's [n, heads, head_dim] outputs then [n, heads] lse.
  const int64_t rows = n * heads, out_floats = rows * head_dim, part = out_floats + rows;
  cp_send_.resize(part);
  std::memcpy(cp_send_.data(), attn_.data(), sizeof(float) * out_floats);
  std::memcpy(cp_send_.data() + out_floats, cp_lse_.data(), sizeof(float) * rows);
  cp_recv_.resize(cp_.size * part);
  KVGRID_RETURN_IF_ERROR(cp_.comm->AllGather(cp_send_, std::span<float>(cp_recv_)));
  cp_outs_.resize(cp_.size * out_floats);
  cp_lses_.resize(cp_.size * rows);
  for (int64_t c = 0; c < cp_.size; ++c) {
    const float* src = cp_recv_.data() + c * part;
    std::memcpy(cp_outs_.data() + c * out_floats, src, sizeof(float) * out_floats);
    std::memcpy(cp_lses_.data() + c * rows, src + out_floats, sizeof(float) * rows);
  }
  cpu::MergeAttentionPartials(cp_outs_.data(), cp_lses_.data(), cp_.size, rows, head_dim,
                              attn_.data(), nullptr);
  return absl::OkStatus();
}

absl::Status LlamaModel::AnyLinear(const float* input, const std::vector<float>& weight,
                                   const cpu::QuantMatrix& quantized, const float* bias,
                                   float* output, int64_t n, int64_t in_features,
                                   int64_t out_features, bool accumulate) {
  if (!quantized.empty()) {
    return cpu::QuantLinear({.input = input, .weight = &quantized, .bias = bias,
                             .output = output, .num_tokens = n, .accumulate = accumulate,
                             .precision = linear_precision_});
  }
  return cpu::Linear({.input = input, .weight = weight.data(), .bias = bias, .output = output,
                      .num_tokens = n, .in_features = in_features,
                      .out_features = out_features, .accumulate = accumulate});
}

absl::Status LlamaModel::FusedLinear(const float* input, const std::vector<float>& weight,
                                     const cpu::QuantMatrix& quantized,
                                     const std::vector<cpu::QuantMatrix>& parts,
                                     const float* bias, float* output, int64_t n,
                                     int64_t in_features, int64_t out_features) {
  if (parts.empty()) {
    return AnyLinear(input, weight, quantized, bias, output, n, in_features, out_features, false);
  }
  int64_t row = 0;  // the part's first output row: its columns of `output`
  for (const cpu::QuantMatrix& part : parts) {
    KVGRID_RETURN_IF_ERROR(cpu::QuantLinear({.input = input,
                                             .weight = &part,
                                             .bias = bias ? bias + row : nullptr,
                                             .output = output + row,
                                             .num_tokens = n,
                                             .output_stride = out_features,
                                             .precision = linear_precision_}));
    row += part.rows;
  }
  return absl::OkStatus();
}

absl::Status LlamaModel::RowParallelLinear(const float* input, const std::vector<float>& weight,
                                           const cpu::QuantMatrix& quantized,
                                           const std::vector<float>& bias, int64_t n,
                                           int64_t in_features, int64_t out_features) {
  const float* b = bias.empty() ? nullptr : bias.data();
  if (tp_.size == 1) {  // straight into the residual stream
    return AnyLinear(input, weight, quantized, b, x_.data(), n, in_features, out_features, true);
  }
  // Each rank's partial product over its slice of the inputs, summed across the group.
  partial_.resize(n * out_features);
  KVGRID_RETURN_IF_ERROR(AnyLinear(input, weight, quantized, b, partial_.data(), n, in_features,
                                   out_features, false));
  KVGRID_RETURN_IF_ERROR(tp_.comm->AllReduceSum(std::span<float>(partial_)));
  for (int64_t i = 0; i < n * out_features; ++i) x_[i] += partial_[i];
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
