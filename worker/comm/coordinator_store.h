// gloo::rendezvous::Store over the coordinator's StoreSet/StoreGet RPCs, so the ranks of a
// group find each other knowing only the coordinator's address and their rank. Keys live under
// "group/<group id>/".
//
// Gloo calls it from one thread; failures are thrown (Gloo's contract) as std::runtime_error
// and become UNAVAILABLE at GlooCommunicator::Connect.
#ifndef KVGRID_WORKER_COMM_COORDINATOR_STORE_H_
#define KVGRID_WORKER_COMM_COORDINATOR_STORE_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "auth/tls.h"
#include "gloo/rendezvous/store.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::worker {

class CoordinatorStore final : public gloo::rendezvous::Store {
 public:
  // `token`: the cluster token (may be empty). `timeout` bounds get/wait. `channels` makes
  // the channel to the coordinator (--worker-tls-*; plaintext by default).
  CoordinatorStore(const std::string& coordinator_address, std::string token,
                   const std::string& group_id, std::chrono::milliseconds timeout,
                   const auth::ClusterChannels& channels = {});

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  // The value when set; throws on RPC errors other than "not yet set".
  bool TryGet(const std::string& key, std::vector<char>* out);

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::string token_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_COMM_COORDINATOR_STORE_H_
