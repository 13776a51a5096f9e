// Device collectives: NCCL with one rank per visible GPU (a single GPU makes a group of one),
// through its own stream and on the caller's (recorded in a CUDA graph too), and the host-staged
// communicator with two ranks on one card; results against the values every rank contributed;
// a join that a rank never completes gives up after its timeout. Skipped where no GPU is
// visible.
#include <cuda_runtime_api.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "gloo/rendezvous/hash_store.h"
#include "gtest/gtest.h"
#include "tests/unit/comm/gloo_group.h"
#include "worker/comm/host_staged_communicator.h"
#include "worker/comm/nccl_communicator.h"

namespace kvgrid::worker {
namespace {

using ::kvgrid::testing::RunGroup;

TEST(NcclCommunicatorTest, CollectivesAcrossTheVisibleGpus) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  }
  const int size = std::min(devices, 8);
  gloo::rendezvous::HashStore store;
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      auto comm = NcclCommunicator::Connect(r, size, r, store, std::chrono::seconds(60));
      ASSERT_TRUE(comm.ok()) << comm.status();
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      const std::vector<float> mine = {1.f * r, 2.f, -3.f * r};
      float* d = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 3 * sizeof(float) * size), cudaSuccess);
      cudaMemcpy(d, mine.data(), 3 * sizeof(float), cudaMemcpyHostToDevice);
      ASSERT_TRUE((*comm)->AllReduceSum(std::span<float>(d, 3)).ok());
      std::vector<float> got(3);
      cudaMemcpy(got.data(), d, 3 * sizeof(float), cudaMemcpyDeviceToHost);
      const float ranks_sum = size * (size - 1) / 2.f;
      EXPECT_EQ(got, (std::vector<float>{ranks_sum, 2.f * size, -3.f * ranks_sum}));
      float* gathered = nullptr;
      ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&gathered), sizeof(float) * size),
                cudaSuccess);
      const float one = static_cast<float>(r);
      cudaMemcpy(d, &one, sizeof(float), cudaMemcpyHostToDevice);
      ASSERT_TRUE((*comm)->AllGather(std::span<const float>(d, 1),
                                     std::span<float>(gathered, size)).ok());
      std::vector<float> all(size);
      cudaMemcpy(all.data(), gathered, sizeof(float) * size, cudaMemcpyDeviceToHost);
      for (int i = 0; i < size; ++i) EXPECT_EQ(all[i], static_cast<float>(i));
      EXPECT_TRUE((*comm)->Barrier().ok());
      cudaFree(gathered);
      cudaFree(d);
    });
  }
  for (auto& t : ranks) t.join();
}

TEST(NcclCommunicatorTest, JoiningIsBoundedWhenARankNeverComes) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  }
  // Rank 0 of two, and rank 1 never starts: the join gives up after the timeout instead of
  // waiting in ncclCommInitRank forever.
  gloo::rendezvous::HashStore store;
  const auto start = std::chrono::steady_clock::now();
  auto alone = NcclCommunicator::Connect(0, 2, 0, store, std::chrono::seconds(3));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(alone.ok());
  EXPECT_EQ(alone.status().code(), absl::StatusCode::kDeadlineExceeded) << alone.status();
  EXPECT_NE(alone.status().message().find("ncclCommInitRankConfig"), std::string::npos)
      << alone.status();
  EXPECT_GE(took, 2.9);
  EXPECT_LT(took, 60.0);
  // Nothing of it is left behind: a group of one forms and reduces on the same device.
  gloo::rendezvous::HashStore fresh;
  auto one = NcclCommunicator::Connect(0, 1, 0, fresh, std::chrono::seconds(60));
  ASSERT_TRUE(one.ok()) << one.status();
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(float)), cudaSuccess);
  const float v = 7.f;
  ASSERT_EQ(cudaMemcpy(d, &v, sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE((*one)->AllReduceSum(std::span<float>(d, 1)).ok());
  float got = 0;
  ASSERT_EQ(cudaMemcpy(&got, d, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, 7.f);
  cudaFree(d);
}

// Rank r contributes {r, 2, -3r, 0.5} to an all-reduce and {10r, 10r + 1} to an all-gather, on
// `stream`; `graph` records them once and replays the graph instead.
void CheckStreamCollectives(DeviceCommunicator& comm, cudaStream_t stream, bool graph) {
  const int r = comm.rank(), size = comm.size();
  const std::vector<float> mine = {1.f * r, 2.f, -3.f * r, 0.5f};
  const std::vector<float> pair = {10.f * r, 10.f * r + 1};
  float *d = nullptr, *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 4 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&in), 2 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), 2 * sizeof(float) * size), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, mine.data(), 4 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(in, pair.data(), 2 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  // A copy from pageable memory may return before its DMA lands, and `stream` (non-blocking)
  // does not wait for the legacy stream's work.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (graph) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const absl::Status reduced = comm.AllReduceSumOn(d, 4, stream);
    const absl::Status gathered = comm.AllGatherOn(in, out, 2, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
    ASSERT_TRUE(reduced.ok()) << reduced;
    ASSERT_TRUE(gathered.ok()) << gathered;
    ASSERT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_TRUE(comm.Synchronize(stream).ok());
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  } else {
    ASSERT_TRUE(comm.AllReduceSumOn(d, 4, stream).ok());
    ASSERT_TRUE(comm.AllGatherOn(in, out, 2, stream).ok());
    ASSERT_TRUE(comm.Synchronize(stream).ok());
  }
  std::vector<float> sum(4), all(2 * size);
  ASSERT_EQ(cudaMemcpy(sum.data(), d, 4 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(all.data(), out, all.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  const float ranks_sum = size * (size - 1) / 2.f;
  EXPECT_EQ(sum, (std::vector<float>{ranks_sum, 2.f * size, -3.f * ranks_sum, 0.5f * size}));
  for (int i = 0; i < size; ++i) {
    EXPECT_EQ(all[2 * i], 10.f * i);
    EXPECT_EQ(all[2 * i + 1], 10.f * i + 1);
  }
  cudaFree(out);
  cudaFree(in);
  cudaFree(d);
}

TEST(NcclCommunicatorTest, StreamOrderedCollectivesAndGraphsOverAHostGroup) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  }
  RunGroup(std::min(devices, 8), [](int r, Communicator& host) {
    auto comm = NcclCommunicator::Connect(host, r, std::chrono::seconds(60));
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_TRUE((*comm)->capturable());
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    CheckStreamCollectives(**comm, stream, /*graph=*/false);
    CheckStreamCollectives(**comm, stream, /*graph=*/true);
    cudaStreamDestroy(stream);
  });
}

TEST(HostStagedCommunicatorTest, TwoRanksOnOneCard) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  }
  RunGroup(2, [](int, Communicator& host) {
    HostStagedCommunicator comm(host);
    EXPECT_FALSE(comm.capturable());
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    CheckStreamCollectives(comm, stream, /*graph=*/false);
    CheckStreamCollectives(comm, stream, /*graph=*/false);  // the staging area is reused
    cudaStreamDestroy(stream);
  });
}

}  // namespace
}  // namespace kvgrid::worker
