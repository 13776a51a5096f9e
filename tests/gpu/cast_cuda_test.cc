// CUDA fp32 -> fp16/bf16 cast against model/dtype.h, bit for bit. The first tests check the
// shared conversion functions (kernels/cuda/numeric.cuh) on the host and run everywhere; the
// device test is skipped, with a message, where no GPU is visible.
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/numeric.cuh"
#include "model/dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// Inputs where rounding is delicate: zeros, infinities, NaNs (quiet and signalling, both
// signs), fp16 overflow and subnormal boundaries and ties, bf16 ties, plus a sweep over all
// exponents and a spread of mantissas.
std::vector<float> TrickyInputs() {
  std::vector<uint32_t> bits = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
      0x7f800001u, 0x7fbfffffu, 0xff812345u,                            // NaNs
      0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u,  // around 65504..65536
      0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x32ffffffu,  // fp16 subnormal edges
      0x33800000u, 0x33c00000u, 0x34200000u, 0x3f801000u, 0x3f803000u,  // fp16 ties
      0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x00000001u, 0x807fffffu,  // bf16 ties, f32 subnormals
  };
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t m : {0x000000u, 0x000fffu, 0x001000u, 0x001001u, 0x002000u, 0x007fffu,
                       0x008000u, 0x008001u, 0x018000u, 0x3ff000u, 0x7fe000u, 0x7ff000u,
                       0x7fffffu}) {
      bits.push_back(e << 23 | m);
      bits.push_back(0x80000000u | e << 23 | m);
    }
  }
  std::vector<float> out;
  for (uint32_t b : bits) out.push_back(FromBits(b));
  return out;
}

TEST(CastCudaTest, HostConversionsMatchModelDtype) {
  std::vector<float> inputs = TrickyInputs();
  for (uint64_t b = 0; b <= 0xffffffffu; b += 4093) {
    inputs.push_back(FromBits(static_cast<uint32_t>(b)));
  }
  for (float x : inputs) {
    ASSERT_EQ(cuda::F32ToF16Bits(x), model::F32ToF16(x)) << std::hex << ToBits(x);
    ASSERT_EQ(cuda::F32ToBF16Bits(x), model::F32ToBF16(x)) << std::hex << ToBits(x);
  }
  for (uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto h16 = static_cast<uint16_t>(h);
    ASSERT_EQ(ToBits(cuda::F16BitsToF32(h16)), ToBits(model::F16ToF32(h16))) << std::hex << h;
    ASSERT_EQ(ToBits(cuda::BF16BitsToF32(h16)), ToBits(model::BF16ToF32(h16))) << std::hex << h;
  }
}

TEST(CastCudaTest, MatchesModelDtypeBitExact) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  std::vector<float> x = TrickyInputs();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 3.f);
  while (x.size() < 300000) x.push_back(normal(rng));  // several grid-stride passes' worth
  DeviceBuffer<float> dx(x);
  for (model::DType dtype : {model::DType::kF16, model::DType::kBF16}) {
    DeviceBuffer<uint16_t> dy(x.size());
    ASSERT_TRUE(cuda::LaunchCast({.input = dx.get(), .output = dy.get(), .dtype = dtype,
                                  .num_elements = static_cast<int64_t>(x.size())},
                                 nullptr)
                    .ok());
    const std::vector<uint16_t> got = dy.Download();
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want =
          dtype == model::DType::kF16 ? model::F32ToF16(x[i]) : model::F32ToBF16(x[i]);
      ASSERT_EQ(got[i], want) << model::DTypeName(dtype) << " input bits " << std::hex
                              << ToBits(x[i]);
    }
  }
}

TEST(CastCudaTest, ValidateNamesTheField) {
  cuda::CastParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("input"), std::string::npos);
  float in = 0.f;
  uint16_t out = 0;
  p.input = &in;
  p.output = &out;
  p.dtype = model::DType::kF32;
  EXPECT_NE(std::string(p.Validate().message()).find("dtype"), std::string::npos);
  p.dtype = model::DType::kF16;
  p.num_elements = -1;
  EXPECT_NE(std::string(p.Validate().message()).find("num_elements"), std::string::npos);
  p.num_elements = 0;
  EXPECT_TRUE(p.Validate().ok());
}

}  // namespace
}  // namespace kvgrid::kernels
