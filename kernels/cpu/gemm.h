// Linear layers through OpenBLAS: output = input x weight^T (+ bias), fp32 compute.
// Weights keep the checkpoint's [out_features, in_features] row-major layout.
#ifndef KVGRID_KERNELS_CPU_GEMM_H_
#define KVGRID_KERNELS_CPU_GEMM_H_

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::kernels::cpu {

struct LinearParams {
  const float* input = nullptr;   // [num_tokens, in_features]
  const float* weight = nullptr;  // [out_features, in_features]
  const float* bias = nullptr;    // [out_features] or null
  float* output = nullptr;        // [num_tokens, out_features]; must not alias input
  int64_t num_tokens = 0;
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool accumulate = false;        // output += instead of output =

  absl::Status Validate() const;
};

// Up to this many tokens, the quantized layers (quant_linear.h) stream each weight row once
// through SIMD dot products (decode is bound by reading the weights).
inline constexpr int64_t kSmallBatchTokens = 4;

// Up to this many tokens, Linear streams each fp32 weight row once, dotted with the tokens
// four at a time in registers; above it, OpenBLAS SGEMM. SGEMM packs the whole weight matrix
// on every call, which at a batch of 16 decode steps cost more than the products themselves
// (bench/RESULTS.md).
inline constexpr int64_t kStreamTokens = 16;

// Dispatches on num_tokens as above, except that on AVX-512 chunks of up to 32 tokens stream
// too on matrices of up to 4096 rows and 8192 inputs, where that measured faster than SGEMM;
// up to 128 tokens each thread runs SGEMM on its share of the rows (gemm.cc).
// Parallel over every core.
absl::Status Linear(const LinearParams& params);

// Limits the CPU kernels (our OpenMP loops and OpenBLAS) to `threads` threads, e.g. when
// several workers share one machine. threads >= 1. OpenMP keeps the thread count per thread,
// so every thread that runs kernels calls UseConfiguredThreads() first.
void SetNumThreads(int threads);
// Applies SetNumThreads' setting to the calling thread (no-op when it was never called).
void UseConfiguredThreads();

// The small-batch path on its own (any num_tokens; exposed for tests and benchmarks).
absl::Status LinearSmallBatch(const LinearParams& params);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_GEMM_H_
