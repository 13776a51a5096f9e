#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <limits>

#include "kernels/cpu/simd_x86.h"
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

namespace {

#if defined(__x86_64__)
// One weight row dotted with T (<= 4) tokens' inputs: each 8 weights loaded once for all T.
// With fewer tokens each keeps more accumulators, so the FMA latency stays hidden.
template <int T>
__attribute__((target("avx2,fma"))) void DotRowF32(const float* w, const float* x, int64_t k,
                                                   float* y) {
  constexpr int A = T == 1 ? 4 : 2;  // accumulators per token: two chains of FMAs at least
  __m256 acc[T][A];
  for (int t = 0; t < T; ++t) {
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  int64_t c = 0;
  for (; c + 8 * A <= k; c += 8 * A) {
    for (int a = 0; a < A; a += 2) PrefetchAhead(w + c + 8 * a, kStreamPrefetchBytes);  // a line
    for (int a = 0; a < A; ++a) {
      const __m256 wv = _mm256_loadu_ps(w + c + 8 * a);
      for (int t = 0; t < T; ++t) {
        acc[t][a] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * k + c + 8 * a), acc[t][a]);
      }
    }
  }
  for (; c + 8 <= k; c += 8) {
    const __m256 wv = _mm256_loadu_ps(w + c);
    for (int t = 0; t < T; ++t) acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * k + c), acc[t][0]);
  }
  for (int t = 0; t < T; ++t) {
    __m256 sum = acc[t][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
    float tail = 0.f;
    for (int64_t j = c; j < k; ++j) tail += w[j] * x[t * k + j];
    y[t] = HorizontalSum(sum) + tail;
  }
}

// The inputs one pass of the 4 x 4 kernel keeps in L2 (of 2 MiB per core where it was
// measured; 1 MiB keeps half of a 2 MiB L2 for the weights' row tiles and the outputs).
constexpr int64_t kChunkInputBytes = int64_t{1} << 20;

using DotRowFn = void (*)(const float*, const float*, int64_t, float*);
constexpr DotRowFn kDotRows[] = {DotRowF32<1>, DotRowF32<2>, DotRowF32<3>, DotRowF32<4>};

// AVX-512: 4 weight rows against 4 tokens at once, 16 accumulators, so each 16 weights and
// each 16 inputs loaded serve 4 products (the 1-row kernel loads an input per product).
// y[t * 4 + r] = w_r . x_t; k % 16 == 0. The first token tile over the rows (`prefetch`)
// streams them from memory, the later ones read them from L1 or L2.
__attribute__((target("avx512f,fma"))) void Dot4x4Avx512(const float* w, const float* x,
                                                         int64_t k, bool prefetch, float* y) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r) {
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < k; c += 16) {
    __m512 wv[4];
    if (prefetch) {  // a line of each row
      for (int r = 0; r < 4; ++r) PrefetchAhead(w + r * k + c, kStreamPrefetchBytes);
    }
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_ps(w + r * k + c);
    for (int t = 0; t < 4; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * k + c);
      for (int r = 0; r < 4; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < 4; ++t) {
    for (int r = 0; r < 4; ++r) y[t * 4 + r] = HorizontalSum16(acc[r][t]);
  }
}

#endif

}  // namespace

absl::Status LinearSmallBatch(const LinearParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const VecOps& vec = Vec();
  static const bool avx2 = HaveAvx2Fma();
  const int64_t m = p.num_tokens, n = p.out_features, k = p.in_features;
#if defined(__x86_64__)
  // Four tokens or more: blocks of 4 rows x 4 tokens where AVX-512 has the registers.
  if (HaveAvx512() && m >= 4 && k % 16 == 0 && n % 4 == 0) {
    // Tokens in chunks whose inputs stay in L2 while every row tile passes over them (the
    // weights are read once per chunk).
    // A batched decode step (up to kStreamTokens) is never split: it reads the weights once.
    const int64_t chunk = std::max<int64_t>(kStreamTokens, kChunkInputBytes / (k * 4) / 4 * 4);
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
      const int64_t c1 = std::min(m, c0 + chunk);
#pragma omp parallel for schedule(static) if (n * k > 32768)
      for (int64_t j = 0; j < n; j += 4) {
        for (int64_t t0 = c0; t0 < c1; t0 += 4) {
          float dots[16];
          const int64_t count = std::min<int64_t>(4, c1 - t0);
          if (count == 4) {
            Dot4x4Avx512(p.weight + j * k, p.input + t0 * k, k, /*prefetch=*/t0 == c0, dots);
          } else {
            for (int r = 0; r < 4; ++r) {
              float row[4];
              kDotRows[count - 1](p.weight + (j + r) * k, p.input + t0 * k, k, row);
              for (int64_t t = 0; t < count; ++t) dots[t * 4 + r] = row[t];
            }
          }
          for (int64_t t = 0; t < count; ++t) {
            for (int r = 0; r < 4; ++r) {
              float* y = p.output + (t0 + t) * n + j + r;
              const float v = dots[t * 4 + r] + (p.bias ? p.bias[j + r] : 0.f);
              *y = p.accumulate ? *y + v : v;
            }
          }
        }
      }
    }
    return absl::OkStatus();
  }
#endif
  // Each weight row is streamed from memory once and stays in L1 for the m dot products.
#pragma omp parallel for schedule(static) if (n * k > 32768)
  for (int64_t j = 0; j < n; ++j) {
    const float* w = p.weight + j * k;
    const float b = p.bias ? p.bias[j] : 0.f;
    for (int64_t t0 = 0; t0 < m; t0 += 4) {
      const int64_t count = std::min<int64_t>(4, m - t0);
      float dots[4];
#if defined(__x86_64__)
      if (avx2) {
        kDotRows[count - 1](w, p.input + t0 * k, k, dots);
      } else
#endif
      {
        for (int64_t t = 0; t < count; ++t) dots[t] = vec.dot(p.input + (t0 + t) * k, w, k);
      }
      for (int64_t t = 0; t < count; ++t) {
        float* y = p.output + (t0 + t) * n + j;
        *y = p.accumulate ? *y + dots[t] + b : dots[t] + b;
      }
    }
  }
  return absl::OkStatus();
}

// Prefill-sized products, measured against OpenBLAS 0.3.21's SGEMM (SkylakeX kernels) on AVX-512
// (2 threads, Sapphire Rapids-class, weights from memory, GFLOP/s; bench/RESULTS.md): the 4 x 4
// kernel wins up to 32 tokens on matrices of at most kStreamMaxRows rows (q/k/v 1152 x 896 at
// 32 tokens 218 against 142-158), SGEMM from 48 (at 128 tokens 274-282 against 163-204).
constexpr int64_t kStreamPrefillTokens = 32;
constexpr int64_t kStreamMaxRows = 4096;
// And at most this many inputs per row (measured up to 4864).
constexpr int64_t kStreamMaxInputs = 8192;
// Up to this many tokens each thread runs SGEMM on its own share of the rows (single-threaded
// inside the parallel region) instead of OpenBLAS splitting the product: split over the few
// tokens, every thread packs the whole weight matrix, and a down projection (896 x 4864) at
// 64-128 tokens ran at 33-43 GFLOP/s where the row split holds 207-280.
constexpr int64_t kRowSplitTokens = 128;

absl::Status Linear(const LinearParams& p) {
  if (p.num_tokens <= kStreamTokens) return LinearSmallBatch(p);
  if (HaveAvx512() && p.num_tokens <= kStreamPrefillTokens && p.out_features <= kStreamMaxRows &&
      p.in_features <= kStreamMaxInputs && p.in_features % 16 == 0 && p.out_features % 4 == 0) {
    return LinearSmallBatch(p);
  }
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
  // (An OpenMP or single-threaded OpenBLAS runs one thread inside the region; a pthreads build
  // would start its own pool in each, so it keeps its own split.)
  if (m <= kRowSplitTokens && openblas_get_parallel() != 1) {
#pragma omp parallel
    {
      // Shares of whole 16-row panels, in order.
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t per = (n / threads + 15) / 16 * 16;
      const int64_t j0 = std::min<int64_t>(n, t * per);
      const int64_t j1 = t == threads - 1 ? n : std::min<int64_t>(n, j0 + per);
      if (j0 < j1) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, static_cast<int>(j1 - j0), k,
                    1.f, p.input, k, p.weight + j0 * k, k, beta, p.output + j0, n);
      }
    }
    return absl::OkStatus();
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
