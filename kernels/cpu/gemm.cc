#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <limits>

namespace kvgrid::kernels::cpu {

absl::Status LinearParams::Validate() const {
  if (!input || !weight || !output) {
    return absl::InvalidArgumentError("LinearParams: null input, weight or output");
  }
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (num_tokens < 0 || in_features <= 0 || out_features <= 0 || num_tokens > kMax ||
      in_features > kMax || out_features > kMax) {
    return absl::InvalidArgumentError("LinearParams: sizes out of range");
  }
  return absl::OkStatus();
}

absl::Status Linear(const LinearParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0) return absl::OkStatus();
  const int m = static_cast<int>(p.num_tokens);
  const int n = static_cast<int>(p.out_features);
  const int k = static_cast<int>(p.in_features);
  float beta = p.accumulate ? 1.f : 0.f;
  if (p.bias) {
    for (int t = 0; t < m; ++t) {
      float* row = p.output + static_cast<int64_t>(t) * n;
      for (int j = 0; j < n; ++j) row[j] = (p.accumulate ? row[j] : 0.f) + p.bias[j];
    }
    beta = 1.f;
  }
  if (m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.f, p.weight, k, p.input, 1, beta, p.output,
                1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, p.input, k, p.weight, k,
                beta, p.output, n);
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
