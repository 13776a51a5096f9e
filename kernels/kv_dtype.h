// Element types of KV-cache arenas, as the kernels see them.
#ifndef KVGRID_KERNELS_KV_DTYPE_H_
#define KVGRID_KERNELS_KV_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvgrid::kernels {

enum class KvDType : uint8_t {
  kF32,  // reference precision
  kF16,  // IEEE half
};

// Bytes per stored element.
size_t KvDTypeSize(KvDType dtype);
std::string_view KvDTypeName(KvDType dtype);
// Parses "fp32"/"float32"/"f32" and "fp16"/"float16"/"f16". Errors: INVALID_ARGUMENT listing
// the accepted names.
absl::StatusOr<KvDType> ParseKvDType(std::string_view name);

}  // namespace kvgrid::kernels

#endif  // KVGRID_KERNELS_KV_DTYPE_H_
