// A Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral) on the CPU kernels, fp32 compute.
// Qwen3's per-head q/k RMSNorm runs after the projection and before RoPE; RoPE takes every
// scaling model::ModelConfig parses (kernels/cpu/rope.h), YaRN's attention factor included.
//
// Weights are converted to fp32 at load, with q/k/v and gate/up fused so each layer runs three
// GEMMs for attention input/output and two for the MLP. Forward() runs a batch of sequences
// through every layer, writing their new K/V into a KvPool and returning logits for the rows
// asked for. Not thread-safe (one engine drives it); the workspace is reused across calls.
//
// Tensor parallelism (Megatron-style): rank r of a group of size T holds heads
// [r H/T, (r+1) H/T) of q and the KV heads they read (KV heads split across ranks, or
// replicated when T exceeds their number), columns of gate/up [r I/T, (r+1) I/T), and the
// matching input slices of o_proj and down_proj, whose partial outputs are summed across the
// group with an all-reduce. The embedding and the head are split by vocabulary rows when the
// vocabulary divides evenly (the lookup is all-reduced, the head's logits gathered), else
// replicated; norms (Qwen3's per-head q/k norms too) are replicated. So a rank holds about
// 1/T of the weights. Every rank runs
// the same Forward on the same batch and holds the KV of its own heads; only rank 0 gets
// logits.
//
// Context parallelism (SetContextParallel): C ranks that hold the same weights and heads split
// every sequence's KV blocks (worker/kv/context_parallel_layout.h). The batch carries the
// group-wide slots and block tables of the leader's BlockManager; each rank writes only the
// K/V whose blocks are its own, attends over its own blocks, and one all-gather per layer of
// the partial outputs and their log-sum-exp merges them exactly, so every rank continues with
// the attention over the whole context. Only CP rank 0 (of TP rank 0) gets logits.
#ifndef KVGRID_WORKER_EXECUTOR_LLAMA_MODEL_H_
#define KVGRID_WORKER_EXECUTOR_LLAMA_MODEL_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/cpu/quant_linear.h"
#include "model/model_config.h"
#include "worker/comm/communicator.h"
#include "worker/executor/load_progress.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/context_parallel_layout.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

// This process's place in a tensor-parallel group; size 1 is the whole model.
struct TensorParallel {
  int rank = 0;
  int size = 1;
  Communicator* comm = nullptr;  // not owned; required when size > 1

  // INVALID_ARGUMENT unless the model's heads, KV heads and intermediate size split evenly
  // over `size` ranks (KV heads may instead divide `size`: then they are replicated) and a
  // group has a communicator.
  absl::Status Validate(const model::ModelConfig& config) const;
  // Validate without the communicator: whether rank `rank` of `size` is a valid shard.
  absl::Status ValidateSplit(const model::ModelConfig& config) const;
};

// This process's place among the context-parallel ranks that hold the same heads; size 1: the
// rank holds every block of its sequences.
struct ContextParallel {
  int rank = 0;
  int size = 1;
  Communicator* comm = nullptr;  // not owned; required when size > 1

  // INVALID_ARGUMENT for a size below 1, a rank outside [0, size) or a missing communicator.
  absl::Status Validate() const;
};

// The dimensions one rank computes: its shares of the heads, KV heads, intermediate columns
// and vocabulary rows (the whole model at size 1). The CPU and CUDA models shard alike.
struct ShardDims {
  int64_t hidden, heads, kv_heads, head_dim, inter, vocab, q_dim, kv_dim, qkv_dim;
  // Where this rank's shares start in the whole model: q head, KV head, intermediate column.
  int64_t head_begin = 0, kv_head_begin = 0, inter_begin = 0;
  // The rows of the embedding and the head this rank holds: a slice of the vocabulary when it
  // divides evenly over the ranks, else all of it.
  int64_t vocab_begin = 0, vocab_local = 0;
};

// Rank tp.rank's dimensions (tp.Validate(config) must have passed).
ShardDims ShardDimsOf(const model::ModelConfig& config, const TensorParallel& tp = {});

// Shapes below are a rank's: num_heads, num_kv_heads and intermediate are its shares.
struct LayerWeights {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> qkv;         // [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
  std::vector<float> qkv_bias;    // [(num_heads + 2 * num_kv_heads) * head_dim] or empty
  std::vector<float> q_norm;      // [head_dim] (config.qk_norm) or empty: every q head's
  std::vector<float> k_norm;      // [head_dim] (config.qk_norm) or empty: every k head's
  std::vector<float> o;           // [hidden, num_heads * head_dim]
  std::vector<float> o_bias;      // [hidden] or empty
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> gate_up;     // [2 * intermediate, hidden]: gate rows then up rows
  std::vector<float> down;        // [hidden, intermediate]
  // After QuantizeWeights: the same matrices in Q8_0/Q4_0 or 16-bit floats (their fp32 vectors
  // then empty); a matrix whose input width is not a multiple of 32 stays fp32 in a block
  // dtype. A GGUF's F16/BF16 matrices are held here as stored.
  kernels::cpu::QuantMatrix qkv_q, o_q, gate_up_q, down_q;
  // A fused projection whose parts are quantized differently (a GGUF layer with q/k in Q4_K and
  // v in Q6_K, or gate and up of different types): each part in its own blocks, covering the
  // next rows of the output (q, k, v; gate, up), computed part by part into column slices of
  // the output. qkv/qkv_q (gate_up/gate_up_q) are then empty.
  std::vector<kernels::cpu::QuantMatrix> qkv_parts, gate_up_parts;
};

struct LlamaWeights {
  std::vector<float> embed;       // [vocab, hidden] (a rank's slice of the vocabulary)
  // The embedding in the blocks a GGUF file stores it in (Q8_0, Q4_K, Q6_K..., or F16/BF16; or
  // 16-bit after QuantizeWeights(fp16/bf16)): `embed` is then
  // empty, the lookup decodes only the rows it reads, and a tied head multiplies these blocks.
  kernels::cpu::QuantMatrix embed_q;  // [vocab, hidden] or empty
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [vocab, hidden] (sliced like embed); empty when tied
  // After QuantizeWeights: the head in Q8_0 (a copy of `embed` when tied, which stays fp32 for
  // the lookup); lm_head is then empty. GGUF: output.weight's blocks as stored. A tied head
  // with embed_q and no lm_head_q runs on embed_q.
  kernels::cpu::QuantMatrix lm_head_q;
};

// One step's work, laid out for the kernels. Sequence s owns tokens
// [query_start[s], query_start[s+1]) and has seq_lens[s] tokens of context after this step.
struct ForwardBatch {
  std::vector<int32_t> token_ids;     // [num_tokens]
  std::vector<int32_t> positions;     // [num_tokens]
  std::vector<int64_t> slots;         // [num_tokens] KV slots to write
  std::vector<int32_t> query_start;   // [num_seqs + 1]
  std::vector<int32_t> seq_lens;      // [num_seqs]
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq], padded with 0
  int64_t max_blocks_per_seq = 0;
  std::vector<int32_t> logit_rows;    // token indices whose logits are returned, in order

  // INVALID_ARGUMENT unless the arrays' sizes agree with each other and every logit row is a
  // token of the batch (the contents are the kernels' to check).
  absl::Status ValidateSizes() const;
};

// A rank's view of a context-parallel group's batch (worker/kv/context_parallel_layout.h):
// checks that every slot and every table entry a sequence uses (group-wide ids) lies in the
// group and on the rank its position names, then writes `rank`'s own ids into `slots` and
// `tables` (-1 for what lives elsewhere, which is neither written nor read). Every rank checks
// the whole batch, so all of them accept or refuse it alike, before any collective.
// Errors: INVALID_ARGUMENT naming the field.
absl::Status LocalizeContextParallelBatch(const ForwardBatch& b,
                                          const ContextParallelLayout& layout,
                                          int32_t block_size, int32_t rank,
                                          std::vector<int64_t>* slots,
                                          std::vector<int32_t>* tables);

// The batch that computes positions [begin, begin + tokens.size()) of one sequence whose
// blocks `blocks` holds (already reserved), with logits for the last of them.
ForwardBatch SingleSequenceBatch(const BlockManager& blocks, SequenceId seq, int64_t begin,
                                 std::span<const int32_t> tokens);

// One decode step for several sequences (blocks reserved): sequence seqs[i] computes tokens[i]
// at `position`, with logits for each, in order.
ForwardBatch DecodeBatch(const BlockManager& blocks, std::span<const SequenceId> seqs,
                         int64_t position, std::span<const int32_t> tokens);
// The same with sequence seqs[i] at positions[i].
ForwardBatch DecodeBatch(const BlockManager& blocks, std::span<const SequenceId> seqs,
                         std::span<const int64_t> positions, std::span<const int32_t> tokens);

class LlamaModel {
 public:
  // Reads config.json and the safetensors checkpoint in `dir`.
  // Errors: as model::LoadModelConfig and model::Checkpoint (naming file and tensor), plus
  // INVALID_ARGUMENT for a missing or mis-shaped tensor. `progress` (may be empty) is called
  // once the tensors outside the layers are read, then after each layer.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(const std::filesystem::path& dir,
                                                          TensorParallel tp = {},
                                                          const LoadProgressFn& progress = {});

  // Reads a GGUF file from llama.cpp (architecture llama, mistral, qwen2 or qwen3 with its
  // attn_q_norm/attn_k_norm): the config from its metadata, F32 tensors (and 16-bit norms and
  // biases) as fp32, F16/BF16 matrices held in 16 bits, every block-format tensor (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K) kept in
  // its blocks as stored and used directly by the quantized kernels: the linear weights; q/k/v
  // and gate/up stacked into one matrix when their types agree, else held as parts of their
  // own types (LayerWeights::qkv_parts, as Q4_K_M files mix Q4_K and Q6_K); the embedding
  // (LlamaWeights::embed_q: only the rows looked up are decoded, and a file without
  // output.weight gets a head tied to the same blocks). llama's q/k rows are un-permuted from
  // GGML's interleaved RoPE order. Tensor parallelism is not supported for GGUF yet.
  // Errors: as model::GgufFile::Open; INVALID_ARGUMENT naming a missing or mis-shaped tensor or
  // metadata key; UNIMPLEMENTED for other architectures, RoPE scaling types or tp > 1.
  // `progress` as for Load.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> LoadGguf(const std::filesystem::path& path,
                                                              TensorParallel tp = {},
                                                              const LoadProgressFn& progress = {});

  // Builds a model from weights in memory (benchmarks, tests).
  // Errors: INVALID_ARGUMENT when a tensor's size disagrees with `config`.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> FromWeights(const model::ModelConfig& config,
                                                                 LlamaWeights weights,
                                                                 TensorParallel tp = {});

  // Checks every weight's size against `config` (this rank's share under `tp`; tp.comm is not
  // needed) without taking a copy. Errors: INVALID_ARGUMENT naming the weight and both sizes,
  // or as TensorParallel::ValidateSplit.
  static absl::Status CheckWeights(const model::ModelConfig& config, const LlamaWeights& weights,
                                   TensorParallel tp = {});

  // Rank tp.rank's share of whole-model weights (benchmarks, tests), sliced as Load slices a
  // checkpoint (tp.comm is not needed). Errors: as TensorParallel::ValidateSplit.
  static absl::StatusOr<LlamaWeights> ShardWeights(const model::ModelConfig& config,
                                                   const LlamaWeights& full, TensorParallel tp);

  // Deterministic random weights (std ~ 1/sqrt(fan_in), norms ~ 1) for benchmarks.
  static LlamaWeights RandomWeights(const model::ModelConfig& config, uint64_t seed);

  // A model that holds its config and no weights: what a device executor needs when it makes
  // random weights itself (--load-format dummy with --device cuda), so that a Llama-3-8B shape
  // never builds 32 GB of host floats. Forward returns FAILED_PRECONDITION.
  // Errors: as FromWeights' checks of `config` and `tp`.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> WithoutWeights(
      const model::ModelConfig& config, TensorParallel tp = {});
  // False for a model made by WithoutWeights.
  [[nodiscard]] bool has_weights() const { return has_weights_; }

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  [[nodiscard]] const model::ModelConfig& config() const { return config_; }
  [[nodiscard]] const TensorParallel& tensor_parallel() const { return tp_; }
  [[nodiscard]] const ContextParallel& context_parallel() const { return cp_; }
  // Makes this model rank cp.rank of a context-parallel group; the batches it runs then carry
  // group-wide block ids (the pool passed to Forward is this rank's: blocks_per_rank is its
  // size). Errors: as ContextParallel::Validate. Not thread-safe with Forward.
  absl::Status SetContextParallel(ContextParallel cp);
  // The weights as held (this rank's share), e.g. to upload them to a device.
  [[nodiscard]] const LlamaWeights& weights() const { return w_; }
  // Bytes of weights held (fp32 and quantized).
  [[nodiscard]] int64_t WeightBytes() const;

  // Quantizes the layers' linear weights (q/k/v, o, gate/up, down) to Q8_0 or Q4_0 by
  // round-to-nearest, in place, and the head to Q8_0 (as llama.cpp keeps the output layer at
  // higher precision than 4 bits); the embedding lookup and norms stay fp32. fp16/bf16 round
  // the layers, the embedding (embed_q) and an untied head to 16-bit floats (norms stay fp32).
  // A GGUF's F16/BF16 matrices are requantized to a block dtype asked for. fp32 is a no-op.
  absl::Status QuantizeWeights(kernels::cpu::WeightDType dtype);
  // How attention reads int8 K/V (kernels/cpu/attention.h): kFast (the default) may round
  // queries and softmax weights to int8 for integer dot products; kExact keeps fp32 math on
  // the decoded rows (the reference the CUDA backend is compared with). Not thread-safe with
  // Forward.
  void SetAttentionPrecision(kernels::cpu::KvKernelPrecision precision) {
    attention_precision_ = precision;
  }
  // How the quantized linear layers multiply at decode sizes (kernels/cpu/quant_linear.h):
  // kFast (the default) runs 8-bit inputs through integer dot products for Q8_0/Q4_0/Q4_1/Q4_Z
  // weights; kExact keeps fp32 inputs (the reference the CUDA backend is compared with). Not
  // thread-safe with Forward.
  void SetLinearPrecision(kernels::cpu::LinearPrecision precision) {
    linear_precision_ = precision;
  }
  // The KV geometry this rank needs: its own KV heads (dtypes and block size left to the
  // caller).
  [[nodiscard]] KvGeometry KvGeometryFor(int64_t block_size, kernels::KvDType k_dtype,
                                         kernels::KvDType v_dtype) const;

  // Runs `batch`; writes K/V of its tokens into `pool`; fills `logits` with
  // [batch.logit_rows.size(), vocab] floats (rank 0 of a group; other ranks get none).
  // Errors: INVALID_ARGUMENT for malformed batches (token id outside the vocabulary, slots
  // outside the pool — the group's pools under context parallelism —, inconsistent sizes);
  // UNAVAILABLE when a group collective fails.
  absl::Status Forward(const ForwardBatch& batch, KvPool& pool, std::vector<float>* logits);

 private:
  LlamaModel(const model::ModelConfig& config, LlamaWeights weights, std::vector<double> inv_freq,
             TensorParallel tp);
  // output (+)= input x weight^T (+ bias), with the quantized weight when there is one.
  absl::Status AnyLinear(const float* input, const std::vector<float>& weight,
                         const kernels::cpu::QuantMatrix& quantized, const float* bias,
                         float* output, int64_t n, int64_t in_features, int64_t out_features,
                         bool accumulate);
  // output = input x weight^T (+ bias) for a fused projection: AnyLinear, or one QuantLinear
  // per part into the part's columns of output [n, out_features] when `parts` is not empty.
  absl::Status FusedLinear(const float* input, const std::vector<float>& weight,
                           const kernels::cpu::QuantMatrix& quantized,
                           const std::vector<kernels::cpu::QuantMatrix>& parts,
                           const float* bias, float* output, int64_t n, int64_t in_features,
                           int64_t out_features);
  // x_ += input x weight^T (+ bias) for a layer whose inputs are split across the group
  // (o_proj, down_proj): the partial products are all-reduced first.
  absl::Status RowParallelLinear(const float* input, const std::vector<float>& weight,
                                 const kernels::cpu::QuantMatrix& quantized,
                                 const std::vector<float>& bias, int64_t n, int64_t in_features,
                                 int64_t out_features);

  // Readies the weights for the CPU kernels when the model is built (after loading and
  // slicing, which read row-major blocks) and after QuantizeWeights: the Q8_0/Q4_0/Q4_1/Q4_Z
  // matrices' rows interleaved for the AVX-512 VNNI kernels on a CPU that has them
  // (kernels/cpu/interleaved_linear.h; weights() shows the layout, QuantMatrix::interleaved,
  // and kExact reads it too, row by row), and every large weight buffer moved onto huge pages
  // (kernels/cpu/huge_pages.h).
  void PrepareWeights();

  model::ModelConfig config_;
  kernels::cpu::KvKernelPrecision attention_precision_ = kernels::cpu::KvKernelPrecision::kFast;
  kernels::cpu::LinearPrecision linear_precision_ = kernels::cpu::LinearPrecision::kFast;
  // Attention of one layer over this context-parallel rank's blocks, merged with the other
  // ranks' into attn_ (n tokens). Errors: the kernel's, or UNAVAILABLE from the all-gather.
  absl::Status MergeContextParallel(int64_t n, int64_t heads, int64_t head_dim);

  TensorParallel tp_;
  ContextParallel cp_;
  bool has_weights_ = true;
  LlamaWeights w_;
  std::vector<double> inv_freq_;  // [head_dim / 2]
  double rope_scale_ = 1.0;       // cpu::RopeAttentionFactor
  // Workspace, reused across steps.
  std::vector<float> x_, h_, qkv_, q_, k_, v_, attn_, gate_up_, act_, rows_, partial_, gathered_;
  // Context parallelism: this rank's slots and tables, its lse, the all-gather's buffers.
  std::vector<int64_t> cp_slots_;
  std::vector<int32_t> cp_tables_;
  std::vector<float> cp_lse_, cp_send_, cp_recv_, cp_outs_, cp_lses_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_LLAMA_MODEL_H_
