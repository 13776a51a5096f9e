// Linear layers with 8- and 4-bit weights in ggml's block formats: blocks of 32 weights along
// a row, each with an fp16 scale d. Q8_0 stores 32 int8 (w = d q); Q4_0 32 nibbles with value i
// in the low and value i + 16 in the high nibble of byte i (w = d (q - 8)); Q4_1 adds an fp16
// offset m after d (w = d q + m). Q4_Z, kvgrid's own, is Q4_1 with the zero point z in place of
// m (w = d (q - z)): AWQ and GPTQ checkpoints store exactly that, and -d z would not always
// round to fp16 exactly. Computing dequantizes one row (or one tile of rows) at a time into a
// small buffer, never the whole matrix, so a decode step reads only the quantized bytes.
#ifndef KVGRID_KERNELS_CPU_QUANT_LINEAR_H_
#define KVGRID_KERNELS_CPU_QUANT_LINEAR_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/gguf.h"

namespace kvgrid::kernels::cpu {

enum class WeightDType : uint8_t { kF32, kQ8_0, kQ4_0, kQ4_1, kQ4_Z };
std::string_view WeightDTypeName(WeightDType dtype);
// "fp32"/"f32", "q8_0", "q4_0", "q4_1" (Q4_Z only comes from checkpoints).
// Errors: INVALID_ARGUMENT listing the choices.
absl::StatusOr<WeightDType> ParseWeightDType(std::string_view name);

inline constexpr int64_t kQuantBlock = 32;

// A [rows, cols] matrix in Q8_0, Q4_0, Q4_1 or Q4_Z blocks, rows contiguous; cols % 32 == 0.
//
// `input_perm`, when not empty, says the columns are stored in a different order than the
// layer's inputs: stored column j multiplies input input_perm[j]. GPTQ's act-order checkpoints
// need it: their quantization groups are sets of scattered input channels, which become
// contiguous blocks once the columns are sorted by group.
struct QuantMatrix {
  WeightDType dtype = WeightDType::kQ8_0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data = {};          // [rows, cols / 32] blocks
  std::vector<int32_t> input_perm = {};  // [cols] or empty (identity)

  [[nodiscard]] static int64_t BlockBytes(WeightDType dtype);  // 34, 18 or 20 (Q4_1, Q4_Z)
  [[nodiscard]] int64_t RowBytes() const { return cols / kQuantBlock * BlockBytes(dtype); }
  [[nodiscard]] bool empty() const { return rows == 0; }
};

// Round-to-nearest quantization of row-major fp32 `weight` ([rows, cols]): Q8_0 scales each
// block by max|w| / 127 (error <= half a step); Q4_0 by the signed value of largest magnitude
// / -8 (error <= half a step, one step for values near the opposite extreme, which clamp at
// +7); Q4_1 maps [min, max] onto 0..15 (error <= half a step of (max - min) / 15); Q4_Z
// likewise with an integer zero point (error <= one step when min rounds).
// Errors: INVALID_ARGUMENT when cols is not a multiple of 32 or dtype is not quantized.
absl::StatusOr<QuantMatrix> QuantizeMatrix(const float* weight, int64_t rows, int64_t cols,
                                           WeightDType dtype);

// out[0, cols) = row `row` of `m` as fp32, in storage order (see input_perm).
void DequantizeRow(const QuantMatrix& m, int64_t row, float* out);

// The whole matrix as row-major fp32 [rows, cols] in the layer's input order (input_perm
// undone): for tests, and for fusing matrices that cannot stay quantized together.
std::vector<float> DequantizeMatrix(const QuantMatrix& m);

// A GGUF Q8_0/Q4_0/Q4_1 tensor as a QuantMatrix of rows of ne[0] (ggml's block layout is this
// one). Errors: INVALID_ARGUMENT for other types or rows that are not whole blocks.
absl::StatusOr<QuantMatrix> QuantMatrixFromGguf(const model::GgufTensor& tensor);

// A GGUF tensor's elements as fp32 in storage order: F32/F16/BF16 converted, Q8_0/Q4_0/Q4_1
// dequantized. Errors: as QuantMatrixFromGguf.
absl::Status GgufTensorToF32(const model::GgufTensor& tensor, std::vector<float>* out);

struct QuantLinearParams {
  const float* input = nullptr;        // [num_tokens, weight->cols]
  const QuantMatrix* weight = nullptr;  // [out_features, in_features]
  const float* bias = nullptr;         // [out_features] or null
  float* output = nullptr;             // [num_tokens, weight->rows]; must not alias input
  int64_t num_tokens = 0;
  bool accumulate = false;             // output += instead of output =

  absl::Status Validate() const;
};

// output = input x dequant(weight)^T (+ bias). Up to a few tokens each row is dequantized into
// a per-thread buffer and dotted with every token; above, tiles of rows go through SGEMM.
// Parallel over rows. A weight with input_perm first gathers the inputs into its order.
absl::Status QuantLinear(const QuantLinearParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_QUANT_LINEAR_H_
