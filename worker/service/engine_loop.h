// Runs one Engine on its own thread for a service: requests arrive from any thread, each with
// a sink that receives its outputs; the loop steps the engine while it has work and sleeps
// when it has none.
//
// Stalls: BusyFor says how long the loop's current round (a step, a keep-alive, applying
// submissions) has run, so a watchdog (worker/service/stall_watchdog.h) can see a step that
// never ends (a stuck kernel, a collective that never returns) and FailRunning can end every
// request's sink while the loop thread is still stuck.
//
// Thread-safety: Submit, Abort, Stats, NumActive, BusyFor, FailRunning and Stop may be called
// from any thread. Sink callbacks run on the loop's thread (FailRunning's OnError on its
// caller's), in order per request, and must neither block nor call back into the loop.
#ifndef KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_
#define KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/engine/engine.h"

namespace kvgrid::worker {

// Receives one request's outputs. After OnError, or after the output that finishes the last
// of its continuations, nothing more arrives.
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void OnOutput(TokenOutput output) = 0;
  // The request was refused (the engine's AddRequest error) or the engine failed.
  virtual void OnError(absl::Status status) = 0;
};

class EngineLoop {
 public:
  // Starts the loop's thread. `on_step_error` (optional) runs on the loop's thread after a
  // failed step has failed every request: the worker uses it to shut down when the step
  // cannot be retried (UNAVAILABLE: a broken group, a lost CUDA context).
  explicit EngineLoop(std::unique_ptr<Engine> engine,
                      std::function<void(const absl::Status&)> on_step_error = nullptr);
  // Stops the thread; requests still running get UNAVAILABLE.
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues a request for the next step. Refusals (AddRequest's INVALID_ARGUMENT) and
  // UNAVAILABLE after Stop reach the sink's OnError.
  void Submit(GenerationRequest request, std::shared_ptr<OutputSink> sink);
  // Drops a request wherever it is and frees its blocks; its sink's OnError receives ABORTED,
  // and nothing after. With `owner`, only a request whose sink is `owner` is dropped: a
  // stream's own cancel never reaches another stream's request that happens to carry the same
  // id (the loop holds `owner` until then, so no new sink can take its address). Unknown or
  // finished ids, and other sinks' requests, are fine.
  void Abort(const std::string& request_id, std::shared_ptr<const OutputSink> owner = nullptr);
  // Engine statistics as of the last step (or idle moment).
  [[nodiscard]] EngineStats Stats() const;
  // Requests submitted and not yet finished, refused or aborted; a request stops counting
  // before its sink receives its last output or its error.
  [[nodiscard]] int64_t NumActive() const;
  // Fails every request with UNAVAILABLE and stops the thread. Idempotent.
  void Stop();

  // How long the loop's current round has run; zero while it waits for work. A loop that has
  // work and makes progress comes back to zero after every step.
  [[nodiscard]] absl::Duration BusyFor() const;
  // Ends every running and queued request at once with `status` (each sink's OnError, called
  // here, and nothing after), even while the loop thread is stuck in a step; the engine drops
  // those requests and frees their blocks when the loop thread next gets to it. Returns how
  // many requests were ended.
  int64_t FailRunning(const absl::Status& status);

 private:
  struct Active {
    std::shared_ptr<OutputSink> sink;
    int64_t unfinished = 1;  // continuations still running
  };
  struct PendingAbort {
    std::string request_id;
    std::shared_ptr<const OutputSink> owner;  // null: whichever sink the request has
  };
  void Run();
  // Aborts in the engine the requests FailRunning ended: their sinks are gone, the engine
  // still holds them (loop thread only).
  void AbortDroppedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sinks_mu_);
  // Marks the start of a round (now) or the wait for work (idle).
  void MarkBusy(bool busy);
  // Applies the drops of FailRunning, queued submissions, then aborts, to the engine (loop
  // thread only).
  void Drain(std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>>& submits,
             std::vector<PendingAbort>& aborts);

  mutable absl::Mutex mu_;
  std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>> inbox_
      ABSL_GUARDED_BY(mu_);
  std::vector<PendingAbort> aborts_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  // Counted down before the sink hears that its request ended, so that a client that sends
  // its next request the moment the last one ends never finds the slot still taken.
  std::atomic<int64_t> num_active_{0};
  // steady_clock nanoseconds at the start of the current round; 0 while waiting for work.
  std::atomic<int64_t> busy_since_ns_{0};

  // The requests the engine runs, by id. Written by the loop thread and by FailRunning, which
  // moves them all out and leaves their ids in dropped_ for the engine to abort. Sink
  // callbacks run with sinks_mu_ held, so that none follows FailRunning's OnError. Nothing
  // takes sinks_mu_ with mu_ held.
  absl::Mutex sinks_mu_;
  absl::flat_hash_map<std::string, Active> active_ ABSL_GUARDED_BY(sinks_mu_);
  std::vector<std::string> dropped_ ABSL_GUARDED_BY(sinks_mu_);

  // Loop thread only.
  std::unique_ptr<Engine> engine_;
  std::function<void(const absl::Status&)> on_step_error_;
  std::thread thread_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_
