// Sees an engine that has work and makes no progress: a step that never ends (a stuck kernel,
// a tensor-parallel collective whose peer froze) while requests wait on it. Once the loop's
// current round has run longer than the timeout (--stall-timeout-s), the watchdog reports the
// stall (the worker turns NOT_SERVING, refuses new requests and tells its coordinators) and
// ends every request with UNAVAILABLE, so the coordinator fails them over to another worker
// within the timeout instead of waiting on a collective timeout or forever. It keeps ending
// whatever arrives while the stall lasts, and reports the end of the stall when the loop comes
// back (a slow step, not a dead one).
//
// Thread-safety: owns one thread; stalled() may be called from any thread.
#ifndef KVGRID_WORKER_SERVICE_STALL_WATCHDOG_H_
#define KVGRID_WORKER_SERVICE_STALL_WATCHDOG_H_

#include <atomic>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/service/engine_loop.h"

namespace kvgrid::worker {

class StallWatchdog {
 public:
  // Watches `loop` (not owned; it must outlive the watchdog) every `poll` (default: a tenth of
  // `timeout`, within [10 ms, 500 ms]). `on_change(stalled)` runs on the watchdog's thread
  // when a stall starts (before the requests are ended) and when it ends.
  StallWatchdog(EngineLoop* loop, absl::Duration timeout, std::function<void(bool)> on_change,
                absl::Duration poll = absl::ZeroDuration());
  // Stops watching.
  ~StallWatchdog();
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  [[nodiscard]] bool stalled() const { return stalled_.load(); }

 private:
  void Run();

  EngineLoop* loop_;
  const absl::Duration timeout_;
  const absl::Duration poll_;
  std::function<void(bool)> on_change_;
  std::atomic<bool> stalled_{false};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_STALL_WATCHDOG_H_
