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
// A block is handled by 4 lanes ("sub-blocks" 0..3) of 8 weights each. Q8_0's sub-block s
// holds values 8s..8s+7; a 4-bit format's holds the nibbles of bytes 4s..4s+3, which are values
// 4s..4s+3 (low nibbles) and 16+4s..16+4s+3 (high nibbles). Blocks are 18, 20 or 34 bytes, so
// only 2-byte alignment holds: the bytes are read as 16-bit words.

// Per-format constants as variable templates: usable in device code, unlike the host
// constexpr function they come from.
template <QuantFormat F>
constexpr int64_t kBlockBytes = QuantBlockBytes(F);
template <QuantFormat F>
constexpr int kHeaderBytes = F == QuantFormat::kQ4_1 || F == QuantFormat::kQ4_Z ? 4 : 2;

__device__ __forceinline__ uint16_t Load16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}

__device__ __forceinline__ float HalfToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));  // exact for every non-NaN fp16
}

// The column (0..31, within its block) of weight e (0..7) of sub-block `sub`.
template <QuantFormat F>
__device__ __forceinline__ int ColumnOf(int sub, int e) {
  if constexpr (F == QuantFormat::kQ8_0) {
    return 8 * sub + e;
  } else {
    return e < 4 ? 4 * sub + e : 16 + 4 * sub + (e - 4);
  }
}

// w[e] = weight ColumnOf(sub, e) of `block`, computed as kernels/cpu/quant_linear.cc does
// (products of an fp16 and a small integer are exact; Q4_1/Q4_Z fuse the offset with one fma).
template <QuantFormat F>
__device__ __forceinline__ void DecodeEight(const uint8_t* block, int sub, float w[8]) {
  const float d = HalfToFloat(Load16(block));
  if constexpr (F == QuantFormat::kQ8_0) {
    const uint8_t* q = block + 2 + 8 * sub;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint16_t pair = Load16(q + 2 * j);  // little-endian: the first value is low
      w[2 * j] = d * static_cast<float>(static_cast<int8_t>(pair & 0xffu));
      w[2 * j + 1] = d * static_cast<float>(static_cast<int8_t>(pair >> 8));
    }
  } else {
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
                    float* __restrict__ output, int64_t k, int64_t n, bool accumulate) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (row >= n) return;  // per warp: the shuffles below see whole warps only
  const int64_t blocks = k / kQuantBlockSize;
  const uint8_t* w_row = weight + row * blocks * kBlockBytes<F>;
  const int sub = lane % 4;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  for (int64_t b = lane / 4; b < blocks; b += 8) {
    float w[8];
    DecodeEight<F>(w_row + b * kBlockBytes<F>, sub, w);
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
    for (int t = 0; t < T; ++t) StoreOutput(output + t * n + row, acc[t], bias, row, accumulate);
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
                    bool accumulate) {
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
      dec_valid ? weight + (row0 + dec_row) * blocks * kBlockBytes<F> : weight;

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
      DecodeEight<F>(dec_base + b * kBlockBytes<F>, dec_sub, w);
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
      if (row < n) StoreOutput(output + token * n + row, acc[i][j], bias, row, accumulate);
    }
  }
}

template <QuantFormat F, int T>
void LaunchGemv(const QuantLinearParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.out_features + kGemvWarps - 1) / kGemvWarps);
  QuantGemvKernel<F, T><<<blocks, kGemvWarps * 32, 0, stream>>>(
      p.input, p.weight, p.input_perm, p.bias, p.output, p.in_features, p.out_features,
      p.accumulate);
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
          p.out_features, p.accumulate);
    }
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

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
  if (format != QuantFormat::kQ8_0 && format != QuantFormat::kQ4_0 &&
      format != QuantFormat::kQ4_1 && format != QuantFormat::kQ4_Z) {
    return absl::InvalidArgumentError("QuantLinearParams.format is not a known format");
  }
  if (num_tokens < 0 || num_tokens > kQuantLinearMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat("QuantLinearParams.num_tokens must be in [0, ",
                                                   kQuantLinearMaxTokens, "]: ", num_tokens));
  }
  if (in_features <= 0 || in_features % kQuantBlockSize != 0 || in_features > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantLinearParams.in_features must be a positive multiple of 32 up to INT32_MAX: ",
        in_features));
  }
  if (out_features <= 0 || out_features > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantLinearParams.out_features must be in (0, INT32_MAX]: ", out_features));
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
  }
  return absl::InvalidArgumentError("QuantLinearParams.format is not a known format");
}

}  // namespace kvgrid::kernels::cuda
