// The coordinator's view of its workers: registration, heartbeats and liveness, the stubs to
// call them, and placement with its bookkeeping (requests in flight, blocks promised since
// the last heartbeat, which prompt prefixes each worker has seen recently).
//
// A worker (a group's leader) is live while it heartbeats within the timeout, is neither
// draining nor stalled, and no stream to it broke with UNAVAILABLE.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVGRID_COORDINATOR_REGISTRY_H_
#define KVGRID_COORDINATOR_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "auth/tls.h"
#include "kvgrid/v1/generation.pb.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::coordinator {

struct RegistryOptions {
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // A worker silent for this long is taken out of placement.
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Requests a worker may queue beyond its max_num_seqs.
  int64_t max_queue_depth = 64;
  // How the coordinator dials its workers (--worker-tls-*): plaintext by default.
  auth::ClusterChannels worker_channels;
  // Part of every worker id this registry hands out, so that ids of a restarted coordinator
  // never name a worker of an earlier one (whose heartbeats would otherwise keep another
  // worker's entry fresh while it never registers again). Empty: a random one.
  std::string epoch;
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(RegistryOptions options);
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Adds a worker (replacing any earlier one at the same address) and returns its id,
  // "w<n>-<epoch>": unique across restarts of the coordinator.
  std::string Register(const v1::RegisterWorkerRequest& request);
  // Records a heartbeat; false when the id is unknown (the worker should register again).
  bool Heartbeat(const v1::HeartbeatRequest& request);
  // Takes a worker out of placement at once (a stream to it broke: it is likely gone). A lost
  // worker's KV usage is cleared: it describes a pool nobody can reach any more.
  void MarkLost(const std::string& worker_id);
  // Marks workers silent for longer than the timeout as lost and forgets ones lost for
  // long; returns true when the set of live workers changed.
  bool ExpireStale();

  struct Placement {
    std::string worker_id;
    std::shared_ptr<v1::Worker::Stub> stub;
  };
  // Picks a worker for a sequence of `model` (see placement.h) that is not in `exclude`, and
  // counts it in flight there until Release. Errors: as ChooseWorker.
  absl::StatusOr<Placement> Place(const std::string& model, std::span<const int32_t> prompt,
                                  int64_t max_new_tokens,
                                  const absl::flat_hash_set<std::string>& exclude);
  void Release(const std::string& worker_id);

  // Live workers serving `model`.
  [[nodiscard]] int NumLive(const std::string& model) const;
  void FillStatus(v1::ClusterStatusResponse* response) const;

  [[nodiscard]] const RegistryOptions& options() const { return options_; }
  [[nodiscard]] const std::string& epoch() const { return epoch_; }

 private:
  struct Entry {
    v1::RegisterWorkerRequest info;
    std::string id;
    std::shared_ptr<v1::Worker::Stub> stub;
    v1::KvUsage usage;
    absl::Time last_heartbeat;
    bool lost = false;
    bool draining = false;
    bool stalled = false;
    int64_t in_flight = 0;
    int64_t blocks_promised = 0;  // worst-case blocks placed since the last heartbeat
    // Chained hashes of leading prompt blocks recently placed here -> last use.
    absl::flat_hash_map<uint64_t, int64_t> prefixes;
  };
  bool LiveLocked(const Entry& e) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void MarkLostLocked(Entry& e);

  const RegistryOptions options_;
  const std::string epoch_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_REGISTRY_H_
