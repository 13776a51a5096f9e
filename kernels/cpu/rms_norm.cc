#include "kernels/cpu/rms_norm.h"

#include <cmath>

namespace kvgrid::kernels::cpu {

absl::Status RmsNormParams::Validate() const {
  if (!input) return absl::InvalidArgumentError("RmsNormParams.input is null");
  if (!weight) return absl::InvalidArgumentError("RmsNormParams.weight is null");
  if (!output) return absl::InvalidArgumentError("RmsNormParams.output is null");
  if (num_tokens < 0) return absl::InvalidArgumentError("RmsNormParams.num_tokens < 0");
  if (hidden <= 0) return absl::InvalidArgumentError("RmsNormParams.hidden <= 0");
  if (!(eps > 0.f)) return absl::InvalidArgumentError("RmsNormParams.eps <= 0");
  return absl::OkStatus();
}

absl::Status RmsNorm(const RmsNormParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
#pragma omp parallel for schedule(static) if (p.num_tokens > 1)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const float* x = p.input + t * p.hidden;
    float* y = p.output + t * p.hidden;
    double sum = 0.0;
    for (int64_t i = 0; i < p.hidden; ++i) sum += static_cast<double>(x[i]) * x[i];
    const float scale =
        static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(p.hidden) + p.eps));
    for (int64_t i = 0; i < p.hidden; ++i) y[i] = x[i] * scale * p.weight[i];
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
