#include "worker/service/worker_service.h"

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/grpc_status.h"
#include "worker/service/convert.h"

namespace kvgrid::worker {
namespace {

// One Generate call. The engine thread pushes outputs into the shared Channel; the reactor
// writes them one message at a time, merging what queued up meanwhile (consecutive tokens of
// one continuation) into the next message. The Channel outlives the reactor when the engine
// still holds it; the reactor deletes itself in OnDone.
class GenerateStream;

class Channel final : public OutputSink {
 public:
  explicit Channel(int64_t n) : unfinished_(n) {}

  void Attach(GenerateStream* stream) {
    absl::MutexLock lock(&mu_);
    stream_ = stream;
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
  }

  void OnOutput(TokenOutput output) override;
  void OnError(absl::Status status) override;
  // Called by the reactor when its write completed; starts the next one if any.
  void OnWriteDone(bool ok);

 private:
  // Moves queued outputs into `msg` and starts a write, or finishes the call when nothing is
  // queued and the request is over. Called with mu_ held; the gRPC call happens after release
  // through the returned action.
  enum class Action { kNone, kWrite, kFinish };
  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Action action);

  absl::Mutex mu_;
  GenerateStream* stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::deque<TokenOutput> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish was called
  int64_t unfinished_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> error_ ABSL_GUARDED_BY(mu_);
};

class GenerateStream final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateStream(EngineLoop* loop, std::string request_id, std::shared_ptr<Channel> channel)
      : loop_(loop), request_id_(std::move(request_id)), channel_(std::move(channel)) {}

  v1::GenerateResponse& message() { return msg_; }
  grpc::Status& final_status() { return final_; }

  void OnWriteDone(bool ok) override { channel_->OnWriteDone(ok); }
  void OnCancel() override {
    // The coordinator went away or cancelled: free the blocks now.
    loop_->Abort(request_id_, channel_);
    channel_->OnError(absl::CancelledError("the call was cancelled"));
  }
  void OnDone() override {
    channel_->Detach();
    delete this;
  }

 private:
  EngineLoop* loop_;
  std::string request_id_;
  std::shared_ptr<Channel> channel_;
  v1::GenerateResponse msg_;  // the one write in flight
  grpc::Status final_;
};

void Channel::OnOutput(TokenOutput output) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (output.finish != FinishReason::kNone) --unfinished_;
    queue_.push_back(std::move(output));
    action = NextLocked();
  }
  Run(action);
}

void Channel::OnError(absl::Status status) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    if (!error_) error_ = std::move(status);
    action = NextLocked();
  }
  Run(action);
}

void Channel::OnWriteDone(bool ok) {
  Action action;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !error_) error_ = absl::CancelledError("the stream broke");
    action = NextLocked();
  }
  Run(action);
}

Channel::Action Channel::NextLocked() {
  if (stream_ == nullptr || writing_ || finished_) return Action::kNone;
  if (error_) {
    finished_ = true;
    stream_->final_status() = proto::ToGrpcStatus(*error_);
    return Action::kFinish;
  }
  if (queue_.empty()) {
    if (unfinished_ > 0) return Action::kNone;
    finished_ = true;
    stream_->final_status() = grpc::Status::OK;
    return Action::kFinish;
  }
  v1::GenerateResponse& msg = stream_->message();
  msg.Clear();
  const int64_t index = queue_.front().index;
  // Coalesce consecutive tokens of one continuation; a finishing token ends the message.
  while (!queue_.empty() && queue_.front().index == index) {
    const bool last = queue_.front().finish != FinishReason::kNone;
    AppendOutput(queue_.front(), &msg);
    queue_.pop_front();
    if (last) break;
  }
  writing_ = true;
  return Action::kWrite;
}

void Channel::Run(Action action) {
  // stream_ stays valid here: it is only cleared in OnDone, which gRPC runs after the
  // write or Finish started below completes.
  GenerateStream* stream;
  {
    absl::MutexLock lock(&mu_);
    stream = stream_;
  }
  if (stream == nullptr) return;
  if (action == Action::kWrite) stream->StartWrite(&stream->message());
  if (action == Action::kFinish) stream->Finish(stream->final_status());
}

}  // namespace

WorkerService::WorkerService(EngineLoop* loop, const auth::BearerAuth* cluster,
                             v1::KvCapacity capacity, int32_t max_num_seqs,
                             int64_t max_queue_depth)
    : loop_(loop),
      cluster_(cluster),
      capacity_(std::move(capacity)),
      max_num_seqs_(max_num_seqs),
      max_queue_depth_(max_queue_depth) {}

grpc::ServerWriteReactor<v1::GenerateResponse>* WorkerService::Generate(
    grpc::CallbackServerContext* context, const v1::WorkerGenerateRequest* request) {
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    auto channel = std::make_shared<Channel>(1);
    auto* stream = new GenerateStream(loop_, request->request_id(), channel);
    channel->Attach(stream);
    channel->OnError(proto::FromGrpcStatus(auth));
    return stream;
  }
  GenerationRequest req = RequestFromProto(*request);
  auto channel = std::make_shared<Channel>(req.n);
  auto* stream = new GenerateStream(loop_, req.id, channel);
  channel->Attach(stream);
  if (draining_.load()) {
    channel->OnError(absl::UnavailableError("the worker is draining"));
    return stream;
  }
  if (stalled_.load()) {
    channel->OnError(absl::UnavailableError("the worker's engine is stalled"));
    return stream;
  }
  if (const int64_t active = loop_->NumActive(); active >= max_num_seqs_ + max_queue_depth_) {
    channel->OnError(absl::ResourceExhaustedError(absl::StrCat(
        "the worker's queue is full: ", active, " requests running or waiting (--max-num-seqs ",
        max_num_seqs_, " + --max-queue-depth ", max_queue_depth_, ")")));
    return stream;
  }
  loop_->Submit(std::move(req), channel);
  return stream;
}

grpc::ServerUnaryReactor* WorkerService::Abort(grpc::CallbackServerContext* context,
                                               const v1::AbortRequest* request,
                                               v1::AbortResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  loop_->Abort(request->request_id());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* WorkerService::GetStats(grpc::CallbackServerContext* context,
                                                  const v1::GetStatsRequest* request,
                                                  v1::GetStatsResponse* response) {
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(auth);
    return reactor;
  }
  *response->mutable_capacity() = capacity_;
  *response->mutable_usage() = UsageToProto(loop_->Stats());
  response->set_max_num_seqs(max_num_seqs_);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace kvgrid::worker
