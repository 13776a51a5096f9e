// The collectives of one worker group of tp_size x cp_size ranks over Gloo: rank
// r = cp_rank * tp_size + tp_rank. The whole group carries the leader's step plans; the
// tp_size ranks of one cp_rank split the weights and KV heads (tensor parallelism: their
// all-reduces); the cp_size ranks of one tp_rank hold the same shard and split every
// sequence's blocks (context parallelism: their per-layer all-gather). Each is its own Gloo
// mesh, formed through its own prefix of the one rendezvous store; a dimension of size 1 has
// none, and where the other is 1 the whole group serves as it.
#ifndef KVGRID_WORKER_COMM_GLOO_WORKER_GROUP_H_
#define KVGRID_WORKER_COMM_GLOO_WORKER_GROUP_H_

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace kvgrid::worker {

class GlooWorkerGroup {
 public:
  // Connects rank `rank` of a group of tp_size x cp_size (> 1 in all), as
  // GlooCommunicator::Connect does for each mesh. Errors: INVALID_ARGUMENT for the sizes or
  // rank; UNAVAILABLE as Connect.
  static absl::StatusOr<std::unique_ptr<GlooWorkerGroup>> Connect(
      int rank, int tp_size, int cp_size, gloo::rendezvous::Store& store,
      const std::string& hostname, std::chrono::milliseconds timeout,
      std::chrono::milliseconds join_timeout = std::chrono::seconds(120));

  [[nodiscard]] int tp_rank() const { return tp_rank_; }
  [[nodiscard]] int cp_rank() const { return cp_rank_; }
  // Owned by the group; tp() and cp() are null for a dimension of size 1.
  [[nodiscard]] Communicator& group() { return *group_; }
  [[nodiscard]] Communicator* tp() { return tp_view_; }
  [[nodiscard]] Communicator* cp() { return cp_view_; }

 private:
  GlooWorkerGroup() = default;

  int tp_rank_ = 0, cp_rank_ = 0;
  std::unique_ptr<Communicator> group_, tp_, cp_;
  Communicator* tp_view_ = nullptr;
  Communicator* cp_view_ = nullptr;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_GLOO_WORKER_GROUP_H_
