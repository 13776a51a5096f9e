#include "worker/service/stall_watchdog.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvgrid::worker {

StallWatchdog::StallWatchdog(EngineLoop* loop, absl::Duration timeout,
                             std::function<void(bool)> on_change, absl::Duration poll)
    : loop_(loop),
      timeout_(timeout),
      poll_(poll > absl::ZeroDuration()
                ? poll
                : std::clamp(timeout / 10, absl::Milliseconds(10), absl::Milliseconds(500))),
      on_change_(std::move(on_change)) {
  thread_ = std::thread([this] { Run(); });
}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StallWatchdog::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), poll_)) return;
    }
    const absl::Duration busy = loop_->BusyFor();
    const bool now_stalled = busy > timeout_;
    if (now_stalled != stalled_.load()) {
      stalled_.store(now_stalled);
      if (now_stalled) {
        std::fprintf(stderr,
                     "kvgrid-worker: the engine is stalled (one step has run %.1f s, "
                     "--stall-timeout-s %.1f): NOT_SERVING, its requests move elsewhere\n",
                     absl::ToDoubleSeconds(busy), absl::ToDoubleSeconds(timeout_));
      } else {
        std::fprintf(stderr, "kvgrid-worker: the engine is making progress again: SERVING\n");
      }
      if (on_change_) on_change_(now_stalled);
    }
    if (now_stalled) {
      // Every poll: requests that reached the loop after the stall began end too.
      loop_->FailRunning(absl::UnavailableError(absl::StrFormat(
          "the worker's engine is stalled: one step has run %.1f s (--stall-timeout-s %.1f)",
          absl::ToDoubleSeconds(busy), absl::ToDoubleSeconds(timeout_))));
    }
  }
}

}  // namespace kvgrid::worker
