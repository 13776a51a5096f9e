#include "kernels/kv_dtype.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels {

KvRowLayout KvRowLayoutFor(KvDType dtype, int64_t head_dim) {
  switch (dtype) {
    case KvDType::kF32:
      return {4 * head_dim, 0};
    case KvDType::kF16:
    case KvDType::kBF16:
      return {2 * head_dim, 0};
    case KvDType::kInt8:
    case KvDType::kFp8E4m3:
      return {head_dim, 2};
    case KvDType::kInt4:
      return {(head_dim + 1) / 2, 2 * ((head_dim + kInt4GroupSize - 1) / kInt4GroupSize)};
  }
  return {};
}

std::string_view KvDTypeName(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return "fp32";
    case KvDType::kF16:
      return "fp16";
    case KvDType::kBF16:
      return "bf16";
    case KvDType::kInt8:
      return "int8";
    case KvDType::kInt4:
      return "int4";
    case KvDType::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "?";
}

absl::StatusOr<KvDType> ParseKvDType(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "f32") return KvDType::kF32;
  if (name == "fp16" || name == "float16" || name == "f16" || name == "half") return KvDType::kF16;
  if (name == "bf16" || name == "bfloat16") return KvDType::kBF16;
  if (name == "int8") return KvDType::kInt8;
  if (name == "int4") return KvDType::kInt4;
  if (name == "fp8_e4m3" || name == "fp8") return KvDType::kFp8E4m3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache dtype '", std::string(name),
                   "' (accepted: fp32, fp16, bf16, int8, int4, fp8_e4m3)"));
}

}  // namespace kvgrid::kernels
