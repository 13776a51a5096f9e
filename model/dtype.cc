#include "model/dtype.h"

namespace kvgrid::model {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI8:
    case DType::kU8:
      return 1;
  }
  // Only reachable with a value cast from outside the enum; 0 makes any size check fail
  // instead of reading out of bounds.
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "i8";
    case DType::kI32:
      return "i32";
    case DType::kU8:
      return "u8";
  }
  return "invalid";
}

}  // namespace kvgrid::model
