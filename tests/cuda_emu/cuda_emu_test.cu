// The CUDA emulator against what CUDA specifies: thread indices, barriers and shuffles, and the
// runtime's checks (launch limits, copies, captures), since every emu.* test trusts them.
// Compiled through transform.cmake like kernels/cuda.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/cuda_emu/runtime.h"

namespace kvgrid::cuda_emu {
namespace {

// Every thread of every block writes its flat index once.
__global__ void IndexKernel(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int threads = blockDim.x * blockDim.y * blockDim.z;
  const int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  out[block * threads + thread] += block * threads + thread + 1;
}

TEST(CudaEmuTest, EveryThreadOfEveryBlockRunsOnce) {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  const int total = 12 * 64;
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, total * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, total * sizeof(int)), cudaSuccess);
  IndexKernel<<<grid, block>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<int> h(total);
  ASSERT_EQ(cudaMemcpy(h.data(), d, total * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < total; ++i) EXPECT_EQ(h[i], i + 1) << i;
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// out[lane] = xor-butterfly sum over the warp; out[32 + lane] = shfl_down by 3 within
// segments of 8 lanes.
__global__ void ShuffleKernel(float* out) {
  const int lane = threadIdx.x;
  float v = static_cast<float>(lane);
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  out[lane] = v;
  out[32 + lane] = __shfl_down_sync(0xffffffffu, static_cast<float>(lane), 3, 8);
}

TEST(CudaEmuTest, ShufflesFollowCudaSemantics) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  ShuffleKernel<<<1, 32>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> h(64);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 64 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(h[lane], 496.f);  // 0 + 1 + ... + 31
    // Within a segment of 8, lanes 5..7 have no source 3 lanes down and keep their own value.
    EXPECT_EQ(h[32 + lane], lane % 8 + 3 < 8 ? lane + 3 : lane) << lane;
  }
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// Each thread writes shared memory, waits at the barrier, then reads its neighbour's slot.
__global__ void BarrierKernel(int* out) {
  __shared__ int slots[256];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x) * 7;
  __syncthreads();
  out[threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

TEST(CudaEmuTest, SyncthreadsOrdersSharedMemory) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 256 * sizeof(int)), cudaSuccess);
  BarrierKernel<<<2, 256>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<int> h(256);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 256 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(h[i], ((i + 1) % 256) * 7);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

__global__ void DynamicSharedKernel(float* out) {
  extern __shared__ float dyn[];
  out[threadIdx.x] = dyn[threadIdx.x];  // read before any write: garbage on a GPU
}

TEST(CudaEmuTest, FreshMemoryIsPoisonedAndLaunchLimitsAreChecked) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  std::vector<float> h(64);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 64 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(h[0]));  // cudaMalloc's memory is not zeroed

  DynamicSharedKernel<<<1, 32, 32 * sizeof(float)>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 64 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(h[5]));

  DynamicSharedKernel<<<1, 1025>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  DynamicSharedKernel<<<dim3(1, 65536), 32>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  // More than 48 KiB of dynamic shared memory needs the attribute.
  DynamicSharedKernel<<<1, 32, 64 * 1024>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  ASSERT_EQ(cudaFuncSetAttribute(DynamicSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 64 * 1024),
            cudaSuccess);
  DynamicSharedKernel<<<1, 32, 64 * 1024>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaEmuTest, CopiesAreCheckedAgainstTheAllocations) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  std::vector<float> h(32, 1.f);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  // The wrong direction, and running past the end of the allocation.
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16 * sizeof(float), cudaMemcpyDeviceToHost),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 32 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d + 8, h.data(), 9 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // reset by the read
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

__global__ void AddOneKernel(int* x) { x[threadIdx.x] += 1; }

TEST(CudaEmuTest, CapturedWorkRunsOnlyWhenTheGraphIsLaunched) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, 4 * sizeof(int)), cudaSuccess);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);  // blocking: the legacy stream waits for it
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  AddOneKernel<<<1, 4, 0, s>>>(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  std::vector<int> h(4);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 4 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[0], 0);  // captured, not run
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 4 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h[3], 2);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);

  // Allocating, or synchronizing, while this thread captures is refused and spoils the capture.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 16), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(graph, nullptr);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  AddOneKernel<<<1, 4>>>(d);  // the legacy stream would join the capture
  EXPECT_EQ(cudaGetLastError(), cudaErrorStreamCaptureImplicit);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();
  // Waiting on the capturing stream is invalid, whatever the capture mode.
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  (void)cudaGetLastError();

  // A non-blocking stream does not synchronize with the legacy stream: work there is fine
  // while it captures.
  cudaStream_t nb = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(nb, cudaStreamCaptureModeRelaxed), cudaSuccess);
  AddOneKernel<<<1, 4>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(nb, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(nb), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaEmuTest, StreamWorkIsThereOnlyAfterAWait) {
  int* d = nullptr;
  int* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 4 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, 4 * sizeof(int)), cudaSuccess);
  pinned[0] = -7;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  AddOneKernel<<<1, 4, 0, s>>>(d);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, 4 * sizeof(int), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(pinned[0], -7);  // a host reading here, without a wait, would see stale data
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  // Left as the last error, as a runtime may: a poller clears it before its next launch check.
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorNotReady);  // peeking keeps it
  EXPECT_EQ(cudaGetLastError(), cudaErrorNotReady);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(pinned[0], 1);
  EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);

  // A copy to pageable memory is complete when the call returns.
  std::vector<int> pageable(4, -7);
  AddOneKernel<<<1, 4, 0, s>>>(d);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d, 4 * sizeof(int), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  EXPECT_EQ(pageable[3], 2);
  // One from pageable memory takes the source at the call: it may change right after.
  std::vector<int> source(4, 40);
  ASSERT_EQ(cudaMemcpyAsync(d, source.data(), 4 * sizeof(int), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  source.assign(4, -1);
  AddOneKernel<<<1, 4, 0, s>>>(d);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d, 4 * sizeof(int), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  EXPECT_EQ(pageable[0], 41);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// Lanes 16..31 return; lanes 0..15 shuffle with the whole warp's mask. Exited lanes of the
// mask are allowed; reading one (xor 16) is undefined on a GPU and a fault here.
__global__ void HalfWarpShuffleKernel(float* out, int lane_mask) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<float>(threadIdx.x), lane_mask);
}

// Warp 0 waits at __syncthreads while warp 1 shuffles among itself first: barriers of
// different warps interleave.
__global__ void SplitWarpsKernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
    __syncthreads();
  }
}

TEST(CudaEmuTest, UndefinedWarpUseIsAStickyFault) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  HalfWarpShuffleKernel<<<1, 32>>>(d, 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> h(16);
  ASSERT_EQ(cudaMemcpy(h.data(), d, 16 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int lane = 0; lane < 16; ++lane) EXPECT_EQ(h[lane], lane ^ 1);
  HalfWarpShuffleKernel<<<1, 32>>>(d, 16);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);  // sticky, as on a GPU
  EXPECT_EQ(cudaPeekAtLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);  // clearing does not clear it
  ResetStickyFaultForTest();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  SplitWarpsKernel<<<1, 64>>>(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

__global__ void MismatchedBarrierKernel(float* out, int variant) {
  if (variant == 0) {
    // Lanes 0..15 at a warp barrier naming lanes 16..31, which wait at __syncthreads.
    if (threadIdx.x < 16) {
      __syncwarp(0xffffffffu);
    } else {
      __syncthreads();
    }
  } else {
    // Half the warp at __syncwarp, the other half in a shuffle: different calls.
    if (threadIdx.x < 16) {
      __syncwarp(0xffffffffu);
    } else {
      out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
    }
  }
}

TEST(CudaEmuTest, BarriersThatCannotCompleteOrDoNotMatchAreReported) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  for (int variant : {0, 1}) {
    MismatchedBarrierKernel<<<1, 32>>>(d, variant);
    EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure) << variant;
    ResetStickyFaultForTest();
  }
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

__global__ void SumFloat4Kernel(const float* in, float* out) {
  const float4 v = reinterpret_cast<const float4*>(in)[threadIdx.x];
  out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

TEST(CudaEmuTest, AMisalignedVectorLoadStopsTheProgram) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d, 0, 64 * sizeof(float)), cudaSuccess);
  SumFloat4Kernel<<<1, 4>>>(d, d + 32);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // A GPU faults (cudaErrorMisalignedAddress) on a float4 load 4 bytes past a 16-byte boundary.
  EXPECT_DEATH(
      {
        SumFloat4Kernel<<<1, 4>>>(d + 1, d + 32);
        (void)cudaDeviceSynchronize();
      },
      "misaligned address");
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaEmuTest, AHostPointerArgumentIsAFault) {
  std::vector<int> host(4, 0);
  AddOneKernel<<<1, 4>>>(host.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  ResetStickyFaultForTest();
  EXPECT_EQ(host[0], 0);  // not run
}

}  // namespace
}  // namespace kvgrid::cuda_emu
