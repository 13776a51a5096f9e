// Collectives among the ranks of one worker group (tensor parallelism): every rank calls the
// same operations in the same order with the same sizes. Implementations: Gloo over TCP for
// CPU workers (gloo_communicator.h); NCCL for GPU workers comes with the CUDA backend.
//
// A collective that cannot complete — a peer died, or the timeout passed — returns
// UNAVAILABLE, and the group is then unusable: its processes exit and the coordinator fails
// their requests over to another group.
//
// Thread-safety: one thread at a time per communicator.
#ifndef KVGRID_WORKER_COMM_COMMUNICATOR_H_
#define KVGRID_WORKER_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvgrid::worker {

class Communicator {
 public:
  virtual ~Communicator() = default;

  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;

  // data[i] = sum over ranks of data[i]; same length on every rank.
  virtual absl::Status AllReduceSum(std::span<float> data) = 0;
  // out = concatenation of every rank's `in` in rank order; out.size() = size() * in.size().
  virtual absl::Status AllGather(std::span<const float> in, std::span<float> out) = 0;
  // `root`'s bytes into every rank's `data` (same length everywhere).
  virtual absl::Status Broadcast(std::span<char> data, int root) = 0;
  virtual absl::Status Barrier() = 0;
};

// Broadcasts a byte string of any length from `root`: its size first, then its bytes. On the
// other ranks `*bytes` is replaced.
absl::Status BroadcastBytes(Communicator& comm, std::string* bytes, int root);

// Every rank's `mine`, in rank order, on every rank (each rank broadcasts its own in turn:
// for small values exchanged once, such as a group's setup).
absl::StatusOr<std::vector<std::string>> GatherBytes(Communicator& comm, const std::string& mine);

// values[i] = the smallest of the ranks' values[i], on every rank (one exchange for them all;
// every rank passes as many).
absl::Status MinAcrossGroup(Communicator& comm, std::span<int64_t> values);
// The smallest of the ranks' `value`s, on every rank.
absl::StatusOr<int64_t> MinAcrossGroup(Communicator& comm, int64_t value);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_COMMUNICATOR_H_
