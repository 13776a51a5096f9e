// Collectives on device memory for the CUDA backend's tensor parallelism, enqueued on the
// caller's CUDA stream so that they are ordered with its kernels without a host round trip per
// call. Implementations: NcclCommunicator (one rank per card; what a deployment runs) and
// HostStagedCommunicator (through pinned host memory over a host Communicator, for ranks that
// share a card, where NCCL refuses to form a group).
//
// Every rank enqueues the same collectives in the same order with the same sizes. A collective
// that cannot complete is reported by Synchronize (UNAVAILABLE) once the caller waits for its
// stream; the group is then unusable, as with Communicator.
//
// Thread-safety: one thread at a time per communicator.
#ifndef KVGRID_WORKER_COMM_DEVICE_COMMUNICATOR_H_
#define KVGRID_WORKER_COMM_DEVICE_COMMUNICATOR_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace kvgrid::worker {

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;

  // Enqueues data[i] = sum over ranks of data[i] on `stream`.
  //   data: [count] fp32, device
  // Errors: UNAVAILABLE naming the call when the group is broken or the call fails.
  virtual absl::Status AllReduceSumOn(float* data, int64_t count, cudaStream_t stream) = 0;
  // Enqueues out = the ranks' `in` in rank order on `stream`.
  //   in: [count] fp32, device; out: [size() * count] fp32, device
  // Errors: as AllReduceSumOn.
  virtual absl::Status AllGatherOn(const float* in, float* out, int64_t count,
                                   cudaStream_t stream) = 0;
  // Waits for everything enqueued on `stream`. Errors: UNAVAILABLE when a collective failed or
  // did not finish within the communicator's timeout (the group is then broken); INTERNAL
  // naming a failed CUDA call.
  virtual absl::Status Synchronize(cudaStream_t stream) = 0;
  // Whether the collectives may be recorded in a CUDA graph (no host work inside them).
  [[nodiscard]] virtual bool capturable() const = 0;
  // True once a failed or timed-out collective broke the group (every later call fails):
  // graphs recorded with its collectives must not be launched any more.
  [[nodiscard]] virtual bool broken() const { return false; }
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_DEVICE_COMMUNICATOR_H_
