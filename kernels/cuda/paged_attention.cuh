// Causal attention over the paged KV cache on the GPU: decode, prefill, chunked prefill and
// batches mixing them, for every KV dtype pair (kernels/kv_dtype.h), dequantizing inside the
// kernels so no full-precision copy of the cache is ever made.
//
// Same contract as kernels/cpu/attention.h (the reference these kernels are checked against,
// tests labelled `gpu`): sequence s owns query tokens [query_start[s], query_start[s+1]), the
// last tokens of its context of seq_lens[s] tokens, so its query token i sits at position
// seq_lens[s] - q_len + i and attends to positions 0..that position (with a sliding window W:
// to positions p - W < j <= p only); query head h reads KV head h / (num_heads / num_kv_heads).
// Block-table entries before the window of a sequence's first query are never read, so the
// block manager's holes (-1) there are fine.
//
// Two kernel families, both templated on the K and V dtypes and head_dim, chosen per sequence
// on the device (the host never reads the device arrays, so the call does not synchronize):
//   decode (exactly one query token): split-K ("flash-decoding"). The context is cut into
//     chunks; one thread block per (chunk, KV head, sequence) scores its chunk against all the
//     query heads of that KV head, so each K/V row is read from memory once per step. Chunks
//     of one sequence write partial (max, sum, output) to the workspace and a second kernel
//     merges them, so a single long sequence still fills the GPU.
//   prefill (two or more query tokens): flash-style tiles. One thread block per (tile of 64
//     (token, query head) rows, KV head, sequence) walks 32-key tiles of the cache up to the
//     tile's causal bound with an online softmax; earlier chunks of a chunked prefill are just
//     cached keys.
// All arithmetic is fp32; quantized rows decode to exactly the floats kernels/cpu/kv_quant.h
// produces, so the CPU and GPU results differ only in the order of fp32 sums.
//
// Limits, and what would lift them: head_dim 64 or 128 (the row slices assume a multiple of
// 64); the products run on CUDA cores, not tensor cores (which would round queries to
// fp16/tf32 and leave the CPU reference's numerics); a sequence with a few query tokens
// (speculative decoding) takes the prefill path, which does not split its context.
#ifndef KVGRID_KERNELS_CUDA_PAGED_ATTENTION_CUH_
#define KVGRID_KERNELS_CUDA_PAGED_ATTENTION_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cuda {

// The fields of kernels/cpu/attention.h's PagedAttentionParams, with device pointers, plus the
// host-side bounds and workspace a GPU launch needs. All pointers are device memory; the
// value planes, query and output must be 16-byte aligned (cudaMalloc gives 256).
struct PagedAttentionParams {
  const float* query = nullptr;          // [num_tokens, num_heads, head_dim]
  float* output = nullptr;               // [num_tokens, num_heads, head_dim]; must not alias query
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
  int64_t block_size = 0;                // a power of two, at most 256
  int64_t head_dim = 0;                  // 64 or 128
  float scale = 0.f;                     // usually 1 / sqrt(head_dim)
  // Sliding window in tokens (the layer's; 0 = full causal attention): query position p sees
  // keys p - window < j <= p. Decode chunks start at the window, so a windowed sequence needs
  // ceil(window / chunk) chunks however long its context.
  int64_t window = 0;
  // [num_tokens, num_heads], or null: log(sum_j exp(scale * q.k_j)) over the positions each
  // query attended, -inf where it attended none (its output is then 0). Context parallelism
  // (kernels/cpu/attention.h): a rank's table holds -1 for the other ranks' blocks, which take
  // no weight, so output and lse are the rank's share, for LaunchMergeAttentionPartials.
  float* lse = nullptr;

  // Host-side bounds on the device arrays, which the host does not read. They size the grids
  // (and the workspace), so they must hold for every sequence; 0 picks the loosest bound.
  int64_t max_seq_len = 0;    // >= every seq_lens[s]; 0: max_blocks_per_seq * block_size
  int64_t max_query_len = 0;  // >= every sequence's query count; 0: num_tokens
  // Scratch for the split-K partial results: PagedAttentionWorkspaceBytes(*this) bytes, 16-byte
  // aligned; may be null when that is 0. Not read before it is written; one launch at a time.
  void* workspace = nullptr;  // [workspace_bytes]
  int64_t workspace_bytes = 0;

  // INVALID_ARGUMENT naming the field: null pointers (a meta plane is required exactly when
  // its dtype has metadata), misaligned pointers, sizes out of range, a head_dim other than
  // 64 or 128, a block_size that is not a power of two <= 256, heads not divisible by KV heads,
  // a non-positive scale, a window outside [0, 2^30], bounds out of range, or a workspace
  // smaller than needed.
  //
  // The contents of the device arrays cannot be checked without a copy, so the kernels
  // defend memory instead: a context is cut at max_seq_len, max_blocks_per_seq * block_size
  // and 2^30 tokens, block ids outside [0, num_blocks) are masked (their positions get no weight),
  // and a sequence with more queries than context yields zeros where no key is visible. The
  // block manager produces valid tables; CPU Validate() checks host copies in tests.
  absl::Status Validate() const;
};

// Bytes of workspace LaunchPagedAttention needs for these params (a function of the sizes
// and bounds only, not of device contents): 0 when no sequence can span more than one
// decode chunk. For 64 sequences of 32K tokens, 8 KV heads, 32 heads of 128 channels: 64
// chunks of 512 tokens, 68 MB (written and read back: 1.6% of the 8.6 GB of fp16 KV read).
int64_t PagedAttentionWorkspaceBytes(const PagedAttentionParams& params);

// The most PagedAttentionWorkspaceBytes asks of any step within `bounds`: every batch of 1 to
// bounds.num_seqs sequences whose longest context is any length up to bounds.max_seq_len
// (0: max_blocks_per_seq * block_size); heads, head_dim, block_size and window as given.
// What an executor reserves once so that no step grows the workspace. The chunk length the
// kernels pick grows with the work, so the bytes are not monotone in the context: the most
// lies at a context just below a switch to longer chunks, or at the bound.
int64_t PagedAttentionMaxWorkspaceBytes(const PagedAttentionParams& bounds);

// Enqueues the decode kernels (and their merge) and the prefill kernel on `stream`; no host
// synchronization. Thread-safe for distinct workspaces. Errors: Validate()'s, or INTERNAL /
// RESOURCE_EXHAUSTED naming the CUDA call.
absl::Status LaunchPagedAttention(const PagedAttentionParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_PAGED_ATTENTION_CUH_
