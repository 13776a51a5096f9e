// NCCL communicator: one rank per visible GPU (a single GPU makes a group of one), collectives
// on device buffers against the values every rank contributed. Skipped where no GPU is
// visible.
#include <cuda_runtime_api.h>

#include <thread>
#include <vector>

#include "gloo/rendezvous/hash_store.h"
#include "gtest/gtest.h"
#include "worker/comm/nccl_communicator.h"

namespace kvgrid::worker {
namespace {

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

}  // namespace
}  // namespace kvgrid::worker
