// cuBLAS linear layer against the CPU reference on 16-bit-rounded weights. The cuBLAS status
// test runs everywhere; the device tests are skipped, with a message, where no GPU is visible.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/gemm.cuh"
#include "model/dtype.h"
#include "tests/gpu/device_buffer.h"

namespace kvgrid::kernels {
namespace {

using ::kvgrid::testing::DeviceBuffer;
using ::kvgrid::testing::HaveGpu;

absl::Status FailingCublasCall() {
  KVGRID_CUBLAS_RETURN_IF_ERROR(CUBLAS_STATUS_ALLOC_FAILED);
  return absl::OkStatus();
}

TEST(GemmCudaTest, CublasStatusNamesTheCallAndTheStatus) {
  EXPECT_TRUE(cuda::CublasStatus(CUBLAS_STATUS_SUCCESS, "x", "f", 1).ok());
  const absl::Status s = FailingCublasCall();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  EXPECT_NE(message.find("CUBLAS_STATUS_ALLOC_FAILED"), std::string::npos) << message;
  EXPECT_NE(message.find("gemm_cuda_test.cc"), std::string::npos) << message;
  EXPECT_EQ(cuda::CublasStatus(CUBLAS_STATUS_NOT_SUPPORTED, "x", "f", 1).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cuda::CublasStatus(CUBLAS_STATUS_EXECUTION_FAILED, "x", "f", 1).code(),
            absl::StatusCode::kInternal);
}

TEST(GemmCudaTest, CudaStatusTellsALostContextFromAFailedCall) {
  EXPECT_TRUE(cuda::CudaStatus(cudaSuccess, "x", "f", 1).ok());
  EXPECT_EQ(cuda::CudaStatus(cudaErrorMemoryAllocation, "x", "f", 1).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cuda::CudaStatus(cudaErrorInvalidValue, "x", "f", 1).code(),
            absl::StatusCode::kInternal);
  // After a fault in a kernel no call of the process works again: UNAVAILABLE, which makes a
  // worker shut down and the coordinator move its requests.
  for (cudaError_t sticky : {cudaErrorIllegalAddress, cudaErrorLaunchFailure,
                             cudaErrorMisalignedAddress, cudaErrorECCUncorrectable}) {
    const absl::Status s = cuda::CudaStatus(sticky, "cudaStreamSynchronize(stream)", "f", 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("must restart"), std::string::npos) << s;
  }
}

// Tolerance. The CPU multiplies the fp32 input by the 16-bit-rounded weights; the device
// multiplies the input rounded to the same 16-bit type (by LaunchCast). Rounding changes each
// input by at most u = 2^-11 (fp16) or 2^-8 (bf16) relative (plus 2^-25 absolute for fp16
// subnormals, negligible here), so an output moves by at most u * S, S = sum_k |x_k w_k|.
// The two fp32 accumulations in different orders (and tensor cores' internal alignment) add a
// small multiple of 2^-24 * K * S in the worst case; 1e-4 * S covers K up to 1000 with room.
double Tolerance(model::DType dtype, double s) {
  const double u = dtype == model::DType::kF16 ? 0x1p-11 : 0x1p-8;
  return (u + 1e-4) * s + 1e-6;
}

TEST(GemmCudaTest, MatchesCpuLinearOn16BitWeights) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  absl::StatusOr<cuda::CublasHandle> handle = cuda::CublasHandle::Create();
  ASSERT_TRUE(handle.ok()) << handle.status();
  const int64_t n = 96, k = 1000;  // k not a multiple of 8: cuBLAS's unaligned path too
  for (model::DType dtype : {model::DType::kF16, model::DType::kBF16}) {
    for (int64_t t : {1, 5, 64}) {
      for (int variant = 0; variant < 4; ++variant) {
        const bool use_bias = variant & 1, accumulate = variant & 2;
        std::mt19937 rng(static_cast<uint32_t>(t * 8 + variant));
        std::normal_distribution<float> normal(0.f, 1.f);
        std::vector<float> x(t * k), w(n * k), bias(n), prev(t * n);
        std::vector<uint16_t> w16(n * k);
        for (float& v : x) v = normal(rng);
        for (size_t i = 0; i < w.size(); ++i) {
          const float v = 0.05f * normal(rng);
          w16[i] = dtype == model::DType::kF16 ? model::F32ToF16(v) : model::F32ToBF16(v);
          w[i] = dtype == model::DType::kF16 ? model::F16ToF32(w16[i]) : model::BF16ToF32(w16[i]);
        }
        for (float& v : bias) v = normal(rng);
        for (float& v : prev) v = normal(rng);
        std::vector<float> ref = prev;
        ASSERT_TRUE(cpu::Linear({.input = x.data(), .weight = w.data(),
                                 .bias = use_bias ? bias.data() : nullptr, .output = ref.data(),
                                 .num_tokens = t, .in_features = k, .out_features = n,
                                 .accumulate = accumulate})
                        .ok());
        DeviceBuffer<float> dx(x), dbias(bias), dout(prev);
        DeviceBuffer<uint16_t> dx16(x.size()), dw(w16);
        ASSERT_TRUE(cuda::LaunchCast({.input = dx.get(), .output = dx16.get(), .dtype = dtype,
                                      .num_elements = t * k},
                                     nullptr)
                        .ok());
        const absl::Status s = cuda::LaunchGemm(
            {.input = dx16.get(), .weight = dw.get(), .bias = use_bias ? dbias.get() : nullptr,
             .output = dout.get(), .dtype = dtype, .num_tokens = t, .in_features = k,
             .out_features = n, .accumulate = accumulate},
            *handle, nullptr);
        ASSERT_TRUE(s.ok()) << s;
        const std::vector<float> got = dout.Download();
        for (int64_t i = 0; i < t; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double mag = 0;
            for (int64_t c = 0; c < k; ++c) mag += std::fabs(x[i * k + c] * w[j * k + c]);
            ASSERT_NEAR(got[i * n + j], ref[i * n + j], Tolerance(dtype, mag))
                << model::DTypeName(dtype) << " t=" << t << " bias=" << use_bias
                << " accumulate=" << accumulate << " at [" << i << ", " << j << "]";
          }
        }
      }
    }
  }
}

TEST(GemmCudaTest, ValidateNamesTheField) {
  cuda::GemmParams p;
  EXPECT_NE(std::string(p.Validate().message()).find("weight"), std::string::npos);
  uint16_t half[4];
  float out[4];
  p.weight = half;
  p.output = out;
  p.num_tokens = 1;
  EXPECT_NE(std::string(p.Validate().message()).find("input"), std::string::npos);
  p.input = half;
  p.in_features = 4;
  p.out_features = 0;
  EXPECT_NE(std::string(p.Validate().message()).find("out_features"), std::string::npos);
  p.out_features = int64_t{1} << 31;
  EXPECT_NE(std::string(p.Validate().message()).find("out_features"), std::string::npos);
  p.out_features = 1;
  p.dtype = model::DType::kF32;
  EXPECT_NE(std::string(p.Validate().message()).find("dtype"), std::string::npos);
  p.dtype = model::DType::kF16;
  EXPECT_TRUE(p.Validate().ok());
}

}  // namespace
}  // namespace kvgrid::kernels
