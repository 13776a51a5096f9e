// Keeps a worker registered with its coordinators: registers with each (retrying until it
// answers), then heartbeats with the engine's KV usage; registers again when a coordinator
// no longer knows it (it restarted, or dropped the worker after missed heartbeats).
//
// Several coordinators (--coordinator A,B) each get a thread of their own, so one that is
// down or slow never delays the others' heartbeats; each hands out its own id. Coordinators
// share nothing: each counts only the requests it placed, and the worker's own admission
// (max_num_seqs, queue depth, RESOURCE_EXHAUSTED) arbitrates between them.
//
// Thread-safety: owns one background thread per coordinator; Stop may be called from any
// thread.
#ifndef KVGRID_WORKER_SERVICE_REGISTRAR_H_
#define KVGRID_WORKER_SERVICE_REGISTRAR_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "auth/tls.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::worker {

class Registrar {
 public:
  // `usage` is called on the registrar's threads for each heartbeat; `draining` and
  // `stalled` (optional) likewise (all may run concurrently when there are several
  // coordinators). `token` (the cluster token; may be empty) goes with every call to a
  // coordinator, over channels made by `channels` (--worker-tls-*; plaintext by default).
  Registrar(std::vector<std::string> coordinator_addresses, std::string token,
            v1::RegisterWorkerRequest registration, std::function<v1::KvUsage()> usage,
            std::function<bool()> draining, const auth::ClusterChannels& channels = {},
            std::function<bool()> stalled = nullptr);
  ~Registrar();
  Registrar(const Registrar&) = delete;
  Registrar& operator=(const Registrar&) = delete;

  // Sends one last heartbeat to each coordinator (so they see the drain at once) and stops.
  void Stop();
  // The id the i-th coordinator gave, empty until registered there.
  [[nodiscard]] std::string worker_id(size_t coordinator = 0) const;

 private:
  struct Link {
    std::string address;
    std::unique_ptr<v1::Coordinator::Stub> stub;
  };
  void Run(size_t index);

  std::vector<Link> links_;
  std::string token_;
  v1::RegisterWorkerRequest registration_;
  std::function<v1::KvUsage()> usage_;
  std::function<bool()> draining_;
  std::function<bool()> stalled_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::string> worker_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_REGISTRAR_H_
