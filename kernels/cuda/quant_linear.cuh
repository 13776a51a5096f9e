// Linear layers with 8- and 4-bit block-quantized weights on the GPU:
// output = input x dequant(weight)^T (+ bias), fp32 input and output, fp32 accumulation.
//
// The formats and their byte layout are kernels/cpu/quant_linear.h's (cpu::QuantMatrix::data
// uploaded as is): rows of 32-weight blocks, each with an fp16 scale d; Q8_0 stores 32 int8
// (w = d q), Q4_0 16 bytes of nibbles, value i low and value i + 16 high in byte i
// (w = d (q - 8)); Q4_1 adds an fp16 offset m after d (w = d q + m); Q4_Z an fp16 zero point z
// instead (w = d (q - z)). The formats GGUF files bring are ggml's, as kernels/cpu/ggml_blocks.h
// lays them out: Q5_0, Q5_1 and IQ4_NL in blocks of 32, and the K-quants Q2_K..Q6_K in
// super-blocks of 256 weights whose 32-weight groups are decoded one at a time. Each weight is
// decoded with the CPU's own arithmetic, so it is the same float the CPU kernel multiplies;
// results differ from cpu::QuantLinear only in the order of the fp32 sums.
//
// The weights are dequantized inside the kernels and never expanded in memory:
//   num_tokens <= kQuantGemvMaxTokens (decode): one warp per output row reads the row's blocks
//     once (4 lanes per 32 weights, 8 such groups per step) and dots them with every token's
//     input, so the step costs one pass over the quantized bytes;
//   above it (prefill): 64 x 64 output tiles; for each 32-column step a block of 256 threads
//     decodes the tile's 64 weight blocks (or K-quant groups) into shared memory as fp32 next
//     to the 64 tokens' inputs, and accumulates with fp32 FMAs. This keeps the CPU's numerics
//     (fp32 weights and products; a bf16 scratch tile + cuBLAS would round every weight and
//     input to 8 bits of mantissa) at the cost of tensor-core speed; a tensor-core variant can
//     replace it behind the same params.
// With input_perm, both paths read input column input_perm[j] for stored column j on the fly
// (no gathered copy).
#ifndef KVGRID_KERNELS_CUDA_QUANT_LINEAR_CUH_
#define KVGRID_KERNELS_CUDA_QUANT_LINEAR_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

// The quantized values of cpu::WeightDType, same formats and layout.
enum class QuantFormat : uint8_t {
  kQ8_0, kQ4_0, kQ4_1, kQ4_Z,
  kQ5_0, kQ5_1, kIQ4_NL, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K,
};

inline constexpr int64_t kQuantBlockSize = 32;       // weights per group the kernels decode
inline constexpr int64_t kQuantGemvMaxTokens = 8;    // the decode path's limit
inline constexpr int64_t kQuantLinearMaxTokens = int64_t{65535} * 64;  // grid.y * tile

constexpr bool IsKQuant(QuantFormat format) {
  return format == QuantFormat::kQ2_K || format == QuantFormat::kQ3_K ||
         format == QuantFormat::kQ4_K || format == QuantFormat::kQ5_K ||
         format == QuantFormat::kQ6_K;
}

// Weights per block: 32, or 256 for the K-quants, as cpu::QuantMatrix::BlockElements.
constexpr int64_t QuantBlockElements(QuantFormat format) {
  return IsKQuant(format) ? 256 : kQuantBlockSize;
}

// Bytes of one block, as cpu::QuantMatrix::BlockBytes.
constexpr int64_t QuantBlockBytes(QuantFormat format) {
  switch (format) {
    case QuantFormat::kQ8_0: return 34;
    case QuantFormat::kQ4_0: return 18;
    case QuantFormat::kQ4_1: case QuantFormat::kQ4_Z: return 20;
    case QuantFormat::kQ5_0: return 22;
    case QuantFormat::kQ5_1: return 24;
    case QuantFormat::kIQ4_NL: return 18;
    case QuantFormat::kQ2_K: return 84;
    case QuantFormat::kQ3_K: return 110;
    case QuantFormat::kQ4_K: return 144;
    case QuantFormat::kQ5_K: return 176;
    case QuantFormat::kQ6_K: return 210;
  }
  return 0;
}

struct QuantLinearParams {
  const float* input = nullptr;          // [num_tokens, in_features], device, 4-byte aligned
  const uint8_t* weight = nullptr;       // [out_features, in_features /
                                         // QuantBlockElements(format)] blocks of
                                         // QuantBlockBytes(format) bytes, device, 2-byte aligned
  const int32_t* input_perm = nullptr;   // [in_features], device, or null (identity): stored
                                         // column j multiplies input column input_perm[j]; an
                                         // entry outside [0, in_features) reads 0
  const float* bias = nullptr;           // [out_features], device, or null
  float* output = nullptr;               // [num_tokens, OutputStride()] (the first
                                         // out_features of each row written), device; must not
                                         // overlap input
  QuantFormat format = QuantFormat::kQ8_0;
  int64_t num_tokens = 0;    // 0 launches nothing; at most kQuantLinearMaxTokens
  int64_t in_features = 0;   // a multiple of QuantBlockElements(format), at most INT32_MAX
  int64_t out_features = 0;  // at most INT32_MAX
  bool accumulate = false;   // output += instead of output =
  // Floats from one token's output row to the next: 0 means out_features; larger writes a
  // column slice of a wider output (a fused projection held as parts of different formats).
  int64_t output_stride = 0;

  [[nodiscard]] int64_t OutputStride() const {
    return output_stride == 0 ? out_features : output_stride;
  }
  // INVALID_ARGUMENT naming the field for null or misaligned pointers or sizes out of range.
  absl::Status Validate() const;
};

// Enqueues the kernel for params.num_tokens (see the file comment) on `stream`.
// Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchQuantLinear(const QuantLinearParams& params, cudaStream_t stream);

// The token embedding lookup from a table in these formats (a GGUF file's token_embd kept in
// its blocks): output[t] = row ids[t] decoded to fp32, the same floats as the CPU's
// DequantizeRow; only the rows looked up are read. It lives here to share the block decoders.
// Ids outside [0, vocab) and vocabulary-parallel slices behave as kernels/cuda/embedding.cuh's
// lookup: a row of zeros, and `invalid_id_flag` set for an invalid id.
struct QuantEmbeddingParams {
  const uint8_t* table = nullptr;  // [table_rows, hidden / QuantBlockElements(format)] blocks,
                                   // device, 2-byte aligned
  const int32_t* ids = nullptr;    // [num_tokens], device
  float* output = nullptr;         // [num_tokens, hidden], device
  int32_t* invalid_id_flag = nullptr;  // [1], device, or null: set to 1 (never cleared)
  QuantFormat format = QuantFormat::kQ8_0;
  int64_t vocab = 0;
  int64_t vocab_begin = 0;  // the vocabulary row of the table's first row
  int64_t table_rows = 0;   // rows in the table; 0: vocab
  int64_t hidden = 0;       // a multiple of QuantBlockElements(format)
  int64_t num_tokens = 0;   // 0 launches nothing

  // INVALID_ARGUMENT naming the field for null or misaligned pointers or sizes out of range.
  absl::Status Validate() const;
};

// Enqueues the lookup on `stream`. Errors: Validate()'s, or INTERNAL naming the CUDA call.
absl::Status LaunchQuantEmbedding(const QuantEmbeddingParams& params, cudaStream_t stream);

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_QUANT_LINEAR_CUH_
