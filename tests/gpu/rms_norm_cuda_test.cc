// CUDA RMSNorm against the CPU reference. Skipped, with a message, where no GPU is visible.
#include <cuda_runtime_api.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cuda/rms_norm.cuh"

namespace kvgrid::kernels {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

TEST(RmsNormCudaTest, MatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (int64_t hidden : {64, 896, 4096, 5000}) {
    const int64_t n = 7;
    std::mt19937_64 rng(hidden);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> x(n * hidden), w(hidden), ref(n * hidden), got(n * hidden);
    for (float& v : x) v = d(rng);
    for (float& v : w) v = 1.f + 0.1f * d(rng);
    ASSERT_TRUE(cpu::RmsNorm({.input = x.data(), .weight = w.data(), .output = ref.data(),
                              .num_tokens = n, .hidden = hidden, .eps = 1e-6f})
                    .ok());
    float *dx, *dw, *dy;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dx), x.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dw), w.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dy), got.size() * 4), cudaSuccess);
    cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
    ASSERT_TRUE(cuda::LaunchRmsNorm({.input = dx, .weight = dw, .output = dy, .num_tokens = n,
                                     .hidden = hidden, .eps = 1e-6f},
                                    nullptr)
                    .ok());
    ASSERT_EQ(cudaMemcpy(got.data(), dy, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(dy);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-4) << hidden << " " << i;
  }
}

TEST(RmsNormCudaTest, ValidateNamesTheField) {
  cuda::RmsNormParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("input"), std::string::npos);
  float dummy;
  p.input = p.weight = &dummy;
  p.output = &dummy;
  p.num_tokens = 1;
  p.hidden = 0;
  EXPECT_NE(std::string(p.Validate().message()).find("hidden"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::kernels
