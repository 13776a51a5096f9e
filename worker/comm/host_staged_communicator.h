// Device collectives staged through pinned host memory over a host Communicator (Gloo): each
// collective copies its input to the host, waits for the stream, runs the host collective and
// copies the result back. NCCL refuses a group in which two ranks share a card; this one does
// not care, so a tensor-parallel group can run on one card (tests, and trying a group's
// configuration before it gets its cards). It is much slower than NCCL and cannot be captured
// in CUDA graphs.
#ifndef KVGRID_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_
#define KVGRID_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_

#include <cstdint>

#include "worker/comm/communicator.h"
#include "worker/comm/device_communicator.h"

namespace kvgrid::worker {

class HostStagedCommunicator final : public DeviceCommunicator {
 public:
  // `host` (not owned) must outlive this object; its collectives are used from the caller's
  // thread.
  explicit HostStagedCommunicator(Communicator& host) : host_(host) {}
  ~HostStagedCommunicator() override;
  HostStagedCommunicator(const HostStagedCommunicator&) = delete;
  HostStagedCommunicator& operator=(const HostStagedCommunicator&) = delete;

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  absl::Status AllReduceSumOn(float* data, int64_t count, cudaStream_t stream) override;
  absl::Status AllGatherOn(const float* in, float* out, int64_t count,
                           cudaStream_t stream) override;
  absl::Status Synchronize(cudaStream_t stream) override;
  bool capturable() const override { return false; }

 private:
  // Grows the pinned staging area to `floats` floats (contents not kept).
  absl::Status Reserve(int64_t floats);

  Communicator& host_;
  float* staging_ = nullptr;  // pinned; [capacity_]
  int64_t capacity_ = 0;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_HOST_STAGED_COMMUNICATOR_H_
