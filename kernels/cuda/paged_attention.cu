#include "kernels/cuda/paged_attention.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// Positions beyond this are cut (documented on Validate); keeps every position, and every
// sum of a position and a tile size, inside int32 on the device.
constexpr int64_t kMaxContext = int64_t{1} << 30;

// Split-K decode: one block of kDecodeThreads per (chunk, KV head [, row tile], sequence).
// Chunks are powers of two in [kMinChunk, kMaxChunk] tokens, picked so that the grid has
// about kDecodeTargetBlocks blocks (a few waves on a 100+ SM part): short batches get short
// chunks and more parallelism, big batches long chunks and fewer partial results to merge.
// kMaxChunk bounds the per-block score buffer (kRows x chunk floats of shared memory).
constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int64_t kMinChunk = 64;
constexpr int64_t kMaxChunk = 512;
constexpr double kDecodeTargetBlocks = 2048;
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / kWarpSize;

// Prefill: kTileM (token, query head) rows by kTileN keys per step, kPrefillThreads threads as
// 16 x 8: thread (ty, tx) owns rows 4ty..4ty+3, keys tx + 8k of each key tile, and channels
// 4tx + 32c of the output.
constexpr int kPrefillThreads = 128;
constexpr int kTileM = 64;
constexpr int kTileN = 32;
constexpr int kRowsPerThread = 4;
// p_s rows are padded by a float so that the rows written together start in different banks.
constexpr int kPStride = kTileN + 1;
constexpr int kDefaultSmemLimit = 48 * 1024;

__host__ __device__ constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// KV row slices. Every kernel moves rows in slices of 8 consecutive channels,
// [8 sub, 8 sub + 8): 32 bytes of fp32, 16 of fp16/bf16, 8 of int8/fp8, 4 of int4 (which never
// straddle an int4 group of 32 channels). head_dim is a multiple of 64, so every slice offset
// is a multiple of its size and the loads are naturally aligned vector loads.

template <KvDType D>
constexpr int kSliceWords = D == KvDType::kF32                            ? 8
                            : (D == KvDType::kF16 || D == KvDType::kBF16) ? 4
                            : (D == KvDType::kInt8 || D == KvDType::kFp8E4m3) ? 2
                                                                          : 1;

template <KvDType D, int kHeadDim>
constexpr int64_t kRowBytes = int64_t{4} * kSliceWords<D> * (kHeadDim / 8);

template <KvDType D, int kHeadDim>
constexpr int64_t kMetaBytes = (D == KvDType::kInt8 || D == KvDType::kFp8E4m3) ? 2
                               : D == KvDType::kInt4                           ? 2 * (kHeadDim / 32)
                                                     : 0;

template <KvDType D>
struct Slice {
  uint32_t w[kSliceWords<D>];  // the slice's bytes as stored
  uint32_t meta;  // int8, fp8: the row's fp16 scale; int4: the group's word; else 0
};

template <KvDType D>
__device__ __forceinline__ Slice<D> ZeroSlice() {
  Slice<D> s;
#pragma unroll
  for (int i = 0; i < kSliceWords<D>; ++i) s.w[i] = 0;
  s.meta = 0;
  return s;
}

// Slice `sub` of arena row `row` (row = (block * num_kv_heads + kv_head) * block_size + slot;
// 64-bit, since an arena plane may be larger than 2^31 bytes).
template <KvDType D, int kHeadDim>
__device__ __forceinline__ Slice<D> LoadSlice(const uint8_t* __restrict__ values,
                                              const uint8_t* __restrict__ meta, int64_t row,
                                              int sub) {
  constexpr int kWords = kSliceWords<D>;
  Slice<D> s;
  const uint8_t* p = values + row * kRowBytes<D, kHeadDim> + sub * (4 * kWords);
  if constexpr (kWords == 8) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    s.w[0] = a.x, s.w[1] = a.y, s.w[2] = a.z, s.w[3] = a.w;
    s.w[4] = b.x, s.w[5] = b.y, s.w[6] = b.z, s.w[7] = b.w;
  } else if constexpr (kWords == 4) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
    s.w[0] = a.x, s.w[1] = a.y, s.w[2] = a.z, s.w[3] = a.w;
  } else if constexpr (kWords == 2) {
    const uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
    s.w[0] = a.x, s.w[1] = a.y;
  } else {
    s.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  }
  if constexpr (D == KvDType::kInt8 || D == KvDType::kFp8E4m3) {
    s.meta = __ldg(reinterpret_cast<const unsigned short*>(meta + row * 2));
  } else if constexpr (D == KvDType::kInt4) {
    // Channels 8 sub.. lie in group 8 sub / 32.
    s.meta = __ldg(reinterpret_cast<const unsigned short*>(meta + row * kMetaBytes<D, kHeadDim> +
                                                           2 * (sub / 4)));
  } else {
    s.meta = 0;
  }
  return s;
}

__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// Decodes a slice: channel 8 sub + e is x[e] * (the returned factor), and that product is
// exactly the float kernels/cpu/kv_quant.h's DequantizeRow gives (float types: factor 1;
// int8: float(q) * s; int4: s * float(q - z); fp8: the code's value / 256 times 256 s, the
// same product as value * s since the factor 256 is exact). Returning the factor separately
// lets the decode kernel apply a row's or group's scale once per slice instead of once per
// channel.
//
// Integer codes become floats with the 2^23 trick (0x4B000000 | b is the float 2^23 + b for
// b < 2^23), a logic op and an add instead of the quarter-rate int-to-float conversion; the
// results are exact small integers.
template <KvDType D>
__device__ __forceinline__ float DecodeSlice(const Slice<D>& s, float (&x)[8]) {
  if constexpr (D == KvDType::kF32) {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = __uint_as_float(s.w[e]);
    return 1.f;
  } else if constexpr (D == KvDType::kF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = HalfBitsToFloat(s.w[i] & 0xffffu);
      x[2 * i + 1] = HalfBitsToFloat(s.w[i] >> 16);
    }
    return 1.f;
  } else if constexpr (D == KvDType::kBF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(s.w[i] << 16);
      x[2 * i + 1] = __uint_as_float(s.w[i] & 0xffff0000u);
    }
    return 1.f;
  } else if constexpr (D == KvDType::kInt8) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t biased = s.w[i] ^ 0x80808080u;  // each byte q + 128, in [0, 255]
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        // Byte b of `biased` under the exponent byte 0x4B: the float 2^23 + q + 128.
        const uint32_t bits = __byte_perm(biased, 0x4B000000u, 0x7540u | b);
        x[4 * i + b] = __uint_as_float(bits) - 8388736.f;  // 2^23 + 128
      }
    }
    return HalfBitsToFloat(s.meta);
  } else if constexpr (D == KvDType::kFp8E4m3) {
    // Two codes at a time: bytes b0, b1 become the high bytes of two 16-bit lanes, then the
    // sign stays and the exponent and mantissa move down a bit, giving the fp16 pair of
    // (values / 256) (numeric.cuh's Fp8E4m3ToF16BitsOver256).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t t = __byte_perm(s.w[i], 0u, half == 0 ? 0x1404u : 0x3424u);
        const uint32_t h2 = (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
        x[4 * i + 2 * half] = HalfBitsToFloat(h2 & 0xffffu);
        x[4 * i + 2 * half + 1] = HalfBitsToFloat(h2 >> 16);
      }
    }
    return HalfBitsToFloat(s.meta) * 256.f;
  } else {
    static_assert(D == KvDType::kInt4);
    const float bias = 8388608.f + static_cast<float>(s.meta & 0xfu);  // 2^23 + zero point
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // channel 2i is byte i's low nibble
      x[e] = __uint_as_float(0x4B000000u | ((s.w[0] >> (4 * e)) & 0xfu)) - bias;
    }
    return HalfBitsToFloat(s.meta & 0xfff0u);
  }
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  }
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// Sums each of kRows per-lane partial dot products over the kLanes lanes of an aligned lane
// group (kRows <= kLanes, both powers of two) and returns, to lane `sub` of the group, the total
// of row sub / (kLanes / kRows). Each halving step trades half of the rows with the partner
// lane kLanes / 2 away, so 8 rows over 16 lanes cost 4 + 2 + 1 + 1 = 8 shuffles instead of
// 8 x 4 = 32 for a butterfly per row: the shuffles, not the loads, would otherwise bound
// decode for int4 and int8 K.
template <int kRows, int kLanes>
__device__ __forceinline__ float GroupReduceRows(const float (&v)[kRows], int sub) {
  if constexpr (kRows == 1) {
    float x = v[0];
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
    return x;
  } else {
    constexpr int kHalf = kRows / 2;
    constexpr int kOff = kLanes / 2;
    const bool upper = (sub & kOff) != 0;  // keeps rows [kHalf, kRows), else [0, kHalf)
    float kept[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? v[i] : v[i + kHalf];
      const float keep = upper ? v[i + kHalf] : v[i];
      kept[i] = keep + __shfl_xor_sync(kFullMask, send, kOff);
    }
    return GroupReduceRows<kHalf, kOff>(kept, sub);
  }
}

// Everything the kernels read, by value. Shapes as in PagedAttentionParams.
struct KernelArgs {
  const float* query;           // [num_tokens, num_heads, head_dim]
  float* output;                // [num_tokens, num_heads, head_dim]
  const uint8_t* k_values;      // [num_blocks, num_kv_heads, block_size, K value bytes]
  const uint8_t* v_values;      // [num_blocks, num_kv_heads, block_size, V value bytes]
  const uint8_t* k_meta;        // [num_blocks, num_kv_heads, block_size, K meta bytes] or null
  const uint8_t* v_meta;        // [num_blocks, num_kv_heads, block_size, V meta bytes] or null
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* query_start;   // [num_seqs + 1]
  float* part_out;              // [num_seqs, max_chunks, num_heads, head_dim] or null
  float* part_max;              // [num_seqs, max_chunks, num_heads]: scaled score maximum
  float* part_sum;              // [num_seqs, max_chunks, num_heads]: sum of exp(score - max)
  float* lse;                   // [num_tokens, num_heads] or null: log-sum-exp of the scores
  int64_t max_blocks_per_seq;
  int64_t num_blocks;
  int num_heads;
  int num_kv_heads;
  int group;         // num_heads / num_kv_heads
  int row_tiles;     // decode: ceil(group / kRows)
  int block_shift;   // log2(block_size)
  int max_ctx;       // every context is cut here (see Plan)
  int chunk_tokens;  // decode chunk
  int max_chunks;    // ceil(min(max_ctx, window or max_ctx) / chunk_tokens)
  int window;        // sliding window in tokens; 0 = full causal attention
  float scale;
};

// Arena row of position `pos` of a sequence whose position `pos` lives in block `block`.
__device__ __forceinline__ int64_t ArenaRow(const KernelArgs& a, int32_t block, int kv_head,
                                            int pos) {
  return ((static_cast<int64_t>(block) * a.num_kv_heads + kv_head) << a.block_shift) +
         (pos & ((1 << a.block_shift) - 1));
}

// The context a sequence's queries see: cut at max_ctx, which never exceeds its table.
__device__ __forceinline__ int SequenceContext(const KernelArgs& a, int s) {
  return min(a.seq_lens[s], a.max_ctx);
}

// First key a query at position ctx - 1 sees: ctx - window with a window, else 0.
__device__ __forceinline__ int WindowStart(const KernelArgs& a, int ctx) {
  return a.window > 0 ? max(0, ctx - a.window) : 0;
}

// Decode chunks of a sequence with context `ctx` (cut from its window start on); at least 1, so
// that a sequence with an empty (invalid) context still gets its output written (as zeros).
__device__ __forceinline__ int DecodeChunks(const KernelArgs& a, int ctx) {
  const int span = ctx - WindowStart(a, ctx);
  return span <= 0 ? 1 : static_cast<int>(CeilDiv(span, a.chunk_tokens));
}

// ---------------------------------------------------------------------------------------------
// Split-K decode.
//
// Block (chunk c, KV head g / row tile rt, sequence s) with one query token t: rows r < kRows
// are query heads g * group + rt * kRows + r (rows past the group are zero queries whose
// results are dropped). Three passes over the chunk's positions [begin, end):
//   1. scores: each key is read by a group of kLanesPerKey = head_dim / 8 lanes, one slice
//      each, dotted with the lane's 8 channels of every query row (held in registers) and
//      summed across the group with shuffles (GroupReduceRows). A warp step covers
//      32 / kLanesPerKey consecutive keys, i.e. 32 slices that are contiguous in the arena
//      (one head's rows of a block are contiguous), so every warp load is a single coalesced
//      segment; kUnroll independent steps are in flight per warp before any is used.
//   2. softmax within the chunk: max-subtracted exp, kept in shared memory with the max and
//      sum per row.
//   3. values: the same lane mapping, each lane accumulating p * v for its 8 channels of
//      every row over its keys; lane groups and then warps are summed at the end.
// A sequence of one chunk writes the normalized output; otherwise the block writes its
// unnormalized output, max and sum to the workspace for DecodeMergeKernel.

template <KvDType D>
constexpr int kUnroll = kSliceWords<D> >= 4 ? 4 : 16 / kSliceWords<D>;  // >= 64 bytes per lane

inline int64_t DecodeSmemBytes(int rows, int head_dim, int64_t chunk, int block_shift) {
  const int64_t floats = int64_t{rows} * head_dim                   // q_s
                         + int64_t{rows} * chunk                    // p_s
                         + int64_t{kDecodeWarps} * rows * head_dim  // red_s
                         + 2 * rows;                                // stat_s
  const int64_t block_ids = (chunk >> block_shift) + 2;  // blocks a chunk can touch, rounded up
  return 4 * floats + 4 * block_ids;
}

template <KvDType KD, KvDType VD, int kHeadDim, int kRows>
__global__ void __launch_bounds__(kDecodeThreads) DecodeKernel(const KernelArgs a) {
  constexpr int kLanesPerKey = kHeadDim / 8;
  constexpr int kKeysPerStep = kWarpSize / kLanesPerKey;
  constexpr int kLanesPerRow = kLanesPerKey / kRows;  // lanes left holding each row's score
  static_assert(kLanesPerKey * kKeysPerStep == kWarpSize && kLanesPerRow >= 1);

  const int s = blockIdx.z;
  const int t = a.query_start[s];
  if (a.query_start[s + 1] - t != 1) return;  // not a decode sequence: the prefill kernel's
  const int ctx = SequenceContext(a, s);
  const int chunk = blockIdx.x;
  const int num_chunks = DecodeChunks(a, ctx);
  if (chunk >= num_chunks) return;  // shorter than the longest sequence: nothing here
  // Chunks start at the window: positions before it (holes in the table once the block
  // manager freed them) are never read.
  const int begin = WindowStart(a, ctx) + chunk * a.chunk_tokens;
  const int end = max(begin, min(ctx, begin + a.chunk_tokens));  // begin + chunk < 2^31
  const int n = end - begin;
  const int g = blockIdx.y / a.row_tiles;
  const int rt = blockIdx.y % a.row_tiles;
  const int h0 = g * a.group + rt * kRows;
  const int rows = min(kRows, a.group - rt * kRows);

  extern __shared__ float4 dynamic_smem[];
  float* q_s = reinterpret_cast<float*>(dynamic_smem);      // [kRows, kHeadDim]
  float* p_s = q_s + kRows * kHeadDim;                      // [kRows, chunk_tokens]
  float* red_s = p_s + kRows * a.chunk_tokens;              // [kDecodeWarps, kRows, kHeadDim]
  float* stat_s = red_s + kDecodeWarps * kRows * kHeadDim;  // [2, kRows]: max, sum
  int32_t* blk_s = reinterpret_cast<int32_t*>(stat_s + 2 * kRows);  // [blocks of the chunk]

  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  for (int i = tid; i < kRows * kHeadDim; i += kDecodeThreads) {
    const int r = i / kHeadDim;
    q_s[i] =
        r < rows
            ? a.query[(static_cast<int64_t>(t) * a.num_heads + h0 + r) * kHeadDim + i % kHeadDim]
            : 0.f;
  }
  // The chunk's block ids, read once instead of once per lane and key; -1 masks an id outside
  // the arena.
  const int first_block = begin >> a.block_shift;
  const int num_chunk_blocks = n > 0 ? ((end - 1) >> a.block_shift) - first_block + 1 : 0;
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
  for (int i = tid; i < num_chunk_blocks; i += kDecodeThreads) {
    const int32_t id = table[first_block + i];
    blk_s[i] = id >= 0 && id < a.num_blocks ? id : -1;
  }
  __syncthreads();

  const int sub = lane % kLanesPerKey;  // this lane's slice of every row it reads
  const int kk = lane / kLanesPerKey;   // this lane's key within a warp step
  // Position of unroll step u of the iteration at j0: the warps interleave step by step, so a
  // short chunk still spreads over all of them.
  auto step_base = [&](int j0, int u) { return j0 + (u * kDecodeWarps + warp) * kKeysPerStep; };
  constexpr int kStepsPerIter = kDecodeWarps * kKeysPerStep;

  // Pass 1: scaled scores into p_s.
  {
    constexpr int kU = kUnroll<KD>;
    float q[kRows][8];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) q[r][e] = q_s[r * kHeadDim + sub * 8 + e];
    }
    for (int j0 = begin; j0 < end; j0 += kStepsPerIter * kU) {  // uniform over the block
      Slice<KD> sl[kU];
      bool ok[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = step_base(j0, u) + kk;
        const int32_t id = j < end ? blk_s[(j >> a.block_shift) - first_block] : -1;
        ok[u] = id >= 0;
        sl[u] = ok[u] ? LoadSlice<KD, kHeadDim>(a.k_values, a.k_meta, ArenaRow(a, id, g, j), sub)
                      : ZeroSlice<KD>();
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (step_base(j0, u) >= end) continue;  // warp-uniform: the shuffles below stay full
        float x[8];
        const float factor = DecodeSlice<KD>(sl[u], x);
        float dot[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float acc = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc = fmaf(q[r][e], x[e], acc);
          dot[r] = acc * factor;  // int4's factor is per group, so before the lane sum
        }
        const float total = GroupReduceRows<kRows, kLanesPerKey>(dot, sub);
        const int j = step_base(j0, u) + kk;
        if (sub % kLanesPerRow == 0 && j < end) {
          p_s[(sub / kLanesPerRow) * a.chunk_tokens + (j - begin)] =
              ok[u] ? total * a.scale : -INFINITY;
        }
      }
    }
  }
  __syncthreads();

  // Pass 2: p = exp(score - max) per row, one warp per row. A row whose keys are all masked
  // (every block id invalid) has max -inf: shift by 0 instead, so p = 0 and sum = 0 rather
  // than NaN.
  for (int r = warp; r < kRows; r += kDecodeWarps) {
    float* row = p_s + r * a.chunk_tokens;
    float m = -INFINITY;
    for (int i = lane; i < n; i += kWarpSize) m = fmaxf(m, row[i]);
    m = WarpMax(m);
    const float shift = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    for (int i = lane; i < n; i += kWarpSize) {
      const float p = expf(row[i] - shift);
      row[i] = p;
      sum += p;
    }
    sum = WarpSum(sum);
    if (lane == 0) {
      stat_s[r] = m;
      stat_s[kRows + r] = sum;
    }
  }
  __syncthreads();

  // Pass 3: sum_j p_j v_j per row, for this lane's 8 channels.
  float acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }
  {
    constexpr int kU = kUnroll<VD>;
    for (int j0 = begin; j0 < end; j0 += kStepsPerIter * kU) {
      Slice<VD> sl[kU];
      bool ok[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = step_base(j0, u) + kk;
        const int32_t id = j < end ? blk_s[(j >> a.block_shift) - first_block] : -1;
        ok[u] = id >= 0;
        sl[u] = ok[u] ? LoadSlice<VD, kHeadDim>(a.v_values, a.v_meta, ArenaRow(a, id, g, j), sub)
                      : ZeroSlice<VD>();
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (!ok[u]) continue;  // no shuffles here, so lanes may diverge
        const int j = step_base(j0, u) + kk;
        float x[8];
        const float factor = DecodeSlice<VD>(sl[u], x);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float w = p_s[r * a.chunk_tokens + (j - begin)] * factor;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(w, x[e], acc[r][e]);
        }
      }
    }
  }
  // Lanes with the same `sub` hold the same channels for different keys.
#pragma unroll
  for (int off = kLanesPerKey; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(kFullMask, acc[r][e], off);
    }
  }
  if (kk == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red_s[(warp * kRows + r) * kHeadDim + sub * 8 + e] = acc[r][e];
    }
  }
  __syncthreads();

  for (int i = tid; i < rows * kHeadDim; i += kDecodeThreads) {
    const int r = i / kHeadDim;
    const int d = i % kHeadDim;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += red_s[(w * kRows + r) * kHeadDim + d];
    const int h = h0 + r;
    if (num_chunks == 1) {
      const float sum = stat_s[kRows + r];
      a.output[(static_cast<int64_t>(t) * a.num_heads + h) * kHeadDim + d] =
          sum > 0.f ? o / sum : 0.f;
      if (d == 0 && a.lse != nullptr) {
        a.lse[static_cast<int64_t>(t) * a.num_heads + h] =
            sum > 0.f ? stat_s[r] + logf(sum) : -INFINITY;
      }
    } else {
      const int64_t k = (static_cast<int64_t>(s) * a.max_chunks + chunk) * a.num_heads + h;
      a.part_out[k * kHeadDim + d] = o;
      if (d == 0) {
        a.part_max[k] = stat_s[r];
        a.part_sum[k] = stat_s[kRows + r];
      }
    }
  }
}

// Merges the chunks of each multi-chunk decode sequence, one block per (query head, sequence):
// every chunk's sum and output are rescaled from its own max to the overall one. Warps take
// chunks in turn, each lane a fixed slice of channels, so the partial outputs are read as
// coalesced rows.
template <int kHeadDim>
__global__ void __launch_bounds__(kMergeThreads) DecodeMergeKernel(const KernelArgs a) {
  constexpr int kPerLane = kHeadDim / kWarpSize;  // 2 or 4
  const int h = blockIdx.x;
  const int s = blockIdx.y;
  const int t = a.query_start[s];
  if (a.query_start[s + 1] - t != 1) return;
  const int num_chunks = DecodeChunks(a, SequenceContext(a, s));
  if (num_chunks == 1) return;  // the decode kernel wrote the output itself

  __shared__ float max_s[kMergeWarps];
  __shared__ float sum_s[kMergeWarps];
  __shared__ float red_s[kMergeWarps][kHeadDim];
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  // Chunk c's entry is first + c * num_heads.
  const int64_t first = static_cast<int64_t>(s) * a.max_chunks * a.num_heads + h;

  float m = -INFINITY;
  for (int c = tid; c < num_chunks; c += kMergeThreads) {
    m = fmaxf(m, a.part_max[first + static_cast<int64_t>(c) * a.num_heads]);
  }
  m = WarpMax(m);
  if (lane == 0) max_s[warp] = m;
  __syncthreads();
  m = max_s[0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) m = fmaxf(m, max_s[w]);
  const float shift = m == -INFINITY ? 0.f : m;  // all chunks masked: weights 0, not NaN

  float acc[kPerLane] = {};
  float sum = 0.f;
  for (int c = warp; c < num_chunks; c += kMergeWarps) {
    const int64_t k = first + static_cast<int64_t>(c) * a.num_heads;
    const float w = expf(a.part_max[k] - shift);  // a masked chunk's -inf gives 0
    sum = fmaf(w, a.part_sum[k], sum);
    const float* o = a.part_out + k * kHeadDim + lane * kPerLane;
    if constexpr (kPerLane == 4) {
      const float4 v = *reinterpret_cast<const float4*>(o);
      acc[0] = fmaf(w, v.x, acc[0]);
      acc[1] = fmaf(w, v.y, acc[1]);
      acc[2] = fmaf(w, v.z, acc[2]);
      acc[3] = fmaf(w, v.w, acc[3]);
    } else {
      const float2 v = *reinterpret_cast<const float2*>(o);
      acc[0] = fmaf(w, v.x, acc[0]);
      acc[1] = fmaf(w, v.y, acc[1]);
    }
  }
  if (lane == 0) sum_s[warp] = sum;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) red_s[warp][lane * kPerLane + e] = acc[e];
  __syncthreads();
  for (int d = tid; d < kHeadDim; d += kMergeThreads) {
    float o = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) {
      o += red_s[w][d];
      total += sum_s[w];
    }
    a.output[(static_cast<int64_t>(t) * a.num_heads + h) * kHeadDim + d] =
        total > 0.f ? o / total : 0.f;
    if (d == 0 && a.lse != nullptr) {
      a.lse[static_cast<int64_t>(t) * a.num_heads + h] = total > 0.f ? m + logf(total) : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill (sequences with two or more query tokens).
//
// Block (row tile, KV head g, sequence s). The sequence's rows are its (query token, head of
// g's group) pairs, token-major, q_len * group of them; the tile holds rows [m0, m0 + 64), so a
// GQA group shares every K/V tile it loads and no rows are padded for odd group sizes. Row m
// is token m / group at position first_pos + m / group and sees keys 0..that position; the
// tile walks keys [0, kv_end), kv_end one past its last row's position, kTileN at a time:
//   load and dequantize the K and V tiles into shared memory (fp32, the exact floats of
//   DequantizeRow; slices of 8 channels, consecutive threads reading consecutive slices of a
//   row), S = Q K^T (4 x 4 per thread), causal mask, online softmax (running max m and sum l
//   per row, previous output rescaled by exp(m_old - m_new)), O += P V.
// Shared memory rows are padded by 4 floats so the float4 reads of 8 different keys hit
// distinct banks.

template <int kHeadDim>
constexpr int kPrefillStride = kHeadDim + 4;

template <int kHeadDim>
constexpr int64_t PrefillSmemBytes() {
  return 4 * (int64_t{kTileM} * kPrefillStride<kHeadDim>        // q_s
              + 2 * int64_t{kTileN} * kPrefillStride<kHeadDim>  // k_s, v_s
              + int64_t{kTileM} * kPStride                      // p_s
              + kTileN);                                        // key_ok_s
}

template <KvDType KD, KvDType VD, int kHeadDim>
__global__ void __launch_bounds__(kPrefillThreads) PrefillKernel(const KernelArgs a) {
  constexpr int kStride = kPrefillStride<kHeadDim>;
  constexpr int kSlices = kHeadDim / 8;    // slices per row
  constexpr int kChunks4 = kHeadDim / 32;  // float4 output groups per thread
  static_assert(kTileM == (kPrefillThreads / 8) * kRowsPerThread && kTileN == 8 * 4);

  const int s = blockIdx.z;
  const int q_begin = a.query_start[s];
  const int q_len = a.query_start[s + 1] - q_begin;
  if (q_len < 2) return;  // decode sequences (and empty ones) are the decode kernel's
  const int group = a.group;
  const int total_rows = q_len * group;
  const int m0 = blockIdx.x * kTileM;
  if (m0 >= total_rows) return;
  const int g = blockIdx.y;
  const int ctx = SequenceContext(a, s);
  const int first_pos = ctx - q_len;  // < 0 only for invalid input: those rows see no keys

  extern __shared__ float4 dynamic_smem[];
  float* q_s = reinterpret_cast<float*>(dynamic_smem);              // [kTileM, kStride]
  float* k_s = q_s + kTileM * kStride;                              // [kTileN, kStride]
  float* v_s = k_s + kTileN * kStride;                              // [kTileN, kStride]
  float* p_s = v_s + kTileN * kStride;                              // [kTileM, kPStride]
  int* key_ok_s = reinterpret_cast<int*>(p_s + kTileM * kPStride);  // [kTileN]

  const int tid = threadIdx.x;
  const int ty = tid / 8;
  const int tx = tid % 8;

  // Q tile; rows past the sequence are zero.
  for (int i = tid; i < kTileM * (kHeadDim / 4); i += kPrefillThreads) {
    const int r = i / (kHeadDim / 4);
    const int c4 = i % (kHeadDim / 4);
    const int m = m0 + r;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < total_rows) {
      const int64_t row =
          static_cast<int64_t>(q_begin + m / group) * a.num_heads + g * group + m % group;
      v = __ldg(reinterpret_cast<const float4*>(a.query + row * kHeadDim) + c4);
    }
    *reinterpret_cast<float4*>(q_s + r * kStride + 4 * c4) = v;
  }

  int pos[kRowsPerThread];  // the last key each of this thread's rows sees; -1: none
  int lo[kRowsPerThread];   // the first (the window's start; 0 without a window)
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int m = m0 + ty * kRowsPerThread + i;
    pos[i] = m < total_rows ? max(first_pos + m / group, -1) : -1;
    lo[i] = WindowStart(a, pos[i] + 1);
  }
  const int last_m = min(m0 + kTileM, total_rows) - 1;
  const int kv_end = max(0, min(ctx, first_pos + last_m / group + 1));
  // The tile's first row sees the lowest keys; with a window, keys before its window are
  // skipped (never read: they may be holes in the table).
  const int kv_begin = min(kv_end, WindowStart(a, max(0, first_pos + m0 / group + 1)));

  float row_max[kRowsPerThread], row_sum[kRowsPerThread];
  float4 o[kRowsPerThread][kChunks4];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    row_max[i] = -INFINITY;
    row_sum[i] = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks4; ++c) o[i][c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;

  for (int n0 = kv_begin; n0 < kv_end; n0 += kTileN) {  // uniform over the block
    __syncthreads();  // the previous tile's k_s, v_s and p_s are consumed (and q_s is written)
    for (int i = tid; i < kTileN * kSlices; i += kPrefillThreads) {
      const int kj = i / kSlices;
      const int sub = i % kSlices;
      const int j = n0 + kj;
      int32_t id = -1;
      if (j < kv_end) {
        id = table[j >> a.block_shift];
        if (id >= a.num_blocks) id = -1;
      }
      float xk[8], xv[8];
      if (id >= 0) {
        const int64_t row = ArenaRow(a, id, g, j);
        const float fk =
            DecodeSlice<KD>(LoadSlice<KD, kHeadDim>(a.k_values, a.k_meta, row, sub), xk);
        const float fv =
            DecodeSlice<VD>(LoadSlice<VD, kHeadDim>(a.v_values, a.v_meta, row, sub), xv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          xk[e] *= fk;  // the same single rounding as DequantizeRow
          xv[e] *= fv;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) xk[e] = xv[e] = 0.f;
      }
      float4* kd = reinterpret_cast<float4*>(k_s + kj * kStride + sub * 8);
      float4* vd = reinterpret_cast<float4*>(v_s + kj * kStride + sub * 8);
      kd[0] = make_float4(xk[0], xk[1], xk[2], xk[3]);
      kd[1] = make_float4(xk[4], xk[5], xk[6], xk[7]);
      vd[0] = make_float4(xv[0], xv[1], xv[2], xv[3]);
      vd[1] = make_float4(xv[4], xv[5], xv[6], xv[7]);
      if (sub == 0) key_ok_s[kj] = id >= 0;
    }
    __syncthreads();

    // S = Q K^T for rows 4ty + i and keys tx + 8jj.
    float sc[kRowsPerThread][4];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) sc[i][jj] = 0.f;
    }
#pragma unroll 4
    for (int d = 0; d < kHeadDim; d += 4) {
      float4 qv[kRowsPerThread], kv[4];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        qv[i] = *reinterpret_cast<const float4*>(q_s + (ty * kRowsPerThread + i) * kStride + d);
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        kv[jj] = *reinterpret_cast<const float4*>(k_s + (tx + 8 * jj) * kStride + d);
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          float acc = sc[i][jj];
          acc = fmaf(qv[i].x, kv[jj].x, acc);
          acc = fmaf(qv[i].y, kv[jj].y, acc);
          acc = fmaf(qv[i].z, kv[jj].z, acc);
          acc = fmaf(qv[i].w, kv[jj].w, acc);
          sc[i][jj] = acc;
        }
      }
    }

    // Causal mask and online softmax. A row's 32 scores of this tile sit in the 8 lanes with
    // its ty (lanes 8 (ty % 4) .. + 7 of one warp), so xor 1, 2, 4 combine them.
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int kj = tx + 8 * jj;
        const bool visible = n0 + kj <= pos[i] && n0 + kj >= lo[i] && key_ok_s[kj];
        sc[i][jj] = visible ? sc[i][jj] * a.scale : -INFINITY;
        tile_max = fmaxf(tile_max, sc[i][jj]);
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, off));
      }
      const float new_max = fmaxf(row_max[i], tile_max);
      // Nothing visible yet: shift by 0 so exp(-inf) gives 0 rather than exp(-inf + inf) NaN.
      const float shift = new_max == -INFINITY ? 0.f : new_max;
      const float alpha = expf(row_max[i] - shift);
      float tile_sum = 0.f;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float p = expf(sc[i][jj] - shift);
        p_s[(ty * kRowsPerThread + i) * kPStride + tx + 8 * jj] = p;
        tile_sum += p;
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {
        tile_sum += __shfl_xor_sync(kFullMask, tile_sum, off);
      }
      row_sum[i] = fmaf(row_sum[i], alpha, tile_sum);
      row_max[i] = new_max;
#pragma unroll
      for (int c = 0; c < kChunks4; ++c) {
        o[i][c].x *= alpha;
        o[i][c].y *= alpha;
        o[i][c].z *= alpha;
        o[i][c].w *= alpha;
      }
    }
    __syncwarp();  // a row's p_s entries are written and read by the same 8 lanes of one warp

    // O += P V.
#pragma unroll 4
    for (int kj = 0; kj < kTileN; ++kj) {
      float p[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        p[i] = p_s[(ty * kRowsPerThread + i) * kPStride + kj];
      }
#pragma unroll
      for (int c = 0; c < kChunks4; ++c) {
        const float4 v = *reinterpret_cast<const float4*>(v_s + kj * kStride + 32 * c + 4 * tx);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          o[i][c].x = fmaf(p[i], v.x, o[i][c].x);
          o[i][c].y = fmaf(p[i], v.y, o[i][c].y);
          o[i][c].z = fmaf(p[i], v.z, o[i][c].z);
          o[i][c].w = fmaf(p[i], v.w, o[i][c].w);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int m = m0 + ty * kRowsPerThread + i;
    if (m >= total_rows) continue;
    const float inv = row_sum[i] > 0.f ? 1.f / row_sum[i] : 0.f;  // no visible key: zeros
    const int64_t row = static_cast<int64_t>(q_begin + m / group) * a.num_heads + g * group +
                        m % group;
    float* out = a.output + row * kHeadDim;
    if (tx == 0 && a.lse != nullptr) {
      a.lse[row] = row_sum[i] > 0.f ? row_max[i] + logf(row_sum[i]) : -INFINITY;
    }
#pragma unroll
    for (int c = 0; c < kChunks4; ++c) {
      *reinterpret_cast<float4*>(out + 32 * c + 4 * tx) =
          make_float4(o[i][c].x * inv, o[i][c].y * inv, o[i][c].z * inv, o[i][c].w * inv);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Grid shapes and the decode chunk, a function of the params' sizes and bounds only, so that
// PagedAttentionWorkspaceBytes and LaunchPagedAttention agree.
struct Plan {
  int64_t max_ctx = 0;  // contexts are cut here
  int64_t max_query_len = 0;
  int rows = 1;           // decode rows per block: 1, 4 or 8
  int64_t row_tiles = 1;  // decode blocks per KV head
  int64_t chunk_tokens = kMinChunk;
  int64_t max_chunks = 1;
  int64_t prefill_tiles = 0;  // row tiles per (KV head, sequence)
};

int Log2(int64_t x) {
  int k = 0;
  while ((int64_t{1} << k) < x) ++k;
  return k;
}

Plan MakePlan(const PagedAttentionParams& p) {
  Plan plan;
  const int64_t table_ctx = std::min(kMaxContext, p.max_blocks_per_seq * p.block_size);
  plan.max_ctx = p.max_seq_len > 0 ? std::min(p.max_seq_len, table_ctx) : table_ctx;
  plan.max_query_len = p.max_query_len > 0 ? p.max_query_len : p.num_tokens;
  const int64_t group = p.num_heads / p.num_kv_heads;
  // Rows the decode block handles at once: the group padded up to 1, 4 or 8 (zero queries
  // fill the rest), larger groups in tiles of 8.
  plan.rows = group == 1 ? 1 : group <= 4 ? 4 : 8;
  plan.row_tiles = CeilDiv(group, plan.rows);
  // A windowed query reads at most `window` keys.
  const int64_t span = p.window > 0 ? std::min(plan.max_ctx, p.window) : plan.max_ctx;
  const double work = static_cast<double>(span) *
                      static_cast<double>(p.num_seqs * p.num_kv_heads * plan.row_tiles);
  while (plan.chunk_tokens < kMaxChunk &&
         static_cast<double>(plan.chunk_tokens) * kDecodeTargetBlocks < work) {
    plan.chunk_tokens *= 2;
  }
  plan.max_chunks = std::max<int64_t>(1, CeilDiv(span, plan.chunk_tokens));
  plan.prefill_tiles = CeilDiv(plan.max_query_len * group, kTileM);
  return plan;
}

template <KvDType KD, KvDType VD, int kHeadDim>
absl::Status LaunchTyped(const PagedAttentionParams& p, const Plan& plan, const KernelArgs& args,
                         cudaStream_t stream) {
  // The kernels' row geometry must be the one KvWrite fills.
  for (auto [dtype, bytes, meta] :
       {std::tuple{KD, kRowBytes<KD, kHeadDim>, kMetaBytes<KD, kHeadDim>},
        std::tuple{VD, kRowBytes<VD, kHeadDim>, kMetaBytes<VD, kHeadDim>}}) {
    const KvRowLayout layout = KvRowLayoutFor(dtype, kHeadDim);
    if (layout.value_bytes != bytes || layout.meta_bytes != meta) {
      return absl::InternalError(absl::StrCat("paged attention: the CUDA row layout of ",
                                              std::string(KvDTypeName(dtype)),
                                              " disagrees with KvRowLayoutFor"));
    }
  }
  // Decode: every launch, since which sequences decode is known only on the device; blocks of
  // other sequences return at once.
  const dim3 decode_grid(static_cast<unsigned>(plan.max_chunks),
                         static_cast<unsigned>(p.num_kv_heads * plan.row_tiles),
                         static_cast<unsigned>(p.num_seqs));
  const size_t decode_smem = static_cast<size_t>(
      DecodeSmemBytes(plan.rows, kHeadDim, plan.chunk_tokens, args.block_shift));
  switch (plan.rows) {
    case 1:
      DecodeKernel<KD, VD, kHeadDim, 1><<<decode_grid, kDecodeThreads, decode_smem, stream>>>(args);
      break;
    case 4:
      DecodeKernel<KD, VD, kHeadDim, 4><<<decode_grid, kDecodeThreads, decode_smem, stream>>>(args);
      break;
    default:
      DecodeKernel<KD, VD, kHeadDim, 8><<<decode_grid, kDecodeThreads, decode_smem, stream>>>(args);
      break;
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (plan.max_chunks > 1) {
    const dim3 merge_grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.num_seqs));
    DecodeMergeKernel<kHeadDim><<<merge_grid, kMergeThreads, 0, stream>>>(args);
    KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (plan.max_query_len >= 2 && plan.prefill_tiles > 0) {
    constexpr int64_t kSmem = PrefillSmemBytes<kHeadDim>();
    if constexpr (kSmem > kDefaultSmemLimit) {
      // Above 48 KiB a kernel must opt in; cheap next to a prefill, and per device, so it is
      // set on every launch rather than cached.
      KVGRID_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(PrefillKernel<KD, VD, kHeadDim>,
                                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       static_cast<int>(kSmem)));
    }
    const dim3 prefill_grid(static_cast<unsigned>(plan.prefill_tiles),
                            static_cast<unsigned>(p.num_kv_heads),
                            static_cast<unsigned>(p.num_seqs));
    PrefillKernel<KD, VD, kHeadDim>
        <<<prefill_grid, kPrefillThreads, static_cast<size_t>(kSmem), stream>>>(args);
    KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return absl::OkStatus();
}

template <KvDType KD, int kHeadDim>
absl::Status DispatchV(const PagedAttentionParams& p, const Plan& plan, const KernelArgs& args,
                       cudaStream_t stream) {
  switch (p.v_dtype) {
    case KvDType::kF32: return LaunchTyped<KD, KvDType::kF32, kHeadDim>(p, plan, args, stream);
    case KvDType::kF16: return LaunchTyped<KD, KvDType::kF16, kHeadDim>(p, plan, args, stream);
    case KvDType::kBF16: return LaunchTyped<KD, KvDType::kBF16, kHeadDim>(p, plan, args, stream);
    case KvDType::kInt8: return LaunchTyped<KD, KvDType::kInt8, kHeadDim>(p, plan, args, stream);
    case KvDType::kInt4: return LaunchTyped<KD, KvDType::kInt4, kHeadDim>(p, plan, args, stream);
    case KvDType::kFp8E4m3:
      return LaunchTyped<KD, KvDType::kFp8E4m3, kHeadDim>(p, plan, args, stream);
  }
  return absl::InvalidArgumentError("PagedAttentionParams.v_dtype is not a KvDType");
}

template <int kHeadDim>
absl::Status DispatchK(const PagedAttentionParams& p, const Plan& plan, const KernelArgs& args,
                       cudaStream_t stream) {
  switch (p.k_dtype) {
    case KvDType::kF32: return DispatchV<KvDType::kF32, kHeadDim>(p, plan, args, stream);
    case KvDType::kF16: return DispatchV<KvDType::kF16, kHeadDim>(p, plan, args, stream);
    case KvDType::kBF16: return DispatchV<KvDType::kBF16, kHeadDim>(p, plan, args, stream);
    case KvDType::kInt8: return DispatchV<KvDType::kInt8, kHeadDim>(p, plan, args, stream);
    case KvDType::kInt4: return DispatchV<KvDType::kInt4, kHeadDim>(p, plan, args, stream);
    case KvDType::kFp8E4m3: return DispatchV<KvDType::kFp8E4m3, kHeadDim>(p, plan, args, stream);
  }
  return absl::InvalidArgumentError("PagedAttentionParams.k_dtype is not a KvDType");
}

bool KnownDType(KvDType d) {
  switch (d) {
    case KvDType::kF32:
    case KvDType::kF16:
    case KvDType::kBF16:
    case KvDType::kInt8:
    case KvDType::kInt4:
    case KvDType::kFp8E4m3: return true;
  }
  return false;
}

}  // namespace

absl::Status PagedAttentionParams::Validate() const {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttentionParams.", parts...));
  };
  if (query == nullptr) return invalid("query is null");
  if (output == nullptr) return invalid("output is null");
  if (k_cache == nullptr) return invalid("k_cache is null");
  if (v_cache == nullptr) return invalid("v_cache is null");
  if (block_tables == nullptr) return invalid("block_tables is null");
  if (seq_lens == nullptr) return invalid("seq_lens is null");
  if (query_start == nullptr) return invalid("query_start is null");
  if (!KnownDType(k_dtype)) return invalid("k_dtype is not a KvDType");
  if (!KnownDType(v_dtype)) return invalid("v_dtype is not a KvDType");
  if (head_dim != 64 && head_dim != 128) {
    return invalid("head_dim must be 64 or 128 on CUDA: ", head_dim);
  }
  if (KvRowLayoutFor(k_dtype, head_dim).meta_bytes > 0 && k_meta == nullptr) {
    return invalid("k_meta is required for ", std::string(KvDTypeName(k_dtype)));
  }
  if (KvRowLayoutFor(v_dtype, head_dim).meta_bytes > 0 && v_meta == nullptr) {
    return invalid("v_meta is required for ", std::string(KvDTypeName(v_dtype)));
  }
  if (static_cast<const void*>(output) == static_cast<const void*>(query)) {
    return invalid("output must not alias query");
  }
  if (!IsAligned(query, 16)) return invalid("query is not 16-byte aligned");
  if (!IsAligned(output, 16)) return invalid("output is not 16-byte aligned");
  if (!IsAligned(k_cache, 16)) return invalid("k_cache is not 16-byte aligned");
  if (!IsAligned(v_cache, 16)) return invalid("v_cache is not 16-byte aligned");
  if (!IsAligned(k_meta, 2)) return invalid("k_meta is not 2-byte aligned");
  if (!IsAligned(v_meta, 2)) return invalid("v_meta is not 2-byte aligned");
  // Grid z is the sequence; CUDA caps it at 65535.
  if (num_seqs < 0 || num_seqs > 65535) {
    return invalid("num_seqs out of range [0, 65535]: ", num_seqs);
  }
  if (num_tokens < 0 || num_tokens > INT32_MAX) {
    return invalid("num_tokens out of range: ", num_tokens);
  }
  if (max_blocks_per_seq <= 0) {
    return invalid("max_blocks_per_seq must be > 0: ", max_blocks_per_seq);
  }
  if (num_blocks <= 0 || num_blocks > INT32_MAX) {
    return invalid("num_blocks out of range: ", num_blocks);
  }
  if (num_heads <= 0 || num_heads > 65535) return invalid("num_heads out of range: ", num_heads);
  if (num_kv_heads <= 0) return invalid("num_kv_heads must be > 0: ", num_kv_heads);
  if (num_heads % num_kv_heads != 0) {
    return invalid("num_heads ", num_heads, " not divisible by num_kv_heads ", num_kv_heads);
  }
  if (block_size <= 0 || block_size > 256 || (block_size & (block_size - 1)) != 0) {
    return invalid("block_size must be a power of two <= 256: ", block_size);
  }
  if (!(scale > 0.f) || !std::isfinite(scale)) return invalid("scale must be finite and > 0");
  if (max_seq_len < 0) return invalid("max_seq_len must be >= 0: ", max_seq_len);
  if (window < 0 || window > kMaxContext) {
    return invalid("window out of range [0, 2^30]: ", window);
  }
  if (max_query_len < 0 || max_query_len > num_tokens) {
    return invalid("max_query_len out of range [0, num_tokens]: ", max_query_len);
  }
  // Prefill rows are (token, head) pairs indexed in int32 on the device.
  if (num_tokens * (num_heads / num_kv_heads) > kMaxContext) {
    return invalid("num_tokens * (num_heads / num_kv_heads) exceeds 2^30: ", num_tokens);
  }
  const int64_t need = PagedAttentionWorkspaceBytes(*this);
  if (need > 0 && workspace == nullptr) {
    return invalid("workspace is null; ", need, " bytes are needed");
  }
  if (workspace_bytes < need) {
    return invalid("workspace_bytes ", workspace_bytes, " < the ", need, " bytes needed");
  }
  if (!IsAligned(workspace, 16)) return invalid("workspace is not 16-byte aligned");
  return absl::OkStatus();
}

int64_t PagedAttentionWorkspaceBytes(const PagedAttentionParams& p) {
  if (p.num_seqs <= 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 || p.block_size <= 0 ||
      p.max_blocks_per_seq <= 0 || p.head_dim <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return 0;
  }
  const Plan plan = MakePlan(p);
  if (plan.max_chunks <= 1) return 0;
  // part_out, then part_max and part_sum.
  return 4 * p.num_seqs * plan.max_chunks * p.num_heads * (p.head_dim + 2);
}

int64_t PagedAttentionMaxWorkspaceBytes(const PagedAttentionParams& bounds) {
  if (bounds.num_seqs <= 0 || bounds.num_heads <= 0 || bounds.num_kv_heads <= 0 ||
      bounds.block_size <= 0 || bounds.num_heads % bounds.num_kv_heads != 0) {
    return 0;
  }
  const int64_t limit = std::min(
      kMaxContext, bounds.max_seq_len > 0 ? bounds.max_seq_len
                                          : bounds.max_blocks_per_seq * bounds.block_size);
  if (limit <= 0) return 0;
  int64_t most = 0;
  for (int64_t n = 1; n <= bounds.num_seqs; ++n) {
    PagedAttentionParams p = bounds;
    p.num_seqs = n;
    p.num_tokens = n;
    // MakePlan keeps chunks of c tokens while c * kDecodeTargetBlocks >= span * per_token: the
    // longest span at each chunk length has the most chunks of that length.
    p.max_seq_len = 1;
    p.max_blocks_per_seq = 1;
    const Plan one = MakePlan(p);
    const double per_token = static_cast<double>(n * p.num_kv_heads * one.row_tiles);
    std::vector<int64_t> spans = {limit};
    for (int64_t c = kMinChunk; c < kMaxChunk; c *= 2) {
      const auto longest =
          static_cast<int64_t>(static_cast<double>(c) * kDecodeTargetBlocks / per_token);
      if (longest >= 1) spans.push_back(std::min(limit, longest));
    }
    for (int64_t span : spans) {
      p.max_seq_len = span;
      p.max_blocks_per_seq = CeilDiv(span, p.block_size);
      most = std::max(most, PagedAttentionWorkspaceBytes(p));
    }
  }
  return most;
}

absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_seqs == 0 || p.num_tokens == 0) return absl::OkStatus();
  const Plan plan = MakePlan(p);
  KernelArgs args{};
  args.query = p.query;
  args.output = p.output;
  args.k_values = static_cast<const uint8_t*>(p.k_cache);
  args.v_values = static_cast<const uint8_t*>(p.v_cache);
  args.k_meta = static_cast<const uint8_t*>(p.k_meta);
  args.v_meta = static_cast<const uint8_t*>(p.v_meta);
  args.block_tables = p.block_tables;
  args.seq_lens = p.seq_lens;
  args.query_start = p.query_start;
  if (plan.max_chunks > 1) {
    const int64_t entries = p.num_seqs * plan.max_chunks * p.num_heads;
    args.part_out = static_cast<float*>(p.workspace);
    args.part_max = args.part_out + entries * p.head_dim;
    args.part_sum = args.part_max + entries;
  }
  args.max_blocks_per_seq = p.max_blocks_per_seq;
  args.num_blocks = p.num_blocks;
  args.num_heads = static_cast<int>(p.num_heads);
  args.num_kv_heads = static_cast<int>(p.num_kv_heads);
  args.group = static_cast<int>(p.num_heads / p.num_kv_heads);
  args.row_tiles = static_cast<int>(plan.row_tiles);
  args.block_shift = Log2(p.block_size);
  args.max_ctx = static_cast<int>(plan.max_ctx);
  args.chunk_tokens = static_cast<int>(plan.chunk_tokens);
  args.max_chunks = static_cast<int>(plan.max_chunks);
  args.window = static_cast<int>(p.window);
  args.scale = p.scale;
  args.lse = p.lse;
  return p.head_dim == 64 ? DispatchK<64>(p, plan, args, stream)
                          : DispatchK<128>(p, plan, args, stream);
}

}  // namespace kvgrid::kernels::cuda
