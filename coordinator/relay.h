// One client Generate call relayed to workers: places the request, streams the worker's
// responses to the client, and fails over when a worker dies mid-stream.
//
// Flow control: one write to the client is in flight at a time; responses that arrive
// meanwhile are merged (consecutive tokens of one continuation) and, past a bound, reading
// from the worker pauses until the client catches up, so a slow client slows its worker
// stream instead of growing the coordinator's memory.
//
// Failover: when a worker stream ends before every continuation finished (the worker died,
// its connection broke, or it failed the request with UNAVAILABLE/INTERNAL/UNKNOWN/CANCELLED),
// each unfinished continuation is resubmitted to another worker with its prompt and the
// tokens it already streamed (WorkerGenerateRequest.resume_token_ids), so the client sees no
// token lost or repeated; with greedy decoding the output equals an uninterrupted run.
//
// Cancellation: a client cancel or deadline cancels the worker streams, which aborts the
// requests there and frees their blocks.
//
// Lifetime: the relay deletes itself once gRPC is done with the client call and every worker
// stream it started has ended. Thread-safety: gRPC callbacks may run on any thread.
#ifndef KVGRID_COORDINATOR_RELAY_H_
#define KVGRID_COORDINATOR_RELAY_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/registry.h"
#include "grpcpp/grpcpp.h"
#include "kvgrid/v1/generation.pb.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::coordinator {

struct RelayOptions {
  // Failovers one request may go through before it fails with UNAVAILABLE.
  int max_failovers = 3;
  // Buffered tokens past which reading from the worker pauses.
  int64_t max_buffered_tokens = 512;
  // Sent to workers as a bearer token (the cluster token); empty: none.
  std::string cluster_token;
};

class GenerateRelay final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  // `request` is validated and tokenized: prompt ids, sampling, stopping, n, priority set;
  // its request_id is left for the relay to fill per worker request. `client_request_id` is
  // echoed in every response. `in_flight` counts live relays (for draining); it must outlive
  // the relay, as must `registry` and `metrics` (which may be null).
  GenerateRelay(grpc::CallbackServerContext* context, WorkerRegistry* registry,
                CoordinatorMetrics* metrics, RelayOptions options,
                std::atomic<int64_t>* in_flight, std::string model,
                std::string client_request_id, v1::WorkerGenerateRequest request);

  ~GenerateRelay() override;

  // Places the request and starts streaming; on a placement error the call finishes with it.
  void Start();

  // Relays and worker streams not yet deleted, in this process. A relay outlives its client
  // call until its worker streams have ended, and uses the registry and metrics until then; a
  // worker stream holds a channel of the registry's until it is deleted. Whoever owns those
  // waits for this to reach 0 after shutting the server down.
  [[nodiscard]] static int64_t NumAlive() { return alive_.load(); }

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  class Upstream;

  // Callbacks from an Upstream (any thread).
  // Returns false when the upstream should pause reading (too much buffered).
  bool OnUpstreamMessage(Upstream* up, v1::GenerateResponse* msg);
  void OnUpstreamDone(Upstream* up, const grpc::Status& status);

  // Places `request` on a worker not in tried_ and creates its stream, appended to `start`
  // (started by the caller once mu_ is released). Errors: as WorkerRegistry::Place.
  absl::Status PlaceLocked(v1::WorkerGenerateRequest request, std::vector<uint32_t> indices,
                           std::vector<Upstream*>* start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What to do next on the client stream, decided under mu_ and run after release.
  enum class Action { kNone, kWrite, kFinish };
  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Action action);
  void FailLocked(grpc::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves paused upstreams that may read again into `resume` (resumed after release).
  void TakeResumableLocked(std::vector<Upstream*>* resume) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unref();

  static std::atomic<int64_t> alive_;

  grpc::CallbackServerContext* const context_;
  WorkerRegistry* const registry_;
  CoordinatorMetrics* const metrics_;
  const RelayOptions options_;
  std::atomic<int64_t>* const in_flight_;
  const std::string model_;
  const std::string client_request_id_;
  const v1::WorkerGenerateRequest request_;  // the original (n continuations, no resume)
  const uint32_t n_;
  const std::chrono::steady_clock::time_point arrival_;

  absl::Mutex mu_;
  int refs_ ABSL_GUARDED_BY(mu_) = 1;  // the client call, plus one per live upstream
  std::vector<Upstream*> upstreams_ ABSL_GUARDED_BY(mu_);
  std::vector<Upstream*> paused_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> tried_ ABSL_GUARDED_BY(mu_);  // workers that failed it
  int failovers_ ABSL_GUARDED_BY(mu_) = 0;  // worker streams that failed it
  // Per continuation: tokens streamed so far, finished, and the time of its first token.
  std::vector<std::vector<int32_t>> tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> finished_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<std::chrono::steady_clock::time_point>> first_token_
      ABSL_GUARDED_BY(mu_);
  std::vector<std::chrono::steady_clock::time_point> last_token_ ABSL_GUARDED_BY(mu_);
  std::optional<double> placed_s_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::GenerateResponse> pending_ ABSL_GUARDED_BY(mu_);
  int64_t pending_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  v1::GenerateResponse writing_msg_;  // the one write in flight
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> error_ ABSL_GUARDED_BY(mu_);
  grpc::Status final_status_;
};

// A Generate call that fails at once (validation, draining).
class FailedStream final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  explicit FailedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_RELAY_H_
