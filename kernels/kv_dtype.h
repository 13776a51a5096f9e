// Element types of KV-cache arenas, as the kernels see them, and how one row is stored.
//
// A row is one token of one KV head: head_dim channels. Float types store the values only.
// Quantized types store packed values plus per-row metadata:
//   int8: symmetric, q = round(x / s) in [-127, 127]; one fp16 scale s per row.
//   int4: asymmetric, per group of 32 channels (the last group may be shorter):
//         q = round(x / s) + z in [0, 15], x ~ s * (q - z); two values per byte (low nibble
//         first). Each group's metadata is one 16-bit word: the scale s as an fp16 whose 4
//         low mantissa bits are replaced by the integer zero point z (s is rounded up to a
//         value with those bits clear), so a group costs 16 + 2 bytes and int4 holds 3.56x
//         the tokens of fp16 at head_dim 64. An integer z in [0, 15] means 0 is always
//         representable, so a group's range is stretched to include 0 (a group of values
//         far from 0 gets a coarser step than its own spread would need).
//   fp8_e4m3: one fp16 scale s per row, as int8, with s = max|x| / 448; each value is
//         x / s rounded to the nearest fp8 E4M3 number (4 exponent bits, bias 7, 3 mantissa
//         bits, subnormals; round half to even, saturating at +-448). Relative precision is
//         2^-4 whatever the magnitude, where int8's step is a fixed fraction of the row's
//         largest value. The per-row scale means no model needs calibrated scales. The codes
//         0x7f and 0xff (NaN in OCP E4M3FN) are never written; decoders read them as +-480.
// The encoders (kernels/cpu/kv_quant.h) round half to even; int8 and int4 keep
// |x - x̂| <= s / 2, fp8_e4m3 half an E4M3 step (the bounds are in kv_quant.h).
// Arenas keep values and metadata in separate planes with the same block/head/slot order:
//   values [num_blocks][num_kv_heads][block_size][value_bytes]
//   meta   [num_blocks][num_kv_heads][block_size][meta_bytes]
#ifndef KVGRID_KERNELS_KV_DTYPE_H_
#define KVGRID_KERNELS_KV_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvgrid::kernels {

enum class KvDType : uint8_t {
  kF32,   // reference precision
  kF16,   // IEEE half
  kBF16,  // bfloat16
  kInt8,  // see the file comment
  kInt4,  // see the file comment
  kFp8E4m3,  // see the file comment
};

inline constexpr int64_t kInt4GroupSize = 32;

struct KvRowLayout {
  int64_t value_bytes = 0;  // packed values of one row
  int64_t meta_bytes = 0;   // scales / zero points of one row; 0 for float types
  [[nodiscard]] int64_t total() const { return value_bytes + meta_bytes; }
};

// Storage of one row of `head_dim` channels (head_dim > 0 and even).
KvRowLayout KvRowLayoutFor(KvDType dtype, int64_t head_dim);

std::string_view KvDTypeName(KvDType dtype);
// Parses fp32/float32/f32, fp16/float16/f16/half, bf16/bfloat16, int8, int4, fp8_e4m3/fp8
// (vLLM's spelling). Errors:
// INVALID_ARGUMENT listing the accepted names. ("auto" is resolved by the caller, which knows
// the model's dtype.)
absl::StatusOr<KvDType> ParseKvDType(std::string_view name);

}  // namespace kvgrid::kernels

#endif  // KVGRID_KERNELS_KV_DTYPE_H_
