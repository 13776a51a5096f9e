#include "kernels/cuda/quant_linear.cuh"

#include <cuda_fp16.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"

namespace kvgrid::kernels::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// --- block decoding ---
//
// A group of 32 weights (a block, or one of a K-quant super-block's 8 groups) is handled by 4
// lanes ("sub-blocks" 0..3) of 8 weights each. Q8_0's and the K-quants' sub-block s holds
// columns 8s..8s+7 of its group; a nibble format's (Q4_0, Q4_1, Q4_Z, Q5_0, Q5_1, IQ4_NL) holds
// the nibbles of bytes 4s..4s+3, which are columns 4s..4s+3 (low nibbles) and 16+4s..16+4s+3
// (high nibbles). Blocks are 18 to 210 bytes, so only 2-byte alignment holds: fp16 fields and
// Q8_0's values are read as 16-bit words, the other formats' bits byte by byte.

// Per-format constants as variable templates: usable in device code, unlike the host
// constexpr function they come from.
template <QuantFormat F>
constexpr int64_t kBlockBytes = QuantBlockBytes(F);
template <QuantFormat F>
constexpr int64_t kBlockElems = QuantBlockElements(F);
template <QuantFormat F>
constexpr int kHeaderBytes = F == QuantFormat::kQ4_1 || F == QuantFormat::kQ4_Z ? 4 : 2;
template <QuantFormat F>
constexpr bool kNibbleOrder = F == QuantFormat::kQ4_0 || F == QuantFormat::kQ4_1 ||
                              F == QuantFormat::kQ4_Z || F == QuantFormat::kQ5_0 ||
                              F == QuantFormat::kQ5_1 || F == QuantFormat::kIQ4_NL;

__device__ __forceinline__ uint16_t Load16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}

__device__ __forceinline__ unsigned Load8(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned char*>(p));
}

__device__ __forceinline__ float HalfToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));  // exact for every non-NaN fp16
}

// The column (0..31, within its group) of weight e (0..7) of sub-block `sub`.
template <QuantFormat F>
__device__ __forceinline__ int ColumnOf(int sub, int e) {
  if constexpr (kNibbleOrder<F>) {
    return e < 4 ? 4 * sub + e : 16 + 4 * sub + (e - 4);
  } else {
    return 8 * sub + e;
  }
}

// IQ4_NL's levels (kernels/cpu/ggml_blocks.cc: -127, -104, -83, -65, -49, -35, -22, -10, 1,
// 13, 25, 38, 53, 69, 89, 113) as int8 bytes of two 64-bit constants, picked by shifts: a table
// indexed by a runtime nibble would live in local memory (a stack frame per thread).
__device__ __forceinline__ float Iq4NlLevel(unsigned q) {
  constexpr unsigned long long kLow = 0xf6eaddcfbfad9881ull, kHigh = 0x7159453526190d01ull;
  const unsigned i = q & 0xfu;
  const unsigned long long bytes = i < 8 ? kLow : kHigh;
  return static_cast<float>(static_cast<int8_t>((bytes >> (8 * (i & 7u))) & 0xffu));
}

// Q4_K's and Q5_K's 6-bit scale and minimum of group j (0..7) from the 12 scale bytes.
__device__ __forceinline__ void ScaleMinK4(const uint8_t* sc, int j, float* scale, float* min) {
  unsigned s, m;
  if (j < 4) {
    s = Load8(sc + j) & 63u;
    m = Load8(sc + j + 4) & 63u;
  } else {
    const unsigned packed = Load8(sc + j + 4);
    s = (packed & 0xfu) | (Load8(sc + j - 4) >> 6) << 4;
    m = (packed >> 4) | (Load8(sc + j) >> 6) << 4;
  }
  *scale = static_cast<float>(s);
  *min = static_cast<float>(m);
}

// w[e] = weight ColumnOf(sub, e) of group g of the row starting at `row`, computed as
// kernels/cpu/quant_linear.cc and ggml_blocks.cc do (products of an fp16 and small integers are
// exact in fp32, so fused or not, each weight is the CPU's float).
template <QuantFormat F>
__device__ __forceinline__ void DecodeEight(const uint8_t* row, int64_t g, int sub, float w[8]) {
  const uint8_t* block = row + g * kQuantBlockSize / kBlockElems<F> * kBlockBytes<F>;
  const int j = static_cast<int>(g % (kBlockElems<F> / kQuantBlockSize));  // group in the block
  if constexpr (F == QuantFormat::kQ8_0) {
    const float d = HalfToFloat(Load16(block));
    const uint8_t* q = block + 2 + 8 * sub;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t pair = Load16(q + 2 * i);  // little-endian: the first value is low
      w[2 * i] = d * static_cast<float>(static_cast<int8_t>(pair & 0xffu));
      w[2 * i + 1] = d * static_cast<float>(static_cast<int8_t>(pair >> 8));
    }
  } else if constexpr (F == QuantFormat::kQ4_0 || F == QuantFormat::kQ4_1 ||
                       F == QuantFormat::kQ4_Z) {
    const float d = HalfToFloat(Load16(block));
    const uint8_t* q = block + kHeaderBytes<F> + 4 * sub;
    const uint16_t p0 = Load16(q);
    const uint16_t p1 = Load16(q + 2);
    const unsigned bytes[4] = {p0 & 0xffu, static_cast<unsigned>(p0 >> 8), p1 & 0xffu,
                               static_cast<unsigned>(p1 >> 8)};
    if constexpr (F == QuantFormat::kQ4_0) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = d * static_cast<float>(static_cast<int>(bytes[e] & 0xfu) - 8);
        w[4 + e] = d * static_cast<float>(static_cast<int>(bytes[e] >> 4) - 8);
      }
    } else {
      const float second = HalfToFloat(Load16(block + 2));
      const float m = F == QuantFormat::kQ4_1 ? second : -d * second;  // Q4_Z: -d z, exact
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        w[e] = fmaf(d, static_cast<float>(bytes[e] & 0xfu), m);
        w[4 + e] = fmaf(d, static_cast<float>(bytes[e] >> 4), m);
      }
    }
  } else if constexpr (F == QuantFormat::kQ5_0 || F == QuantFormat::kQ5_1) {
    constexpr int kHigh = F == QuantFormat::kQ5_0 ? 2 : 4;  // offset of the 32 high bits
    const float d = HalfToFloat(Load16(block));
    const unsigned qh = Load16(block + kHigh) | static_cast<unsigned>(Load16(block + kHigh + 2))
                                                    << 16;
    const uint8_t* q = block + kHigh + 4 + 4 * sub;
    const float m = F == QuantFormat::kQ5_1 ? HalfToFloat(Load16(block + 2)) : 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned byte = Load8(q + e);
      const int lo_col = 4 * sub + e, hi_col = 16 + 4 * sub + e;
      const int lo = static_cast<int>((byte & 0xfu) | ((qh >> lo_col) & 1u) << 4);
      const int hi = static_cast<int>((byte >> 4) | ((qh >> hi_col) & 1u) << 4);
      if constexpr (F == QuantFormat::kQ5_0) {
        w[e] = static_cast<float>(lo - 16) * d;
        w[4 + e] = static_cast<float>(hi - 16) * d;
      } else {
        w[e] = fmaf(static_cast<float>(lo), d, m);
        w[4 + e] = fmaf(static_cast<float>(hi), d, m);
      }
    }
  } else if constexpr (F == QuantFormat::kIQ4_NL) {
    const float d = HalfToFloat(Load16(block));
    const uint8_t* q = block + 2 + 4 * sub;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const unsigned byte = Load8(q + e);
      w[e] = d * Iq4NlLevel(byte);
      w[4 + e] = d * Iq4NlLevel(byte >> 4);
    }
  } else if constexpr (F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K) {
    const float d = HalfToFloat(Load16(block)), dmin = HalfToFloat(Load16(block + 2));
    float scale, min;
    ScaleMinK4(block + 4, j, &scale, &min);
    const float d1 = d * scale, m1 = dmin * min;
    constexpr int kQs = F == QuantFormat::kQ4_K ? 16 : 48;
    const uint8_t* q = block + kQs + 32 * (j / 2) + 8 * sub;
    const int shift = 4 * (j % 2);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      unsigned v = (Load8(q + e) >> shift) & 0xfu;
      if constexpr (F == QuantFormat::kQ5_K) {
        v |= ((Load8(block + 16 + 8 * sub + e) >> j) & 1u) << 4;
      }
      w[e] = fmaf(d1, static_cast<float>(v), -m1);
    }
  } else if constexpr (F == QuantFormat::kQ6_K) {
    const int h = j / 4, s = j % 4;
    const float d = HalfToFloat(Load16(block + 208));
    const auto scale = static_cast<int8_t>(Load8(block + 192 + 2 * j + sub / 2));
    const float dl = d * static_cast<float>(scale);
    const uint8_t* lo = block + 64 * h + 32 * (s % 2) + 8 * sub;
    const uint8_t* hi = block + 128 + 32 * h + 8 * sub;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int q = static_cast<int>(((Load8(lo + e) >> (4 * (s / 2))) & 0xfu) |
                                     ((Load8(hi + e) >> (2 * s)) & 3u) << 4) - 32;
      w[e] = dl * static_cast<float>(q);
    }
  } else if constexpr (F == QuantFormat::kQ3_K) {
    const int h = j / 4, s = j % 4;
    const int sj = 2 * j + sub / 2;  // scale of these 8 weights (of 16)
    const uint8_t* sc = block + 96;
    const unsigned lo4 = sj < 8 ? Load8(sc + sj) & 0xfu : Load8(sc + sj - 8) >> 4;
    const unsigned hi2 = (Load8(sc + 8 + sj % 4) >> (2 * (sj / 4))) & 3u;
    const float d = HalfToFloat(Load16(block + 108));
    const float dl = d * static_cast<float>(static_cast<int>(lo4 | hi2 << 4) - 32);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int l = 8 * sub + e;
      const int q = static_cast<int>((Load8(block + 32 + 32 * h + l) >> (2 * s)) & 3u) -
                    (((Load8(block + l) >> j) & 1u) ? 0 : 4);
      w[e] = dl * static_cast<float>(q);
    }
  } else {
    static_assert(F == QuantFormat::kQ2_K, "every format decodes");
    const int h = j / 4, s = j % 4;
    const unsigned sc = Load8(block + 2 * j + sub / 2);
    const float d = HalfToFloat(Load16(block + 80)), dmin = HalfToFloat(Load16(block + 82));
    const float dl = d * static_cast<float>(sc & 0xfu), ml = dmin * static_cast<float>(sc >> 4);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const unsigned q = (Load8(block + 16 + 32 * h + 8 * sub + e) >> (2 * s)) & 3u;
      w[e] = fmaf(dl, static_cast<float>(q), -ml);
    }
  }
}

// The input column that stored column `col` multiplies, or -1 for an out-of-range permutation
// entry (read as 0 rather than outside the input).
__device__ __forceinline__ int64_t InputColumn(const int32_t* __restrict__ perm, int64_t col,
                                               int64_t k) {
  if (perm == nullptr) return col;
  const int32_t src = perm[col];
  return src >= 0 && src < k ? src : -1;
}

// y = (accumulate ? y + dot : dot) + bias, the CPU decode path's order of the sums.
__device__ __forceinline__ void StoreOutput(float* y, float dot, const float* bias, int64_t row,
                                            bool accumulate) {
  const float b = bias != nullptr ? bias[row] : 0.f;
  *y = accumulate ? *y + dot + b : dot + b;
}

// --- decode: one warp per output row, T (<= 8) tokens ---

constexpr int kGemvWarps = 4;

template <QuantFormat F, int T>
__global__ void __launch_bounds__(kGemvWarps * 32)
    QuantGemvKernel(const float* __restrict__ input, const uint8_t* __restrict__ weight,
                    const int32_t* __restrict__ perm, const float* __restrict__ bias,
                    float* __restrict__ output, int64_t k, int64_t n, int64_t ldo,
                    bool accumulate) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (row >= n) return;  // per warp: the shuffles below see whole warps only
  const int64_t blocks = k / kQuantBlockSize;  // groups of 32 columns
  const uint8_t* w_row = weight + row * (k / kBlockElems<F>) * kBlockBytes<F>;
  const int sub = lane % 4;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  for (int64_t b = lane / 4; b < blocks; b += 8) {
    float w[8];
    DecodeEight<F>(w_row, b, sub, w);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int64_t src = InputColumn(perm, b * kQuantBlockSize + ColumnOf<F>(sub, e), k);
      if (src < 0) continue;
#pragma unroll
      for (int t = 0; t < T; ++t) acc[t] = fmaf(w[e], input[t * k + src], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    for (int offset = 16; offset > 0; offset >>= 1) {
      acc[t] += __shfl_xor_sync(kFullMask, acc[t], offset);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < T; ++t) StoreOutput(output + t * ldo + row, acc[t], bias, row, accumulate);
  }
}

// --- prefill: 64 tokens x 64 rows per block, through shared memory ---

constexpr int kTileTokens = 64;
constexpr int kTileRows = 64;
constexpr int kTileThreads = 256;
// Row padding of the shared tiles: keeps each row 16-byte aligned for float4 reads while
// moving consecutive rows to different banks.
constexpr int kTilePad = 4;
static_assert(kTileThreads == 4 * kTileRows, "one thread per sub-block of the weight tile");
static_assert(kTileTokens * kQuantBlockSize % kTileThreads == 0, "whole input tile per step");

template <QuantFormat F>
__global__ void __launch_bounds__(kTileThreads)
    QuantGemmKernel(const float* __restrict__ input, const uint8_t* __restrict__ weight,
                    const int32_t* __restrict__ perm, const float* __restrict__ bias,
                    float* __restrict__ output, int64_t num_tokens, int64_t k, int64_t n,
                    int64_t ldo, bool accumulate) {
  __shared__ __align__(16) float xs[kQuantBlockSize][kTileTokens + kTilePad];  // [col][token]
  __shared__ __align__(16) float ws[kQuantBlockSize][kTileRows + kTilePad];    // [col][row]
  const int tid = threadIdx.x;
  const int tx = tid % 16;  // this thread's output rows: tx * 4 .. tx * 4 + 3 of the tile
  const int ty = tid / 16;  // this thread's tokens: ty * 4 .. ty * 4 + 3 of the tile
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t tok0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
  const int64_t blocks = k / kQuantBlockSize;
  // The weight block this thread decodes each step: tile row tid / 4, sub-block tid % 4.
  const int dec_row = tid / 4;
  const int dec_sub = tid % 4;
  const bool dec_valid = row0 + dec_row < n;
  const uint8_t* dec_base =
      dec_valid ? weight + (row0 + dec_row) * (k / kBlockElems<F>) * kBlockBytes<F> : weight;

  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  }

  for (int64_t b = 0; b < blocks; ++b) {
    // Inputs: 64 tokens x 32 columns, 8 per thread, the column fastest so the reads coalesce.
#pragma unroll
    for (int i = 0; i < kTileTokens * kQuantBlockSize / kTileThreads; ++i) {
      const int idx = tid + i * kTileThreads;
      const int m = idx / kQuantBlockSize;
      const int c = idx % kQuantBlockSize;
      const int64_t token = tok0 + m;
      float v = 0.f;
      if (token < num_tokens) {
        const int64_t src = InputColumn(perm, b * kQuantBlockSize + c, k);
        if (src >= 0) v = input[token * k + src];
      }
      xs[c][m] = v;
    }
    float w[8];
    if (dec_valid) {
      DecodeEight<F>(dec_base, b, dec_sub, w);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) w[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) ws[ColumnOf<F>(dec_sub, e)][dec_row] = w[e];
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kQuantBlockSize; ++c) {
      const float4 a = *reinterpret_cast<const float4*>(&xs[c][ty * 4]);
      const float4 v = *reinterpret_cast<const float4*>(&ws[c][tx * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w};
      const float wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
      }
    }
    __syncthreads();  // the next step overwrites both tiles
  }

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t token = tok0 + ty * 4 + i;
    if (token >= num_tokens) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t row = row0 + tx * 4 + j;
      if (row < n) StoreOutput(output + token * ldo + row, acc[i][j], bias, row, accumulate);
    }
  }
}

template <QuantFormat F, int T>
void LaunchGemv(const QuantLinearParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.out_features + kGemvWarps - 1) / kGemvWarps);
  QuantGemvKernel<F, T><<<blocks, kGemvWarps * 32, 0, stream>>>(
      p.input, p.weight, p.input_perm, p.bias, p.output, p.in_features, p.out_features,
      p.OutputStride(), p.accumulate);
}

template <QuantFormat F>
absl::Status LaunchFormat(const QuantLinearParams& p, cudaStream_t stream) {
  switch (p.num_tokens) {
    case 1: LaunchGemv<F, 1>(p, stream); break;
    case 2: LaunchGemv<F, 2>(p, stream); break;
    case 3: LaunchGemv<F, 3>(p, stream); break;
    case 4: LaunchGemv<F, 4>(p, stream); break;
    case 5: LaunchGemv<F, 5>(p, stream); break;
    case 6: LaunchGemv<F, 6>(p, stream); break;
    case 7: LaunchGemv<F, 7>(p, stream); break;
    case 8: LaunchGemv<F, 8>(p, stream); break;
    default: {
      static_assert(kQuantGemvMaxTokens == 8, "one case per decode token count");
      const dim3 grid(static_cast<unsigned>((p.out_features + kTileRows - 1) / kTileRows),
                      static_cast<unsigned>((p.num_tokens + kTileTokens - 1) / kTileTokens));
      QuantGemmKernel<F><<<grid, kTileThreads, 0, stream>>>(
          p.input, p.weight, p.input_perm, p.bias, p.output, p.num_tokens, p.in_features,
          p.out_features, p.OutputStride(), p.accumulate);
    }
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// --- embedding: one block per token, each thread a sub-block of 8 weights at a time ---

constexpr int kEmbeddingThreads = 128;

template <QuantFormat F>
__global__ void __launch_bounds__(kEmbeddingThreads)
    QuantEmbeddingKernel(const uint8_t* __restrict__ table, const int32_t* __restrict__ ids,
                         float* __restrict__ output, int32_t* invalid_id_flag, int64_t vocab,
                         int64_t vocab_begin, int64_t table_rows, int64_t hidden,
                         int64_t num_tokens) {
  const int64_t subs = hidden / kQuantBlockSize * 4;  // sub-blocks of 8 weights in a row
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t id = ids[t];
    float* y = output + t * hidden;
    const int64_t local = static_cast<int64_t>(id) - vocab_begin;
    if (id < 0 || id >= vocab || local < 0 || local >= table_rows) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) y[i] = 0.f;
      if ((id < 0 || id >= vocab) && threadIdx.x == 0 && invalid_id_flag != nullptr) {
        atomicExch(invalid_id_flag, 1);
      }
      continue;
    }
    const uint8_t* row = table + local * (hidden / kBlockElems<F>) * kBlockBytes<F>;
    for (int64_t s = threadIdx.x; s < subs; s += blockDim.x) {
      const int64_t g = s / 4;
      const int sub = static_cast<int>(s % 4);
      float w[8];
      DecodeEight<F>(row, g, sub, w);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[g * kQuantBlockSize + ColumnOf<F>(sub, e)] = w[e];
    }
  }
}

template <QuantFormat F>
absl::Status LaunchEmbeddingFormat(const QuantEmbeddingParams& p, cudaStream_t stream) {
  const int64_t rows = p.table_rows == 0 ? p.vocab : p.table_rows;
  QuantEmbeddingKernel<F><<<GridStrideBlocks(p.num_tokens, 1), kEmbeddingThreads, 0, stream>>>(
      p.table, p.ids, p.output, p.invalid_id_flag, p.vocab, p.vocab_begin, rows, p.hidden,
      p.num_tokens);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantEmbeddingParams::Validate() const {
  if (table == nullptr) return absl::InvalidArgumentError("QuantEmbeddingParams.table is null");
  if (output == nullptr) return absl::InvalidArgumentError("QuantEmbeddingParams.output is null");
  if (ids == nullptr && num_tokens > 0) {
    return absl::InvalidArgumentError("QuantEmbeddingParams.ids is null");
  }
  if (!IsAligned(table, alignof(uint16_t))) {
    return absl::InvalidArgumentError("QuantEmbeddingParams.table is not 2-byte aligned");
  }
  if (!IsAligned(output, alignof(float))) {
    return absl::InvalidArgumentError("QuantEmbeddingParams.output is not 4-byte aligned");
  }
  if (QuantBlockBytes(format) == 0) {
    return absl::InvalidArgumentError("QuantEmbeddingParams.format is not a known format");
  }
  if (vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantEmbeddingParams.vocab must be > 0: ", vocab));
  }
  if (vocab_begin < 0 || table_rows < 0 || vocab_begin + table_rows > vocab ||
      (table_rows == 0 && vocab_begin != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantEmbeddingParams.vocab_begin + table_rows (", vocab_begin, " + ", table_rows,
        ") must lie within the vocabulary of ", vocab));
  }
  if (hidden <= 0 || hidden % QuantBlockElements(format) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantEmbeddingParams.hidden must be a positive multiple of ",
                     QuantBlockElements(format), ": ", hidden));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantEmbeddingParams.num_tokens must be >= 0: ", num_tokens));
  }
  return absl::OkStatus();
}

absl::Status LaunchQuantEmbedding(const QuantEmbeddingParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0) return absl::OkStatus();
  switch (p.format) {
    case QuantFormat::kQ8_0: return LaunchEmbeddingFormat<QuantFormat::kQ8_0>(p, stream);
    case QuantFormat::kQ4_0: return LaunchEmbeddingFormat<QuantFormat::kQ4_0>(p, stream);
    case QuantFormat::kQ4_1: return LaunchEmbeddingFormat<QuantFormat::kQ4_1>(p, stream);
    case QuantFormat::kQ4_Z: return LaunchEmbeddingFormat<QuantFormat::kQ4_Z>(p, stream);
    case QuantFormat::kQ5_0: return LaunchEmbeddingFormat<QuantFormat::kQ5_0>(p, stream);
    case QuantFormat::kQ5_1: return LaunchEmbeddingFormat<QuantFormat::kQ5_1>(p, stream);
    case QuantFormat::kIQ4_NL: return LaunchEmbeddingFormat<QuantFormat::kIQ4_NL>(p, stream);
    case QuantFormat::kQ2_K: return LaunchEmbeddingFormat<QuantFormat::kQ2_K>(p, stream);
    case QuantFormat::kQ3_K: return LaunchEmbeddingFormat<QuantFormat::kQ3_K>(p, stream);
    case QuantFormat::kQ4_K: return LaunchEmbeddingFormat<QuantFormat::kQ4_K>(p, stream);
    case QuantFormat::kQ5_K: return LaunchEmbeddingFormat<QuantFormat::kQ5_K>(p, stream);
    case QuantFormat::kQ6_K: return LaunchEmbeddingFormat<QuantFormat::kQ6_K>(p, stream);
  }
  return absl::InvalidArgumentError("QuantEmbeddingParams.format is not a known format");
}

absl::Status QuantLinearParams::Validate() const {
  if (input == nullptr && num_tokens > 0) {
    return absl::InvalidArgumentError("QuantLinearParams.input is null");
  }
  if (weight == nullptr) return absl::InvalidArgumentError("QuantLinearParams.weight is null");
  if (output == nullptr) return absl::InvalidArgumentError("QuantLinearParams.output is null");
  if (!IsAligned(input, alignof(float))) {
    return absl::InvalidArgumentError("QuantLinearParams.input is not 4-byte aligned");
  }
  if (!IsAligned(weight, alignof(uint16_t))) {
    return absl::InvalidArgumentError("QuantLinearParams.weight is not 2-byte aligned");
  }
  if (!IsAligned(input_perm, alignof(int32_t))) {
    return absl::InvalidArgumentError("QuantLinearParams.input_perm is not 4-byte aligned");
  }
  if (!IsAligned(bias, alignof(float))) {
    return absl::InvalidArgumentError("QuantLinearParams.bias is not 4-byte aligned");
  }
  if (!IsAligned(output, alignof(float))) {
    return absl::InvalidArgumentError("QuantLinearParams.output is not 4-byte aligned");
  }
  if (QuantBlockBytes(format) == 0) {
    return absl::InvalidArgumentError("QuantLinearParams.format is not a known format");
  }
  if (num_tokens < 0 || num_tokens > kQuantLinearMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat("QuantLinearParams.num_tokens must be in [0, ",
                                                   kQuantLinearMaxTokens, "]: ", num_tokens));
  }
  if (in_features <= 0 || in_features % QuantBlockElements(format) != 0 ||
      in_features > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantLinearParams.in_features must be a positive multiple of ",
        QuantBlockElements(format), " up to INT32_MAX: ", in_features));
  }
  if (out_features <= 0 || out_features > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantLinearParams.out_features must be in (0, INT32_MAX]: ", out_features));
  }
  if (output_stride != 0 && output_stride < out_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantLinearParams.output_stride must be 0 or at least out_features (", out_features,
        "): ", output_stride));
  }
  return absl::OkStatus();
}

absl::Status LaunchQuantLinear(const QuantLinearParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0) return absl::OkStatus();
  switch (p.format) {
    case QuantFormat::kQ8_0: return LaunchFormat<QuantFormat::kQ8_0>(p, stream);
    case QuantFormat::kQ4_0: return LaunchFormat<QuantFormat::kQ4_0>(p, stream);
    case QuantFormat::kQ4_1: return LaunchFormat<QuantFormat::kQ4_1>(p, stream);
    case QuantFormat::kQ4_Z: return LaunchFormat<QuantFormat::kQ4_Z>(p, stream);
    case QuantFormat::kQ5_0: return LaunchFormat<QuantFormat::kQ5_0>(p, stream);
    case QuantFormat::kQ5_1: return LaunchFormat<QuantFormat::kQ5_1>(p, stream);
    case QuantFormat::kIQ4_NL: return LaunchFormat<QuantFormat::kIQ4_NL>(p, stream);
    case QuantFormat::kQ2_K: return LaunchFormat<QuantFormat::kQ2_K>(p, stream);
    case QuantFormat::kQ3_K: return LaunchFormat<QuantFormat::kQ3_K>(p, stream);
    case QuantFormat::kQ4_K: return LaunchFormat<QuantFormat::kQ4_K>(p, stream);
    case QuantFormat::kQ5_K: return LaunchFormat<QuantFormat::kQ5_K>(p, stream);
    case QuantFormat::kQ6_K: return LaunchFormat<QuantFormat::kQ6_K>(p, stream);
  }
  return absl::InvalidArgumentError("QuantLinearParams.format is not a known format");
}

}  // namespace kvgrid::kernels::cuda
