// Linear layers with 8- and 4-bit weights in ggml's block formats: blocks of 32 weights along
// a row, each with an fp16 scale d. Q8_0 stores 32 int8 (w = d q); Q4_0 32 nibbles with value i
// in the low and value i + 16 in the high nibble of byte i (w = d (q - 8)); Q4_1 adds an fp16
// offset m after d (w = d q + m). Q4_Z, kvgrid's own, is Q4_1 with the zero point z in place of
// m (w = d (q - z)): AWQ and GPTQ checkpoints store exactly that, and -d z would not always
// round to fp16 exactly. GGUF files add more of ggml's formats, kept in their blocks as read
// (kernels/cpu/ggml_blocks.h has their layouts): Q5_0, Q5_1 and IQ4_NL in blocks of 32, and the
// K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K in super-blocks of 256. Computing dequantizes one
// row (or one tile of rows, or a few blocks) at a time into a small buffer, never the whole
// matrix, so a decode step reads only the quantized bytes.
#ifndef KVGRID_KERNELS_CPU_QUANT_LINEAR_H_
#define KVGRID_KERNELS_CPU_QUANT_LINEAR_H_

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/gguf.h"

namespace kvgrid::kernels::cpu {

enum class WeightDType : uint8_t {
  kF32, kQ8_0, kQ4_0, kQ4_1, kQ4_Z,
  kQ5_0, kQ5_1, kIQ4_NL, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K,  // read from GGUF files only
  // 16-bit floats held as such (a "block" of one value, 2 bytes), widened in registers.
  kF16, kBF16,
};
std::string_view WeightDTypeName(WeightDType dtype);  // "q8_0", "q4_k", "fp16", ...
// "fp32"/"f32", "fp16"/"f16", "bf16", "q8_0", "q4_0", "q4_1": what QuantizeMatrix writes (Q4_Z
// only comes from checkpoints, the others from GGUF files).
// Errors: INVALID_ARGUMENT listing the choices.
absl::StatusOr<WeightDType> ParseWeightDType(std::string_view name);

inline constexpr int64_t kQuantBlock = 32;   // weights per block (Q8_0 .. IQ4_NL)
inline constexpr int64_t kSuperBlock = 256;  // weights per K-quant super-block (Q2_K .. Q6_K)

// F16 or BF16: 16-bit floats rather than blocks.
[[nodiscard]] inline bool IsFloat16(WeightDType dtype) {
  return dtype == WeightDType::kF16 || dtype == WeightDType::kBF16;
}

// A [rows, cols] matrix in blocks of one quantized dtype (or in 16-bit floats), rows contiguous;
// cols % BlockElements(dtype) == 0.
//
// `input_perm`, when not empty, says the columns are stored in a different order than the
// layer's inputs: stored column j multiplies input input_perm[j]. GPTQ's act-order checkpoints
// need it: their quantization groups are sets of scattered input channels, which become
// contiguous blocks once the columns are sorted by group.
struct QuantMatrix {
  WeightDType dtype = WeightDType::kQ8_0;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data = {};          // [rows, cols / BlockElements(dtype)] blocks
  std::vector<int32_t> input_perm = {};  // [cols] or empty (identity)
  // Rows interleaved 16 at a time for the AVX-512 VNNI kernels (kernels/cpu/interleaved_linear.h
  // has the layout; Q8_0, Q4_0, Q4_1 and Q4_Z only): the same bytes, but row r no longer starts at
  // r * RowBytes(). DequantizeRow and QuantLinear read either layout.
  bool interleaved = false;

  // Weights per block: 32, 256 for the K-quants, 1 for F16/BF16 (0 for fp32).
  [[nodiscard]] static int64_t BlockElements(WeightDType dtype);
  // Bytes per block: 34 (Q8_0), 18 (Q4_0, IQ4_NL), 20 (Q4_1, Q4_Z), 22 (Q5_0), 24 (Q5_1),
  // 84 (Q2_K), 110 (Q3_K), 144 (Q4_K), 176 (Q5_K), 210 (Q6_K), 2 (F16, BF16); 0 for fp32.
  [[nodiscard]] static int64_t BlockBytes(WeightDType dtype);
  [[nodiscard]] int64_t RowBytes() const {
    return cols / BlockElements(dtype) * BlockBytes(dtype);
  }
  [[nodiscard]] bool empty() const { return rows == 0; }
};

// Round-to-nearest quantization of row-major fp32 `weight` ([rows, cols]): Q8_0 scales each
// block by max|w| / 127 (error <= half a step); Q4_0 by the signed value of largest magnitude
// / -8 (error <= half a step, one step for values near the opposite extreme, which clamp at
// +7); Q4_1 maps [min, max] onto 0..15 (error <= half a step of (max - min) / 15); Q4_Z
// likewise with an integer zero point (error <= one step when min rounds).
// F16 and BF16 round each weight to nearest even (any cols).
// Errors: INVALID_ARGUMENT when cols is not a multiple of 32 (block formats) or dtype is not one
// of these six.
absl::StatusOr<QuantMatrix> QuantizeMatrix(const float* weight, int64_t rows, int64_t cols,
                                           WeightDType dtype);

// out[0, cols) = row `row` of `m` as fp32, in storage order (see input_perm).
void DequantizeRow(const QuantMatrix& m, int64_t row, float* out);

// The whole matrix as row-major fp32 [rows, cols] in the layer's input order (input_perm
// undone): for tests, and for fusing matrices that cannot stay quantized together.
std::vector<float> DequantizeMatrix(const QuantMatrix& m);

// The block-format WeightDType holding GGUF type `type` as is, or nullopt for F32/F16/BF16.
std::optional<WeightDType> WeightDTypeOfGgml(model::GgmlType type);
// The WeightDType a GGUF matrix of `type` is held in: its blocks, or kF16/kBF16 for F16/BF16;
// nullopt for F32 (held as fp32 vectors).
std::optional<WeightDType> HeldDTypeOfGgml(model::GgmlType type);

// A GGUF block-format, F16 or BF16 tensor as a QuantMatrix of rows of ne[0] (ggml's block
// layouts are these). Errors: INVALID_ARGUMENT naming the tensor and its type for F32, rows
// (ne[0]) that are not whole blocks (ggml requires them), or data of the wrong size.
absl::StatusOr<QuantMatrix> QuantMatrixFromGguf(const model::GgufTensor& tensor);

// A GGUF tensor's elements as fp32 in storage order: F32/F16/BF16 converted, block formats
// dequantized (bit for bit ggml's dequantize_row_*). Errors: INVALID_ARGUMENT naming the
// tensor as QuantMatrixFromGguf.
absl::Status GgufTensorToF32(const model::GgufTensor& tensor, std::vector<float>* out);

// How QuantLinear multiplies at decode sizes (up to kInt8BatchTokens tokens). kFast quantizes
// the input rows to 8 bits once per call and runs integer dot products where the weight's
// format has them (kernels/cpu/q8_activations.h: Q8_0, Q4_0, Q4_1, Q4_Z on AVX2), as llama.cpp
// does; kExact multiplies the fp32 inputs with the weights decoded in registers: the reference
// the CUDA kernels are checked against, and the baseline of the int8 path's quality checks.
// Other formats, and larger batches (SGEMM on decoded tiles), are computed alike by both.
enum class LinearPrecision : uint8_t { kFast, kExact };

// Up to this many tokens kFast runs the integer dot products; above, tiles of decoded rows go
// through SGEMM. At 8 and 16 tokens the integer path measured slower than SGEMM on a 896-wide
// matrix and faster on a 4864-wide one (bench/quant_linear_bench), so batched decode stays on
// SGEMM until the integer kernels share work across rows.
inline constexpr int64_t kInt8BatchTokens = 4;

struct QuantLinearParams {
  const float* input = nullptr;        // [num_tokens, weight->cols]
  const QuantMatrix* weight = nullptr;  // [out_features, in_features]
  const float* bias = nullptr;         // [out_features] or null
  float* output = nullptr;             // [num_tokens, OutputStride()] (the first weight->rows
                                       // of each row written); must not alias input
  int64_t num_tokens = 0;
  bool accumulate = false;             // output += instead of output =
  // Floats from one token's output row to the next: 0 means weight->rows; larger writes a
  // column slice of a wider output (a fused projection held as parts of different dtypes).
  int64_t output_stride = 0;
  LinearPrecision precision = LinearPrecision::kFast;

  [[nodiscard]] int64_t OutputStride() const {
    return output_stride == 0 && weight ? weight->rows : output_stride;
  }

  absl::Status Validate() const;
};

// output = input x dequant(weight)^T (+ bias). Up to a few tokens each row is read once and
// dotted with every token (in integers on 8-bit inputs under kFast, see LinearPrecision; else
// decoded in registers or into a per-thread buffer); above, tiles of rows go through SGEMM.
// Parallel over rows. A weight with input_perm first gathers the inputs into its order.
absl::Status QuantLinear(const QuantLinearParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_QUANT_LINEAR_H_
