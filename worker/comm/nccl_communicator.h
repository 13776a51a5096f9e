// Communicator over NCCL, for GPU worker groups: one rank per device. The spans passed to the
// collectives are device memory (the CUDA backend's buffers). Rank 0 makes the NCCL unique id
// and shares it through the group's rendezvous store (the coordinator's, in a cluster) or over
// the group's host communicator.
//
// Two faces: Communicator's collectives run on the communicator's own stream and wait for it;
// DeviceCommunicator's are enqueued on the caller's stream (the model's), are captured into
// CUDA graphs, and are waited for by Synchronize.
//
// Every NCCL and CUDA call is checked and becomes a Status naming the call; a collective that
// does not finish within the timeout (a peer died) aborts the communicator and returns
// UNAVAILABLE — nothing aborts the process. The communicator is non-blocking (NCCL's
// `blocking = 0`), so that joining it is bounded too: a rank that never comes would otherwise
// hold the others in ncclCommInitRank forever.
//
// Built wherever the CUDA toolkit (with NCCL) is found; its tests carry the `gpu` label.
#ifndef KVGRID_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define KVGRID_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <chrono>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/device_communicator.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace kvgrid::worker {

class NcclCommunicator final : public Communicator, public DeviceCommunicator {
 public:
  // Joins rank `rank` of `size` on CUDA device `device`; sharing the id and NCCL's join each
  // take at most `timeout`, which also bounds every collective. Errors: INVALID_ARGUMENT for
  // rank/size/device; UNAVAILABLE when the id cannot be shared or NCCL cannot connect
  // (naming the call); DEADLINE_EXCEEDED when not every rank joined within `timeout` (the
  // half-made communicator is aborted).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Connect(
      int rank, int size, int device, gloo::rendezvous::Store& store,
      std::chrono::milliseconds timeout);
  // The same, with rank 0's id broadcast over `host` (the group's Gloo communicator); rank and
  // size are host's.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Connect(
      Communicator& host, int device, std::chrono::milliseconds timeout);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduceSum(std::span<float> data) override;
  absl::Status AllGather(std::span<const float> in, std::span<float> out) override;
  absl::Status Broadcast(std::span<char> data, int root) override;
  absl::Status Barrier() override;

  absl::Status AllReduceSumOn(float* data, int64_t count, cudaStream_t stream) override;
  absl::Status AllGatherOn(const float* in, float* out, int64_t count,
                           cudaStream_t stream) override;
  absl::Status Synchronize(cudaStream_t stream) override;
  bool capturable() const override { return true; }
  // The communicator was aborted (a collective failed or timed out), its resources released.
  bool broken() const override;

 private:
  struct State;
  NcclCommunicator(std::unique_ptr<State> state, int rank, int size,
                   std::chrono::milliseconds timeout);
  // Joins the group of `id` (shared by every rank) on `device`.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Join(
      const void* id, int rank, int size, int device, std::chrono::milliseconds timeout);
  // Waits for `stream`'s work, failing (and aborting the communicator) past the timeout or on
  // an asynchronous NCCL error.
  absl::Status Wait(cudaStream_t stream, const char* what);

  std::unique_ptr<State> state_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_NCCL_COMMUNICATOR_H_
