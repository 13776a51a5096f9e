#include "worker/service/engine_loop.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/cpu/gemm.h"

namespace kvgrid::worker {
namespace {

constexpr absl::Duration kKeepAliveInterval = absl::Seconds(1);

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine,
                       std::function<void(const absl::Status&)> on_step_error)
    : engine_(std::move(engine)), on_step_error_(std::move(on_step_error)) {
  stats_ = engine_->Stats();
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Submit(GenerationRequest request, std::shared_ptr<OutputSink> sink) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      inbox_.emplace_back(std::move(request), std::move(sink));
      ++num_active_;
      return;
    }
  }
  sink->OnError(absl::UnavailableError("the worker is shutting down"));
}

void EngineLoop::Abort(const std::string& request_id, std::shared_ptr<const OutputSink> owner) {
  absl::MutexLock lock(&mu_);
  aborts_.push_back(PendingAbort{request_id, std::move(owner)});
}

EngineStats EngineLoop::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

int64_t EngineLoop::NumActive() const { return num_active_.load(); }

absl::Duration EngineLoop::BusyFor() const {
  const int64_t since = busy_since_ns_.load(std::memory_order_relaxed);
  if (since == 0) return absl::ZeroDuration();
  return absl::Nanoseconds(std::max<int64_t>(0, SteadyNanos() - since));
}

void EngineLoop::MarkBusy(bool busy) {
  busy_since_ns_.store(busy ? std::max<int64_t>(1, SteadyNanos()) : 0,
                       std::memory_order_relaxed);
}

int64_t EngineLoop::FailRunning(const absl::Status& status) {
  std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(inbox_);
  }
  std::vector<std::shared_ptr<OutputSink>> running;
  {
    absl::MutexLock lock(&sinks_mu_);
    for (auto& [id, active] : active_) {
      running.push_back(std::move(active.sink));
      dropped_.push_back(id);
    }
    active_.clear();
  }
  const int64_t ended = static_cast<int64_t>(queued.size() + running.size());
  num_active_ -= ended;
  for (auto& [request, sink] : queued) sink->OnError(status);
  for (const std::shared_ptr<OutputSink>& sink : running) sink->OnError(status);
  return ended;
}

void EngineLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::AbortDroppedLocked() {
  for (const std::string& id : dropped_) engine_->Abort(id);
  dropped_.clear();
}

void EngineLoop::Drain(
    std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>>& submits,
    std::vector<PendingAbort>& aborts) {
  absl::MutexLock sinks(&sinks_mu_);
  AbortDroppedLocked();
  for (auto& [request, sink] : submits) {
    const std::string id = request.id;
    const int64_t n = request.n;
    if (active_.contains(id)) {
      --num_active_;
      sink->OnError(absl::InvalidArgumentError(
          absl::StrCat("request_id: '", id, "' is already in use")));
      continue;
    }
    absl::Status status = engine_->AddRequest(std::move(request));
    if (!status.ok()) {
      --num_active_;
      sink->OnError(std::move(status));
      continue;
    }
    active_[id] = Active{std::move(sink), n};
  }
  for (const PendingAbort& abort : aborts) {
    auto it = active_.find(abort.request_id);
    if (it == active_.end()) continue;  // finished, refused or never seen: nothing to free
    if (abort.owner != nullptr && it->second.sink.get() != abort.owner.get()) continue;
    engine_->Abort(abort.request_id);
    std::shared_ptr<OutputSink> sink = std::move(it->second.sink);
    active_.erase(it);
    --num_active_;
    // Ends the sink's stream: without it, an abort from anywhere but the stream itself would
    // leave that stream waiting for outputs that never come.
    sink->OnError(absl::AbortedError(absl::StrCat("request ", abort.request_id,
                                                  " was aborted")));
  }
  submits.clear();
  aborts.clear();
}

void EngineLoop::Run() {
  kernels::cpu::UseConfiguredThreads();
  std::vector<std::pair<GenerationRequest, std::shared_ptr<OutputSink>>> submits;
  std::vector<PendingAbort> aborts;
  bool keep_alive = false;
  bool group_broken = false;  // a keep-alive failed: the other ranks are gone
  for (;;) {
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      // Sleep while there is nothing to do; wake on a submission, an abort or Stop.
      const bool busy = engine_->HasWork();
      if (!busy) {
        const absl::Condition wake(
            +[](EngineLoop* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
              return self->stop_ || !self->inbox_.empty() || !self->aborts_.empty();
            },
            this);
        MarkBusy(false);
        if (!engine_->has_group()) {
          mu_.Await(wake);
        } else {
          // Idle in a group: the other ranks wait in a collective that would time out.
          keep_alive = !mu_.AwaitWithTimeout(wake, kKeepAliveInterval);
        }
      }
      MarkBusy(true);
      stop = stop_;
      submits.swap(inbox_);
      aborts.swap(aborts_);
    }
    if (keep_alive && !group_broken) {
      keep_alive = false;
      if (absl::Status alive = engine_->KeepGroupAlive(); !alive.ok()) {
        group_broken = true;
        if (on_step_error_) on_step_error_(alive);
      }
      continue;
    }
    Drain(submits, aborts);
    if (stop) break;
    if (!engine_->HasWork()) {
      absl::MutexLock lock(&mu_);
      stats_ = engine_->Stats();
      continue;
    }
    absl::StatusOr<std::vector<TokenOutput>> outputs = engine_->Step();
    {
      absl::MutexLock sinks(&sinks_mu_);
      if (!outputs.ok()) {
        // A failed forward pass leaves the step's sequences to be retried; a failure that
        // repeats would spin, so every request fails and its blocks are freed.
        num_active_ -= static_cast<int64_t>(active_.size());
        for (auto& [id, active] : active_) {
          engine_->Abort(id);
          active.sink->OnError(outputs.status());
        }
        active_.clear();
      } else {
        for (TokenOutput& out : *outputs) {
          auto it = active_.find(out.request_id);
          if (it == active_.end()) continue;
          const bool last = out.finish != FinishReason::kNone && --it->second.unfinished == 0;
          if (last) --num_active_;
          it->second.sink->OnOutput(std::move(out));
          if (last) active_.erase(it);
        }
      }
    }
    if (!outputs.ok() && on_step_error_) on_step_error_(outputs.status());
    absl::MutexLock lock(&mu_);
    stats_ = engine_->Stats();
  }
  // Stopping: whatever is still running or queued is failed, and its blocks freed.
  {
    absl::MutexLock sinks(&sinks_mu_);
    AbortDroppedLocked();
    for (auto& [id, active] : active_) {
      engine_->Abort(id);
      active.sink->OnError(absl::UnavailableError("the worker is shutting down"));
    }
    active_.clear();
  }
  // A tensor-parallel group's other ranks leave their loops (best effort: a broken group
  // fails here too).
  (void)engine_->StopFollowers();
  {
    absl::MutexLock lock(&mu_);
    num_active_ = 0;
    stats_ = engine_->Stats();
  }
  MarkBusy(false);
}

}  // namespace kvgrid::worker
