// SiLU-gated MLP activation: output = silu(gate) * up.
#ifndef KVGRID_KERNELS_CPU_ACTIVATION_H_
#define KVGRID_KERNELS_CPU_ACTIVATION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cpu {

struct SiluAndMulParams {
  const float* gate_up = nullptr;  // [num_tokens, 2 * intermediate]: gate then up per row
  float* output = nullptr;         // [num_tokens, intermediate]
  int64_t num_tokens = 0;
  int64_t intermediate = 0;

  absl::Status Validate() const;
};

absl::Status SiluAndMul(const SiluAndMulParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_ACTIVATION_H_
