// Runs one Engine on its own thread for a service: requests arrive from any thread, each with
// a sink that receives its outputs; the loop steps the engine while it has work and sleeps
// when it has none.
//
// Thread-safety: Submit, Abort, Stats, NumActive and Stop may be called from any thread. Sink
// callbacks run on the loop's thread, in order per request, and must not block.
#ifndef KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_
#define KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_

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
  // failed step has failed every request: a tensor-parallel worker uses it to shut down, its
  // group being broken.
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
  // Requests submitted and not yet finished, refused or aborted.
  [[nodiscard]] int64_t NumActive() const;
  // Fails every request with UNAVAILABLE and stops the thread. Idempotent.
  void Stop();

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
  // Applies queued submissions, then aborts, to the engine (loop thread only).
  void Drain(std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>>& submits,
             std::vector<PendingAbort>& aborts);

  mutable absl::Mutex mu_;
  std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>> inbox_
      ABSL_GUARDED_BY(mu_);
  std::vector<PendingAbort> aborts_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  EngineStats stats_ ABSL_GUARDED_BY(mu_);
  int64_t num_active_ ABSL_GUARDED_BY(mu_) = 0;

  // Loop thread only.
  std::unique_ptr<Engine> engine_;
  std::function<void(const absl::Status&)> on_step_error_;
  absl::flat_hash_map<std::string, Active> active_;
  std::thread thread_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_ENGINE_LOOP_H_
