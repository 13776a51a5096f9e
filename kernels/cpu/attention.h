// Causal attention for a batch of sequences whose K/V live in paged arenas.
//
// One kernel serves prefill, chunked prefill and decode: sequence s contributes query tokens
// [query_start[s], query_start[s+1]); they are the last tokens of its context of seq_lens[s]
// tokens, so query token i of s sits at position p = seq_lens[s] - q_len + i and attends to
// positions 0..p, or with a sliding window W > 0 to positions p - W < j <= p (Mistral's and
// Qwen2's definition, as in transformers). The K/V of those tokens must already be written
// (KvWrite). Table entries of blocks wholly before the window of a sequence's first query are
// never read: the block manager frees such blocks and leaves holes (-1) there.
// Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
//
// K and V may have different dtypes. Quantized rows are decoded inside the kernel's dot
// products and weighted sums (kernels/cpu/kv_quant.h), a few channels at a time, so no
// full-precision copy of the cache is made.
#ifndef KVGRID_KERNELS_CPU_ATTENTION_H_
#define KVGRID_KERNELS_CPU_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/kv_quant.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cpu {

struct PagedAttentionParams {
  const float* query = nullptr;          // [num_tokens, num_heads, head_dim]
  float* output = nullptr;               // [num_tokens, num_heads, head_dim]
  // Arena planes as KvWrite fills them, R = KvRowLayoutFor(dtype, head_dim):
  const void* k_cache = nullptr;         // [num_blocks, num_kv_heads, block_size, R.value_bytes]
  const void* v_cache = nullptr;         // [num_blocks, num_kv_heads, block_size, R.value_bytes]
  const void* k_meta = nullptr;          // [num_blocks, num_kv_heads, block_size, R.meta_bytes]
  const void* v_meta = nullptr;          //   (null for float dtypes)
  KvDType k_dtype = KvDType::kF32;
  KvDType v_dtype = KvDType::kF32;
  const int32_t* block_tables = nullptr; // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;     // [num_seqs]
  const int32_t* query_start = nullptr;  // [num_seqs + 1], query_start[0] == 0
  int64_t num_seqs = 0;
  int64_t num_tokens = 0;                // == query_start[num_seqs]
  int64_t max_blocks_per_seq = 0;
  int64_t num_blocks = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;
  float scale = 0.f;                     // usually 1 / sqrt(head_dim)
  // Sliding window in tokens (the layer's; 0 = full causal attention): query position p sees
  // keys p - window < j <= p.
  int64_t window = 0;
  // kFast lets int8 K/V use integer dot products that round the queries and the softmax
  // weights to int8 (kernels/cpu/kv_int8_vnni.h); kExact keeps fp32 arithmetic on the
  // decoded rows.
  KvKernelPrecision precision = KvKernelPrecision::kFast;
  // Context parallelism: block i of every sequence lives on rank i % cp_size, and this call
  // is rank cp_rank's share. It attends over the positions of its own blocks only (the
  // table's entries for the other ranks' blocks are never read and may be -1) and normalizes
  // each head's output over them; MergeAttentionPartials then combines the ranks' outputs,
  // through their log-sum-exp, into exactly what one call over every block computes.
  int64_t cp_size = 1;
  int64_t cp_rank = 0;
  // [num_tokens, num_heads], or null: log(sum_j exp(scale * q.k_j)) over the positions this
  // call attended, -inf for a head that attended none (its output is then 0).
  float* lse = nullptr;

  // INVALID_ARGUMENT naming the field: null pointers (a meta plane is required exactly when
  // its dtype has metadata), an odd head_dim, heads not divisible by kv heads,
  // query_start not a prefix sum ending at num_tokens, a sequence with more queries than
  // context or more context than its block table, a negative window, cp_rank outside
  // [0, cp_size), a block id outside the arena among the blocks the queries read (this
  // rank's, from the window of the sequence's first query on).
  absl::Status Validate() const;
};

// Parallel over (query token, KV head) pairs for prefill-like sequences; for decode-like ones
// (few query tokens) over (query token, context chunk) pairs covering all KV heads, whose
// partial softmax results are merged at the end. The query heads of a group share each K/V
// row read, block by block. Softmax in fp32 with the maximum subtracted (per chunk, then
// rescaled to the overall maximum when merging). Errors: those of Validate().
absl::Status PagedAttention(const PagedAttentionParams& params);

// Exact attention from `parts` results over disjoint sets of a context's positions (the
// context-parallel ranks' PagedAttention outputs and lse): for each of `rows` (token, head)
// rows, out = sum_c exp(lse_c - L) out_c with L = log(sum_c exp(lse_c)). `outputs` is
// [parts, rows, head_dim], `lses` [parts, rows]; `lse_out` ([rows]) may be null; `out` must not
// overlap `outputs`. A row no part attended (every lse_c = -inf) gets 0 and L = -inf; a NaN
// lse gives the row NaN.
void MergeAttentionPartials(const float* outputs, const float* lses, int64_t parts,
                            int64_t rows, int64_t head_dim, float* out, float* lse_out);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_ATTENTION_H_
