// 4-bit checkpoints from Hugging Face (AWQ and GPTQ) as QuantMatrix blocks.
//
// Both formats store, per linear layer, unsigned 4-bit weights q packed eight to an int32, and
// per group of `group_size` input channels and per output channel an fp16 scale s and a 4-bit
// zero point z, with w = s (q - z). They differ in how they pack:
//   AWQ (GEMM): qweight [in, out / 8], the eight outputs of an int32 in the order
//               0, 2, 4, 6, 1, 3, 5, 7 from the low nibble up; qzeros [groups, out / 8] alike.
//   GPTQ:       qweight [in / 8, out], eight consecutive inputs per int32 from the low nibble
//               up; qzeros [groups, out / 8], eight consecutive outputs; the original format
//               stores z - 1. g_idx [in] names each input's group (act-order checkpoints
//               scatter a group's inputs over the whole row).
// Each output row becomes Q4_Z blocks of 32 inputs holding s and z as they are (fp16 scales,
// small integers), so the weights are reproduced exactly. That needs every group to be a whole
// number of blocks, so a block has one (s, z); scattered groups are gathered by
// sorting the inputs by group, which QuantMatrix::input_perm records. A layer that does not
// fit blocks (say 688 inputs in groups of 128) is dequantized to fp32 instead.
#ifndef KVGRID_KERNELS_CPU_PACKED_INT4_H_
#define KVGRID_KERNELS_CPU_PACKED_INT4_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cpu/quant_linear.h"

namespace kvgrid::kernels::cpu {

enum class PackedInt4Layout : uint8_t { kAwq, kGptq };

struct PackedInt4Params {
  PackedInt4Layout layout = PackedInt4Layout::kAwq;
  std::string name;                      // the layer, for error messages
  int64_t in_features = 0;               // multiple of 32
  int64_t out_features = 0;              // multiple of 8
  int64_t group_size = 0;                // a multiple of 8, or -1 for one group per row
  std::span<const int32_t> qweight = {};  // AWQ [in, out / 8]; GPTQ [in / 8, out]
  std::span<const int32_t> qzeros = {};   // [groups, out / 8]
  std::span<const float> scales = {};     // [groups, out]
  std::span<const int32_t> g_idx = {};    // GPTQ: [in] or empty (input i in group i / group_size)
  bool zeros_minus_one = false;          // GPTQ's original format

  [[nodiscard]] int64_t groups() const {
    return group_size < 0 ? 1 : (in_features + group_size - 1) / group_size;
  }
  // INVALID_ARGUMENT naming `name` when a size disagrees with the dimensions and group size
  // (the message gives both), or a g_idx entry lies outside [0, groups).
  absl::Status Validate() const;
  // Whether every group is a whole number of 32-input blocks (Validate must have passed).
  [[nodiscard]] bool FitsBlocks() const;
};

// The layer as a [out_features, in_features] Q4_Z QuantMatrix (with input_perm for act-order
// g_idx). Errors: as Validate; INVALID_ARGUMENT when !FitsBlocks().
absl::StatusOr<QuantMatrix> QuantMatrixFromPackedInt4(const PackedInt4Params& params);

// The layer as row-major fp32 [out_features, in_features], s (q - z) exactly.
// Errors: as Validate.
absl::StatusOr<std::vector<float>> DequantizePackedInt4(const PackedInt4Params& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_PACKED_INT4_H_
