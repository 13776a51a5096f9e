#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <atomic>
#include <limits>

#include "kernels/cpu/vec.h"

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

absl::Status LinearSmallBatch(const LinearParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const VecOps& vec = Vec();
  const int64_t m = p.num_tokens, n = p.out_features, k = p.in_features;
  // Each weight row is streamed from memory once and stays in L1 for the m dot products.
#pragma omp parallel for schedule(static) if (n * k > 32768)
  for (int64_t j = 0; j < n; ++j) {
    const float* w = p.weight + j * k;
    const float b = p.bias ? p.bias[j] : 0.f;
    for (int64_t t = 0; t < m; ++t) {
      float* y = p.output + t * n + j;
      const float dot = vec.dot(p.input + t * k, w, k) + b;
      *y = p.accumulate ? *y + dot : dot;
    }
  }
  return absl::OkStatus();
}

absl::Status Linear(const LinearParams& p) {
  if (p.num_tokens <= kSmallBatchTokens) return LinearSmallBatch(p);
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, p.input, k, p.weight, k,
              beta, p.output, n);
  return absl::OkStatus();
}

namespace {
std::atomic<int> configured_threads{0};
}  // namespace

void SetNumThreads(int threads) {
  configured_threads.store(threads);
  omp_set_num_threads(threads);
  openblas_set_num_threads(threads);
}

void UseConfiguredThreads() {
  if (const int threads = configured_threads.load(); threads > 0) omp_set_num_threads(threads);
}

}  // namespace kvgrid::kernels::cpu
