// One client Generate call relayed to workers: places the request, streams the worker's
// responses to the client, and fails over when a worker dies mid-stream.
//
// The relay knows nothing of the client's wire format: it writes GenerateResponse messages to
// a RelaySink (the gRPC stream of Generation.Generate, or an OpenAI HTTP response), and the
// sink reports back when a write is done, when the client went away, and when it is done with
// the relay. Placement, flow control, failover, abort on cancel, metrics and the in-flight
// count for draining are therefore the same for every front door.
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
// A worker that refuses a request with RESOURCE_EXHAUSTED (its own queue is full: several
// coordinators share it) is tried no more for it, and the request goes to another worker the
// same way; when none can take it, the client gets RESOURCE_EXHAUSTED.
//
// Cancellation: a client cancel (a gRPC cancel, an HTTP client that disconnected) or the
// deadline cancels the worker streams, which aborts the requests there and frees their blocks.
//
// Lifetime: the relay deletes itself once its sink called OnDone and every worker stream it
// started has ended. Thread-safety: every method may be called from any thread.
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

// The client side of one relayed call. The relay calls Write with one write in flight at a
// time, and End once, after the last write completed; calls come from any thread, never
// two at once, and never under the relay's lock. The sink answers each Write with
// GenerateRelay::OnWriteDone, reports a client that went away with OnCancel, and calls OnDone
// once, after End, when it will call the relay no more; the sink must stay alive until it
// called OnDone.
class RelaySink {
 public:
  virtual ~RelaySink() = default;
  // Sends `msg`, which stays valid until the sink's OnWriteDone.
  virtual void Write(const v1::GenerateResponse& msg) = 0;
  // Ends the call: OK once every continuation finished; otherwise the error (CANCELLED after a
  // cancel). Tokens not yet written are dropped on an error.
  virtual void End(const grpc::Status& status) = 0;
};

class GenerateRelay final {
 public:
  // `request` is validated and tokenized: prompt ids, sampling, stopping, n, priority set;
  // its request_id is left for the relay to fill per worker request. `client_request_id` is
  // echoed in every response. `sink` receives the responses (see RelaySink). `deadline` ends
  // the worker streams (system_clock max: none). `api` labels the metrics ("grpc", "http").
  // `in_flight` counts live relays (for draining); it must outlive the relay, as must
  // `registry` and `metrics` (which may be null).
  GenerateRelay(RelaySink* sink, std::chrono::system_clock::time_point deadline,
                WorkerRegistry* registry, CoordinatorMetrics* metrics, RelayOptions options,
                std::atomic<int64_t>* in_flight, std::string api, std::string model,
                std::string client_request_id, v1::WorkerGenerateRequest request);

  ~GenerateRelay();

  // Places the request and starts streaming; on a placement error the sink is finished with
  // it (from within Start).
  void Start();

  // Relays and worker streams not yet deleted, in this process. A relay outlives its client
  // call until its worker streams have ended, and uses the registry and metrics until then; a
  // worker stream holds a channel of the registry's until it is deleted. Whoever owns those
  // waits for this to reach 0 after shutting the server down.
  [[nodiscard]] static int64_t NumAlive() { return alive_.load(); }

  // From the sink: the write finished (ok false: the client is gone, as for OnCancel).
  void OnWriteDone(bool ok);
  // From the sink: the client cancelled or went away; the worker streams are cancelled and the
  // sink is finished with CANCELLED.
  void OnCancel();
  // From the sink, once, after End: it will call the relay no more.
  void OnDone();

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

  RelaySink* const sink_;
  const std::chrono::system_clock::time_point deadline_;
  WorkerRegistry* const registry_;
  CoordinatorMetrics* const metrics_;
  const RelayOptions options_;
  std::atomic<int64_t>* const in_flight_;
  const std::string api_;
  const std::string model_;
  const std::string client_request_id_;
  const v1::WorkerGenerateRequest request_;  // the original (n continuations, no resume)
  const uint32_t n_;
  const std::chrono::steady_clock::time_point arrival_;

  absl::Mutex mu_;
  int refs_ ABSL_GUARDED_BY(mu_) = 1;  // the sink, plus one per live upstream
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

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_RELAY_H_
