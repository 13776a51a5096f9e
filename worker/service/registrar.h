// Keeps a worker registered with its coordinator: registers (retrying until the coordinator
// answers), then heartbeats with the engine's KV usage; registers again when the coordinator
// no longer knows it (it restarted, or dropped the worker after missed heartbeats).
//
// Thread-safety: owns one background thread; Stop may be called from any thread.
#ifndef KVGRID_WORKER_SERVICE_REGISTRAR_H_
#define KVGRID_WORKER_SERVICE_REGISTRAR_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "auth/tls.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::worker {

class Registrar {
 public:
  // `usage` is called on the registrar's thread for each heartbeat; `draining` likewise.
  // `token` (the cluster token; may be empty) goes with every call to the coordinator, over
  // a channel made by `channels` (--worker-tls-*; plaintext by default).
  Registrar(std::string coordinator_address, std::string token,
            v1::RegisterWorkerRequest registration, std::function<v1::KvUsage()> usage,
            std::function<bool()> draining, const auth::ClusterChannels& channels = {});
  ~Registrar();
  Registrar(const Registrar&) = delete;
  Registrar& operator=(const Registrar&) = delete;

  // Sends one last heartbeat (so the coordinator sees the drain at once) and stops.
  void Stop();
  // The id the coordinator gave, empty until registered.
  [[nodiscard]] std::string worker_id() const;

 private:
  void Run();

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::string token_;
  v1::RegisterWorkerRequest registration_;
  std::function<v1::KvUsage()> usage_;
  std::function<bool()> draining_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_REGISTRAR_H_
