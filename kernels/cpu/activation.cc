#include "kernels/cpu/activation.h"

#include <cmath>

namespace kvgrid::kernels::cpu {

absl::Status SiluAndMulParams::Validate() const {
  if (!gate_up || !output) return absl::InvalidArgumentError("SiluAndMulParams: null pointer");
  if (num_tokens < 0 || intermediate <= 0) {
    return absl::InvalidArgumentError("SiluAndMulParams: sizes out of range");
  }
  return absl::OkStatus();
}

absl::Status SiluAndMul(const SiluAndMulParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const int64_t total = p.num_tokens * p.intermediate;
#pragma omp parallel for schedule(static) if (total > 16384)
  for (int64_t idx = 0; idx < total; ++idx) {
    const int64_t t = idx / p.intermediate;
    const int64_t i = idx % p.intermediate;
    const float g = p.gate_up[t * 2 * p.intermediate + i];
    const float u = p.gate_up[t * 2 * p.intermediate + p.intermediate + i];
    p.output[idx] = g / (1.f + std::exp(-g)) * u;
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
