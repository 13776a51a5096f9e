#include "worker/comm/host_staged_communicator.h"

#include <algorithm>
#include <span>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "model/status_macros.h"

namespace kvgrid::worker {

HostStagedCommunicator::~HostStagedCommunicator() {
  if (staging_ != nullptr) (void)cudaFreeHost(staging_);  // nothing to report to from here
}

absl::Status HostStagedCommunicator::Reserve(int64_t floats) {
  if (floats <= capacity_) return absl::OkStatus();
  const int64_t want = std::max(floats, 2 * capacity_);
  if (staging_ != nullptr) {
    // The last collective's copy back may still read the old area.
    KVGRID_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    KVGRID_CUDA_RETURN_IF_ERROR(cudaFreeHost(staging_));
  }
  staging_ = nullptr;
  capacity_ = 0;
  void* p = nullptr;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, static_cast<size_t>(want) * sizeof(float)));
  staging_ = static_cast<float*>(p);
  capacity_ = want;
  return absl::OkStatus();
}

absl::Status HostStagedCommunicator::AllReduceSumOn(float* data, int64_t count,
                                                    cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  KVGRID_RETURN_IF_ERROR(Reserve(count));
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  KVGRID_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(staging_, data, bytes, cudaMemcpyDeviceToHost, stream));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  KVGRID_RETURN_IF_ERROR(host_.AllReduceSum(std::span<float>(staging_, count)));
  // The copy back reads staging_ later; the next collective's copy to the host is ordered after
  // it on the same stream, and the host touches staging_ only after waiting for that one.
  KVGRID_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(data, staging_, bytes, cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status HostStagedCommunicator::AllGatherOn(const float* in, float* out, int64_t count,
                                                 cudaStream_t stream) {
  if (count == 0) return absl::OkStatus();
  const int64_t total = count * (1 + size());  // the input, then the gathered values
  KVGRID_RETURN_IF_ERROR(Reserve(total));
  float* local = staging_;
  float* gathered = staging_ + count;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(local, in, static_cast<size_t>(count) * sizeof(float),
                                              cudaMemcpyDeviceToHost, stream));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  KVGRID_RETURN_IF_ERROR(host_.AllGather(std::span<const float>(local, count),
                                         std::span<float>(gathered, count * size())));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, gathered,
                                              static_cast<size_t>(count * size()) * sizeof(float),
                                              cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status HostStagedCommunicator::Synchronize(cudaStream_t stream) {
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
