// CUDA SiLU-and-mul against the CPU reference. Skipped, with a message, where no GPU is visible.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/activation.h"
#include "kernels/cuda/silu_and_mul.cuh"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

// Both sides evaluate g / (1 + expf(-g)) * u with one rounding per operation; CUDA's expf is
// within 2 ulp and glibc's within 1, so the results differ by a few ulp of the result. 8 ulp
// (relative 8 * FLT_EPSILON) leaves room; the absolute floor covers results that underflow.
constexpr float kRelTolerance = 8 * FLT_EPSILON;

TEST(SiluAndMulCudaTest, MatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (int64_t inter : {1, 1000, 14336}) {
    const int64_t n = 5;
    std::mt19937 rng(static_cast<uint32_t>(inter));
    std::normal_distribution<float> normal(0.f, 4.f);
    std::vector<float> gate_up(n * 2 * inter), ref(n * inter);
    for (float& v : gate_up) v = normal(rng);
    // Saturating and underflowing gates: silu(g) -> g for large g, -> -0 for very negative g.
    const float extremes[] = {0.f, -0.f, 30.f, -30.f, 88.f, -88.f, 100.f, -100.f, -104.f, 1e-30f};
    for (size_t i = 0; i < std::size(extremes) && i < static_cast<size_t>(inter); ++i) {
      gate_up[i] = extremes[i];
    }
    ASSERT_TRUE(cpu::SiluAndMul({.gate_up = gate_up.data(), .output = ref.data(),
                                 .num_tokens = n, .intermediate = inter})
                    .ok());
    DeviceBuffer<float> din(gate_up), dout(n * inter);
    ASSERT_TRUE(cuda::LaunchSiluAndMul({.gate_up = din.get(), .output = dout.get(),
                                        .num_tokens = n, .intermediate = inter},
                                       nullptr)
                    .ok());
    const std::vector<float> got = dout.Download();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], ref[i], kRelTolerance * std::fabs(ref[i]) + 1e-37f)
          << "intermediate " << inter << " element " << i;
    }
  }
}

TEST(SiluAndMulCudaTest, ValidateNamesTheField) {
  cuda::SiluAndMulParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("gate_up"), std::string::npos);
  float x[2];
  p.gate_up = x;
  p.output = x;
  EXPECT_NE(std::string(p.Validate().message()).find("intermediate"), std::string::npos);
  p.intermediate = 1;
  p.num_tokens = -1;
  EXPECT_NE(std::string(p.Validate().message()).find("num_tokens"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::kernels
