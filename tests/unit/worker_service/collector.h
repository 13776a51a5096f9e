// An OutputSink for the engine-loop tests: records a request's tokens and its end, counts
// anything that arrives after the end, and lets a test wait for either.
#ifndef KVGRID_TESTS_UNIT_WORKER_SERVICE_COLLECTOR_H_
#define KVGRID_TESTS_UNIT_WORKER_SERVICE_COLLECTOR_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/service/engine_loop.h"

namespace kvgrid::worker::testing {

class Collector : public OutputSink {
 public:
  void OnOutput(TokenOutput out) override {
    absl::MutexLock lock(&mu_);
    if (done_) ++after_end_;
    tokens_.push_back(out.token_id);
    if (out.finish != FinishReason::kNone) done_ = true;
  }
  void OnError(absl::Status s) override {
    absl::MutexLock lock(&mu_);
    if (done_) ++after_end_;
    error_ = std::move(s);
    done_ = true;
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }
  bool WaitDone(absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
  }
  bool WaitTokens(size_t n, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    std::pair<Collector*, size_t> arg(this, n);
    return mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<Collector*, size_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return a->first->tokens_.size() >= a->second;
            },
            &arg),
        timeout);
  }
  size_t num_tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_.size();
  }
  std::vector<int32_t> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  absl::Status error() {
    absl::MutexLock lock(&mu_);
    return error_;
  }
  // Outputs and errors that arrived after the request had ended.
  int after_end() {
    absl::MutexLock lock(&mu_);
    return after_end_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int32_t> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  int after_end_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvgrid::worker::testing

#endif  // KVGRID_TESTS_UNIT_WORKER_SERVICE_COLLECTOR_H_
