#include "kernels/kv_dtype.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels {

size_t KvDTypeSize(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return 4;
    case KvDType::kF16:
      return 2;
  }
  return 0;
}

std::string_view KvDTypeName(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32:
      return "fp32";
    case KvDType::kF16:
      return "fp16";
  }
  return "?";
}

absl::StatusOr<KvDType> ParseKvDType(std::string_view name) {
  if (name == "fp32" || name == "float32" || name == "f32") return KvDType::kF32;
  if (name == "fp16" || name == "float16" || name == "f16" || name == "half") return KvDType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown KV cache dtype '", std::string(name), "' (accepted: fp32, fp16)"));
}

}  // namespace kvgrid::kernels
