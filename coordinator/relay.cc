#include "coordinator/relay.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "auth/bearer_auth.h"
#include "proto/grpc_status.h"

namespace kvgrid::coordinator {
namespace {

// Worker-side request ids are the client's id plus a number no other attempt of this
// coordinator uses: two calls with the same client id (ids are the client's to choose, and a
// retry after a deadline reuses one) must not meet on a worker, which refuses an id it is still
// running and whose aborts go by id. The first number is random so that a restarted
// coordinator does not reuse the ids of requests its predecessor left on the workers.
std::string NextWorkerRequestId(const std::string& client_request_id) {
  static std::atomic<uint64_t> next{std::random_device{}() & 0xffffffffu};
  return absl::StrCat(client_request_id, "@", next.fetch_add(1));
}

}  // namespace

// One worker stream, covering some continuations of the relay's request.
class GenerateRelay::Upstream final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  Upstream(GenerateRelay* owner, WorkerRegistry::Placement placement,
           v1::WorkerGenerateRequest request, std::vector<uint32_t> indices,
           std::chrono::system_clock::time_point deadline, const std::string& token)
      : owner_(owner),
        placement_(std::move(placement)),
        request_(std::move(request)),
        indices_(std::move(indices)) {
    alive_.fetch_add(1);
    auth::AttachBearer(&context_, token);
    if (deadline != std::chrono::system_clock::time_point::max()) {
      context_.set_deadline(deadline);
    }
  }

  ~Upstream() override { alive_.fetch_sub(1); }

  void Start() {
    placement_.stub->async()->Generate(&context_, &request_, this);
    StartRead(&msg_);
    StartCall();
  }
  // Reading stops (with a hold, so the call cannot complete under a paused reader) until
  // Resume, which reads again; a cancelled call's read just fails and the call completes.
  void Resume() {
    StartRead(&msg_);
    RemoveHold();
  }
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows with its status
    AddHold();  // the owner may resume us from another thread before this returns
    if (owner_->OnUpstreamMessage(this, &msg_)) Resume();
  }
  void OnDone(const grpc::Status& status) override {
    owner_->OnUpstreamDone(this, status);
    delete this;
  }

  const std::string& worker_id() const { return placement_.worker_id; }
  const std::vector<uint32_t>& indices() const { return indices_; }
  // Whether the registry's in-flight count for this stream was given back (guarded by the
  // owner's mutex).
  bool released = false;

 private:
  GenerateRelay* owner_;
  WorkerRegistry::Placement placement_;
  grpc::ClientContext context_;
  v1::WorkerGenerateRequest request_;
  std::vector<uint32_t> indices_;
  v1::GenerateResponse msg_;
};

GenerateRelay::GenerateRelay(RelaySink* sink, std::chrono::system_clock::time_point deadline,
                             WorkerRegistry* registry, CoordinatorMetrics* metrics,
                             RelayOptions options, std::atomic<int64_t>* in_flight,
                             std::string api, std::string model, std::string client_request_id,
                             v1::WorkerGenerateRequest request)
    : sink_(sink),
      deadline_(deadline),
      registry_(registry),
      metrics_(metrics),
      options_(options),
      in_flight_(in_flight),
      api_(std::move(api)),
      model_(std::move(model)),
      client_request_id_(std::move(client_request_id)),
      request_(std::move(request)),
      n_(std::max<uint32_t>(1, request_.n())),
      arrival_(std::chrono::steady_clock::now()) {
  alive_.fetch_add(1);
  in_flight_->fetch_add(1);
  absl::MutexLock lock(&mu_);
  tokens_.resize(n_);
  finished_.assign(n_, false);
  first_token_.resize(n_);
  last_token_.resize(n_);
}

std::atomic<int64_t> GenerateRelay::alive_{0};

GenerateRelay::~GenerateRelay() { alive_.fetch_sub(1); }

void GenerateRelay::Start() {
  std::vector<Upstream*> start;
  Action action = Action::kNone;
  {
    absl::MutexLock lock(&mu_);
    std::vector<uint32_t> all(n_);
    for (uint32_t i = 0; i < n_; ++i) all[i] = i;
    absl::Status placed = PlaceLocked(request_, std::move(all), &start);
    if (!placed.ok()) {
      FailLocked(proto::ToGrpcStatus(placed));
      action = NextLocked();
    }
  }
  for (Upstream* up : start) up->Start();
  Run(action);
}

absl::Status GenerateRelay::PlaceLocked(v1::WorkerGenerateRequest request,
                                        std::vector<uint32_t> indices,
                                        std::vector<Upstream*>* start) {
  absl::StatusOr<WorkerRegistry::Placement> placement =
      registry_->Place(model_,
                       std::span<const int32_t>(request.prompt_token_ids().data(),
                                                request.prompt_token_ids().size()),
                       request.stopping().max_new_tokens(), tried_);
  if (!placement.ok()) return placement.status();
  if (!placed_s_) {
    placed_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - arrival_).count();
  }
  // Every attempt has its own worker-side id: a resubmission may land on a worker that still
  // knows the first attempt.
  request.set_request_id(NextWorkerRequestId(client_request_id_));
  auto* up = new Upstream(this, *std::move(placement), std::move(request), std::move(indices),
                          deadline_, options_.cluster_token);
  upstreams_.push_back(up);
  ++refs_;
  start->push_back(up);
  return absl::OkStatus();
}

bool GenerateRelay::OnUpstreamMessage(Upstream* up, v1::GenerateResponse* msg) {
  Action action;
  bool keep_reading;
  {
    absl::MutexLock lock(&mu_);
    const uint32_t index = msg->index();
    // Nothing to forward: keep draining. Once the call is over nothing is buffered either, so
    // a reader can no longer pause after the last chance to resume it (OnCancel, a failure).
    if (index >= n_ || finished_[index] || cancelled_ || error_ || finish_called_) {
      return true;
    }
    const auto now = std::chrono::steady_clock::now();
    if (msg->token_ids_size() > 0 && metrics_ != nullptr) {
      if (!first_token_[index]) {
        metrics_->ObserveFirstToken(model_, api_, std::chrono::duration<double>(now - arrival_).count());
      } else {
        metrics_->ObserveInterToken(
            model_, api_, std::chrono::duration<double>(now - last_token_[index]).count());
      }
      // Tokens that arrived together count as arriving at once.
      for (int i = 1; i < msg->token_ids_size(); ++i) metrics_->ObserveInterToken(model_, api_, 0.0);
    }
    if (msg->token_ids_size() > 0) last_token_[index] = now;
    if (!first_token_[index] && msg->token_ids_size() > 0) first_token_[index] = now;
    tokens_[index].insert(tokens_[index].end(), msg->token_ids().begin(),
                          msg->token_ids().end());
    msg->set_request_id(client_request_id_);
    msg->set_worker_id(up->worker_id());
    if (msg->finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      finished_[index] = true;
      // Timings from the client's point of view: arrival at the coordinator.
      v1::Timings* t = msg->mutable_timings();
      t->set_queued_s(placed_s_.value_or(0) + t->queued_s());
      t->set_first_token_s(std::chrono::duration<double>(*first_token_[index] - arrival_).count());
      t->set_finished_s(std::chrono::duration<double>(now - arrival_).count());
      // The worker is done with this request once all its continuations finished: give the
      // slot back now, not when its stream closes, so a client that sends the next request
      // right after this one never finds the slot still taken.
      if (!up->released && std::all_of(up->indices().begin(), up->indices().end(),
                                       [this](uint32_t i) { return finished_[i]; })) {
        up->released = true;
        registry_->Release(up->worker_id());
      }
      if (metrics_ != nullptr) {
        metrics_->ObserveFinished(
            model_, api_, msg->finish_reason() == v1::FINISH_REASON_STOP ? "stop" : "length",
            t->finished_s(), t->queued_s(), index == 0 ? msg->usage().prompt_tokens() : 0,
            static_cast<int64_t>(tokens_[index].size()));
      }
    }
    pending_tokens_ += msg->token_ids_size();
    v1::GenerateResponse* back = pending_.empty() ? nullptr : &pending_.back();
    if (back != nullptr && back->index() == index &&
        back->finish_reason() == v1::FINISH_REASON_UNSPECIFIED) {
      back->mutable_token_ids()->MergeFrom(msg->token_ids());
      back->mutable_text()->append(msg->text());
      back->mutable_logprobs()->MergeFrom(msg->logprobs());
      back->set_worker_id(msg->worker_id());
      back->set_finish_reason(msg->finish_reason());
      if (msg->has_usage()) *back->mutable_usage() = msg->usage();
      if (msg->has_timings()) *back->mutable_timings() = msg->timings();
    } else {
      pending_.push_back(std::move(*msg));
    }
    msg->Clear();
    keep_reading = pending_tokens_ < options_.max_buffered_tokens;
    if (!keep_reading) paused_.push_back(up);
    action = NextLocked();
  }
  Run(action);
  return keep_reading;
}

void GenerateRelay::OnUpstreamDone(Upstream* up, const grpc::Status& status) {
  std::vector<Upstream*> start, resume;
  Action action = Action::kNone;
  {
    absl::MutexLock lock(&mu_);
    if (!up->released) {
      up->released = true;
      registry_->Release(up->worker_id());
    }
    upstreams_.erase(std::remove(upstreams_.begin(), upstreams_.end(), up), upstreams_.end());
    paused_.erase(std::remove(paused_.begin(), paused_.end(), up), paused_.end());
    std::vector<uint32_t> unfinished;
    for (uint32_t i : up->indices()) {
      if (!finished_[i]) unfinished.push_back(i);
    }
    if (!cancelled_ && !finish_called_ && !error_ && !unfinished.empty()) {
      const grpc::StatusCode code = status.error_code();
      // A worker whose own queue is full (another coordinator filled it) refused the request:
      // another worker may take it; if none can, the client gets the refusal.
      const bool full = code == grpc::StatusCode::RESOURCE_EXHAUSTED;
      const bool retry = code == grpc::StatusCode::OK || code == grpc::StatusCode::UNAVAILABLE ||
                         code == grpc::StatusCode::INTERNAL || code == grpc::StatusCode::UNKNOWN ||
                         code == grpc::StatusCode::CANCELLED || full;
      if (!retry) {
        // The request itself is bad, its deadline passed, or it was aborted on the worker
        // (Worker.Abort: ABORTED, meant to end it, not to move it).
        FailLocked(status);
      } else {
        tried_.insert(up->worker_id());
        // A broken stream means the worker is likely gone; a draining or stalled one still
        // heartbeats, and its heartbeats say when it may be placed on again.
        if (code != grpc::StatusCode::OK && !full &&
            status.error_message().find("draining") == std::string::npos &&
            status.error_message().find("stalled") == std::string::npos) {
          registry_->MarkLost(up->worker_id());
        }
        const grpc::StatusCode give_up = full ? code : grpc::StatusCode::UNAVAILABLE;
        if (++failovers_ > options_.max_failovers) {
          FailLocked(grpc::Status(
              give_up, absl::StrCat("worker ", up->worker_id(), " failed (",
                                    status.error_message(), ") and the failover limit was reached")));
        }
        for (uint32_t i : unfinished) {
          if (error_) break;
          v1::WorkerGenerateRequest resumed = request_;
          resumed.set_n(1);
          resumed.set_index_offset(i);
          resumed.mutable_resume_token_ids()->Assign(tokens_[i].begin(), tokens_[i].end());
          if (metrics_ != nullptr && !full) metrics_->CountFailover(model_);
          absl::Status placed = PlaceLocked(std::move(resumed), {i}, &start);
          if (!placed.ok()) {
            FailLocked(grpc::Status(
                give_up,
                absl::StrCat("worker ", up->worker_id(), " failed (", status.error_message(),
                             ") and no other worker can take over: ", placed.message())));
          }
        }
        if (error_) {
          for (Upstream* other : start) other->Cancel();
        }
      }
    }
    action = NextLocked();
    TakeResumableLocked(&resume);
  }
  for (Upstream* s : start) s->Start();
  for (Upstream* r : resume) r->Resume();
  Run(action);
  Unref();
}

void GenerateRelay::FailLocked(grpc::Status status) {
  if (error_) return;
  error_ = std::move(status);
  for (Upstream* up : upstreams_) up->Cancel();
}

GenerateRelay::Action GenerateRelay::NextLocked() {
  if (writing_ || finish_called_) return Action::kNone;
  if (cancelled_) {
    finish_called_ = true;
    final_status_ = grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled");
    return Action::kFinish;
  }
  if (error_) {
    // Tokens already buffered are dropped: the stream ends with the error.
    finish_called_ = true;
    final_status_ = *error_;
    if (metrics_ != nullptr) metrics_->CountError(model_, api_, final_status_.error_code());
    return Action::kFinish;
  }
  if (!pending_.empty()) {
    writing_msg_ = std::move(pending_.front());
    pending_.pop_front();
    pending_tokens_ -= writing_msg_.token_ids_size();
    writing_ = true;
    return Action::kWrite;
  }
  if (std::all_of(finished_.begin(), finished_.end(), [](bool f) { return f; })) {
    finish_called_ = true;
    final_status_ = grpc::Status::OK;
    return Action::kFinish;
  }
  return Action::kNone;
}

void GenerateRelay::Run(Action action) {
  if (action == Action::kWrite) sink_->Write(writing_msg_);
  if (action == Action::kFinish) sink_->End(final_status_);
}

void GenerateRelay::OnWriteDone(bool ok) {
  std::vector<Upstream*> resume;
  Action action;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !cancelled_) {
      // The client is gone.
      cancelled_ = true;
      for (Upstream* up : upstreams_) up->Cancel();
    }
    action = NextLocked();
    TakeResumableLocked(&resume);
  }
  for (Upstream* up : resume) up->Resume();
  Run(action);
}

void GenerateRelay::OnCancel() {
  std::vector<Upstream*> resume;
  Action action;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (Upstream* up : upstreams_) up->Cancel();
    action = NextLocked();
    TakeResumableLocked(&resume);
  }
  for (Upstream* r : resume) r->Resume();
  Run(action);
}

void GenerateRelay::TakeResumableLocked(std::vector<Upstream*>* resume) {
  // Paused readers go on once the client caught up, and always when the call is over (their
  // reads then fail fast and their streams complete).
  if (pending_tokens_ < options_.max_buffered_tokens || cancelled_ || error_ ||
      finish_called_) {
    resume->insert(resume->end(), paused_.begin(), paused_.end());
    paused_.clear();
  }
}

void GenerateRelay::OnDone() {
  in_flight_->fetch_sub(1);
  Unref();
}

void GenerateRelay::Unref() {
  bool last;
  {
    absl::MutexLock lock(&mu_);
    last = --refs_ == 0;
  }
  if (last) delete this;
}

}  // namespace kvgrid::coordinator
