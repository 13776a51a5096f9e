// KV capacity planning: how many tokens and sequences a memory budget holds for a model, per
// KV dtype, after the weights — the arithmetic behind `kvgrid plan`.
//
// Pure functions of a ModelConfig and a few numbers: no device, no files, no allocation of
// the pool itself. The figures are the ones the pool would produce: bytes per token from the
// exact row storage of each dtype (kernels::KvRowLayoutFor, metadata included) and whole
// blocks, since the pool allocates blocks. Thread-safe (no state).
#ifndef KVGRID_WORKER_KV_KV_PLANNER_H_
#define KVGRID_WORKER_KV_KV_PLANNER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "model/model_config.h"

namespace kvgrid::worker {

// One KV dtype combination and what the budget holds with it.
struct KvPlanRow {
  std::string dtype;  // "fp16", ..., or "int8k-int4v" for int8 keys with int4 values
  kernels::KvDType k_dtype = kernels::KvDType::kF16;
  kernels::KvDType v_dtype = kernels::KvDType::kF16;
  int64_t bytes_per_token = 0;  // K + V of one token across all layers and KV heads
  int64_t bytes_per_block = 0;  // bytes_per_token * block_size
  int64_t block_size = 0;
  int64_t memory_bytes = 0;         // the whole budget
  std::string weight_dtype;         // WeightFootprint::dtype
  int64_t weight_params = 0;        // CountParameters(config)
  int64_t weight_bytes = 0;         // WeightFootprint::bytes
  int64_t kv_budget_bytes = 0;      // memory_bytes - weight_bytes
  int64_t blocks = 0;               // floor(kv_budget_bytes / bytes_per_block)
  int64_t max_tokens = 0;           // blocks * block_size
  int64_t context = 0;              // tokens one sequence may reach
  // Blocks one sequence holds at most: ceil(context / block_size); with a KV window, at most
  // the blocks of window - 1 + prefill_chunk tokens plus one (never more than the former).
  int64_t blocks_per_sequence = 0;
  int64_t max_sequences = 0;        // floor(blocks / blocks_per_sequence), each at full context
  // The model's KV window (ModelConfig::KvWindow(): every layer slides); 0 when none.
  int64_t kv_window = 0;
  int64_t prefill_chunk = 0;        // tokens one step computes, as planned
  // The longest context one sequence can reach by the KV cache alone: max_tokens; with a KV
  // window the model's max_position_embeddings once one windowed sequence fits (the KV does
  // not bound it), else 0.
  int64_t max_context = 0;
  int64_t max_positions = 0;  // the model's max_position_embeddings
};

// The (K, V) dtype pairs the planner reports, in output order: fp32, fp16, bf16, int8, int4,
// int8 keys with int4 values (keys are the more sensitive to quantization), and fp8_e4m3.
struct KvDTypePair {
  std::string_view name;
  kernels::KvDType k;
  kernels::KvDType v;
};
const std::vector<KvDTypePair>& PlannedKvDTypes();

// Parameters of a Llama-family checkpoint as the config describes it: token embeddings,
// lm_head unless tied, per layer q/k/v/o (+ q/k/v biases when attention_bias, + the o_proj
// bias that Llama/Mistral add with attention_bias; Qwen2 has none), gate/up/down (+ their
// biases when mlp_bias), the two RMSNorm weights, and the final norm.
[[nodiscard]] int64_t CountParameters(const model::ModelConfig& config);

// K + V bytes of one token across all layers: num_layers * num_kv_heads *
// (KvRowLayoutFor(k, head_dim).total() + KvRowLayoutFor(v, head_dim).total()).
[[nodiscard]] int64_t KvBytesPerToken(const model::ModelConfig& config, kernels::KvDType k,
                                      kernels::KvDType v);

// The weights as a worker holds them, for planning.
struct WeightFootprint {
  std::string dtype;   // "bf16", "q4_0", "awq", ...
  int64_t params = 0;  // CountParameters(config)
  int64_t bytes = 0;
};

// What the weights take for `weight_dtype`:
//   fp32 / fp16 / bf16 (also float32, float16, bfloat16): every parameter at that size;
//   (GGUF files, with ggml's other blocks — Q5_0, Q5_1, IQ4_NL, the K-quants Q2_K..Q6_K — are
//   counted as stored by `kvgrid plan`, not here.)
//   q8_0 / q4_0 / q4_1: the layers' linear weights in blocks of 32 (34, 18, 20 bytes; a matrix
//     whose input width is not a multiple of 32 stays unquantized), the head in Q8_0 blocks (a
//     copy beside the embedding when tied), everything else unquantized;
//   auto: a config with an AWQ/GPTQ quantization_config: the linear weights in the 20-byte
//     blocks kvgrid holds 4-bit checkpoints in (unquantized when their input width is not a
//     multiple of 32, or for AWQ not of the group size), everything else unquantized;
//     otherwise every parameter at the config's torch_dtype.
// "Unquantized" is the config's torch_dtype size (fp32 when it has none).
// Errors: INVALID_ARGUMENT naming the unknown dtype (or the config's torch_dtype).
absl::StatusOr<WeightFootprint> PlanWeights(const model::ModelConfig& config,
                                            std::string_view weight_dtype);

// One row per PlannedKvDTypes() entry for a budget of `memory_bytes` that must also hold
// `weights`. A context larger than the KV budget gives max_sequences 0, not an error.
// `prefill_chunk` is the most tokens one engine step computes (--max-num-batched-tokens): a
// sliding-window model's sequence (every layer slides) holds only its window and one step's
// tokens, so its concurrency is bounded by window-sized sequences and its context not by the
// KV at all. Models where only some layers slide are planned as full attention (their blocks
// cannot be freed: one block id indexes every layer).
// Errors: INVALID_ARGUMENT when memory_bytes, context, prefill_chunk or weights.bytes is not
// positive, block_size is not 8, 16 or 32, or the weights leave no room for the KV cache (the
// message gives both numbers).
absl::StatusOr<std::vector<KvPlanRow>> PlanKvCapacity(const model::ModelConfig& config,
                                                      int64_t memory_bytes, int64_t context,
                                                      int64_t block_size,
                                                      const WeightFootprint& weights,
                                                      int64_t prefill_chunk = 8192);

// The rows of one card turned into a context-parallel group's of `cp_size` such cards (each
// holding the same weights and every cp_size-th block of each sequence): blocks, max tokens
// and max_context grow cp_size times; a sequence of n blocks takes ceil(n / cp_size) of each
// card's, which bounds max_sequences. With a KV window, max_context is max_positions once
// each card holds its share of one windowed sequence. Per-card fields (bytes, budget,
// weights) stay.
// cp_size 1 changes nothing.
void ApplyContextParallel(int64_t cp_size, std::vector<KvPlanRow>* rows);

// Blocks one sequence of up to `context` tokens holds at most when a step computes at most
// `prefill_chunk` of its tokens: ceil(context / block_size), or with a KV window `kv_window`
// > 0 at most ceil((kv_window - 1 + min(prefill_chunk, context)) / block_size) + 1 (a step
// computing [c, c + chunk) reads keys from c - kv_window + 1, which may start mid-block).
// The bound the engine admits and the coordinator places by.
[[nodiscard]] int64_t SequenceBlocks(int64_t context, int64_t block_size, int64_t kv_window,
                                     int64_t prefill_chunk);

// Device memory one forward step of `max_tokens` tokens returning `max_logit_rows` rows of
// logits takes for activations (fp32 between ops, as CudaLlamaModel keeps them: residual,
// normed input, q/k/v, attention output, gate/up and their product, logits), plus 256 MiB for
// the cuBLAS workspace (kernels::cuda::CublasHandle) and the CUDA libraries' own allocations.
// The attention kernels' split-K partials, which grow with the context, are the executor's to
// add (CudaLlamaModel::AttentionWorkspaceBytes).
[[nodiscard]] int64_t StepWorkspaceBytes(const model::ModelConfig& config, int64_t max_tokens,
                                         int64_t max_logit_rows);

// The KV pool's share of a GPU sized by --gpu-memory-utilization: utilization x total, minus
// what is in use already (weights, the CUDA context, other processes: total - free), minus
// `workspace_bytes`. Errors: INVALID_ARGUMENT naming --gpu-memory-utilization when it is
// outside (0, 1] or leaves no room for the cache (with the numbers).
absl::StatusOr<int64_t> GpuKvBudget(int64_t total_bytes, int64_t free_bytes, double utilization,
                                    int64_t workspace_bytes);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_KV_KV_PLANNER_H_
