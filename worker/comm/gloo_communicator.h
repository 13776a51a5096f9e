// Communicator over Gloo's TCP transport, for CPU worker groups. The ranks find each other
// through a rendezvous store (gloo::rendezvous::Store): the coordinator's store RPCs in a
// cluster (CoordinatorStore), or an in-process store in tests.
#ifndef KVGRID_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define KVGRID_WORKER_COMM_GLOO_COMMUNICATOR_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
}  // namespace gloo

namespace kvgrid::worker {

class GlooCommunicator final : public Communicator {
 public:
  // Connects rank `rank` of `size` with its peers through `store`, listening on `hostname`
  // (an address the peers can reach). Every collective fails after `timeout`. The ranks first
  // agree on a namespace for this attempt's keys (rank 0 picks it), so keys that an earlier,
  // failed attempt of the group left in the store are never read: a follower waits up to
  // `join_timeout` for its rank 0, then both sides agree within `timeout`; then the mesh forms
  // within `timeout`.
  // Errors: UNAVAILABLE when the mesh cannot be formed in time (naming the cause);
  // INVALID_ARGUMENT for rank/size.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Connect(
      int rank, int size, gloo::rendezvous::Store& store, const std::string& hostname,
      std::chrono::milliseconds timeout,
      std::chrono::milliseconds join_timeout = std::chrono::seconds(120));

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllReduceSum(std::span<float> data) override;
  absl::Status AllGather(std::span<const float> in, std::span<float> out) override;
  absl::Status Broadcast(std::span<char> data, int root) override;
  absl::Status Barrier() override;

 private:
  GlooCommunicator(std::shared_ptr<gloo::Context> context, int rank, int size,
                   std::chrono::milliseconds timeout)
      : context_(std::move(context)), rank_(rank), size_(size), timeout_(timeout) {}

  std::shared_ptr<gloo::Context> context_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  uint32_t tag_ = 0;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_GLOO_COMMUNICATOR_H_
