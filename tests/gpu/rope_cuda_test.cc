// CUDA RoPE against the CPU reference, for plain, llama3, yarn (with its attention factor
// scaling cos and sin), dynamic and GGUF-divided frequency tables. Skipped, with a message,
// where no GPU is visible.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/rope.cuh"
#include "model/model_config.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

// Tolerance. Both kernels take the angle in double, round its double cos and sin to float and
// rotate in float with the same four roundings, so they differ only where CUDA's double
// sin/cos (<= 2 ulp of a double) and glibc's (< 1 ulp) round to different floats: one float ulp
// (<= 2^-24 for |cos|, |sin| <= 1) on a cos or sin, which moves a result by at most
// 2^-24 (|a| + |b|) plus one ulp of the result. Hence |gpu - cpu| <= 2^-22 (|a| + |b|) per
// element. As a second, independent check, the largest error of each against an all-double
// rotation, relative to |a| + |b|, is measured: the CPU's is about 2^-24 (its float rounding
// of cos/sin and of the products), and the GPU's must not exceed twice that.
constexpr double kPairTolerance = 0x1p-22;

struct Case {
  const char* name;
  model::ModelConfig config;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (int64_t head_dim : {64, 128}) {
    model::ModelConfig plain;
    plain.head_dim = head_dim;
    plain.rope_theta = 10000.0;
    cases.push_back({"plain", plain});
    model::ModelConfig llama3;
    llama3.head_dim = head_dim;
    llama3.rope_theta = 500000.0;
    llama3.rope_scaling = {.type = model::RopeScalingType::kLlama3, .factor = 8.0,
                           .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                           .original_max_position_embeddings = 8192};
    cases.push_back({"llama3", llama3});
    model::ModelConfig yarn;
    yarn.head_dim = head_dim;
    yarn.rope_theta = 1000000.0;
    yarn.rope_scaling.type = model::RopeScalingType::kYarn;
    yarn.rope_scaling.factor = 4.0;
    yarn.rope_scaling.original_max_position_embeddings = 32768;
    cases.push_back({"yarn", yarn});
    model::ModelConfig dynamic = plain;
    dynamic.rope_scaling.type = model::RopeScalingType::kDynamic;
    dynamic.rope_scaling.factor = 2.0;
    dynamic.rope_scaling.original_max_position_embeddings = 4096;
    cases.push_back({"dynamic", dynamic});
    model::ModelConfig divided = plain;
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      divided.rope_scaling.freq_divisors.push_back(1.0 + static_cast<double>(i % 5));
    }
    cases.push_back({"rope_freqs", divided});
  }
  return cases;
}

TEST(RopeCudaTest, MatchesCpuReference) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const int64_t n = 50, heads = 4, kv_heads = 2;
  for (const Case& c : Cases()) {
    const int64_t d = c.config.head_dim, half = d / 2;
    absl::StatusOr<std::vector<double>> inv_freq = cpu::RopeInvFreq(c.config);
    ASSERT_TRUE(inv_freq.ok()) << inv_freq.status();
    const double mscale = cpu::RopeAttentionFactor(c.config);
    std::mt19937 rng(static_cast<uint32_t>(d));
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_int_distribution<int32_t> pos(0, 131071);
    std::vector<int32_t> positions(n);
    for (int32_t& p : positions) p = pos(rng);
    positions[0] = 0;
    positions[1] = 1;
    positions[2] = 131071;
    std::vector<float> q(n * heads * d), k(n * kv_heads * d);
    for (float& v : q) v = normal(rng);
    for (float& v : k) v = normal(rng);
    std::vector<float> q_cpu = q, k_cpu = k;
    ASSERT_TRUE(cpu::Rope({.query = q_cpu.data(), .key = k_cpu.data(),
                           .positions = positions.data(), .inv_freq = inv_freq->data(),
                           .scale = mscale, .num_tokens = n, .num_heads = heads, .num_kv_heads = kv_heads,
                           .head_dim = d})
                    .ok());
    DeviceBuffer<float> dq(q), dk(k);
    DeviceBuffer<int32_t> dpos(positions);
    DeviceBuffer<double> dfreq(*inv_freq);
    ASSERT_TRUE(cuda::LaunchRope({.query = dq.get(), .key = dk.get(), .positions = dpos.get(),
                                  .inv_freq = dfreq.get(), .scale = mscale, .num_tokens = n,
                                  .num_heads = heads,
                                  .num_kv_heads = kv_heads, .head_dim = d},
                                 nullptr)
                    .ok());
    const std::vector<float> q_gpu = dq.Download(), k_gpu = dk.Download();

    double cpu_err = 0, gpu_err = 0;  // largest error vs the all-double rotation / (|a| + |b|)
    auto check = [&](const std::vector<float>& in, const std::vector<float>& cpu_out,
                     const std::vector<float>& gpu_out, int64_t num_heads, const char* which) {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t base = (t * num_heads + h) * d;
          for (int64_t i = 0; i < half; ++i) {
            const double a = in[base + i], b = in[base + i + half];
            const double angle = static_cast<double>(positions[t]) * (*inv_freq)[i];
            const double cs = std::cos(angle) * mscale, sn = std::sin(angle) * mscale;
            const double exact[2] = {a * cs - b * sn, b * cs + a * sn};
            const double scale = (std::fabs(a) + std::fabs(b)) * mscale + 1e-30;
            for (int j = 0; j < 2; ++j) {
              const int64_t idx = base + i + j * half;
              ASSERT_LE(std::fabs(static_cast<double>(gpu_out[idx]) - cpu_out[idx]),
                        kPairTolerance * scale)
                  << c.name << " d=" << d << " " << which << " token " << t << " head " << h
                  << " i " << i << " position " << positions[t];
              cpu_err = std::max(cpu_err, std::fabs(cpu_out[idx] - exact[j]) / scale);
              gpu_err = std::max(gpu_err, std::fabs(gpu_out[idx] - exact[j]) / scale);
            }
          }
        }
      }
    };
    check(q, q_cpu, q_gpu, heads, "q");
    check(k, k_cpu, k_gpu, kv_heads, "k");
    EXPECT_LE(gpu_err, 2 * cpu_err) << c.name << " d=" << d << ": cpu error " << cpu_err;
    EXPECT_LT(cpu_err, 0x1p-22) << c.name << " d=" << d;  // the CPU itself is that close
  }
}

TEST(RopeCudaTest, ValidateNamesTheField) {
  cuda::RopeParams p;
  p.num_heads = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("query"), std::string::npos);
  float x[4];
  int32_t pos = 0;
  double f[2];
  p.query = x;
  p.positions = &pos;
  p.inv_freq = f;
  p.head_dim = 3;
  EXPECT_NE(std::string(p.Validate().message()).find("head_dim"), std::string::npos);
  p.head_dim = 4;
  EXPECT_TRUE(p.Validate().ok());
  p.head_dim = cuda::kRopeMaxHeadDim + 2;
  EXPECT_NE(std::string(p.Validate().message()).find("head_dim"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::kernels
