#include "worker/service/registrar.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/time/time.h"
#include "auth/bearer_auth.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvgrid::worker {
namespace {

constexpr absl::Duration kRetryInterval = absl::Milliseconds(200);
constexpr auto kRpcTimeout = std::chrono::seconds(2);
// gRPC backs reconnection off up to two minutes by default: a restarted coordinator would
// wait that long for its workers. Retry about as often as the worker heartbeats instead.
constexpr int kReconnectBackoffMs = 100;
constexpr int kMaxReconnectBackoffMs = 500;

grpc::ChannelArguments CoordinatorChannelArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  return args;
}

}  // namespace

Registrar::Registrar(std::vector<std::string> coordinator_addresses, std::string token,
                     v1::RegisterWorkerRequest registration,
                     std::function<v1::KvUsage()> usage, std::function<bool()> draining,
                     const auth::ClusterChannels& channels, std::function<bool()> stalled)
    : token_(std::move(token)),
      registration_(std::move(registration)),
      usage_(std::move(usage)),
      draining_(std::move(draining)),
      stalled_(std::move(stalled)) {
  for (std::string& address : coordinator_addresses) {
    auto stub = v1::Coordinator::NewStub(channels.Create(address, CoordinatorChannelArgs()));
    links_.push_back(Link{.address = std::move(address), .stub = std::move(stub)});
  }
  {
    absl::MutexLock lock(&mu_);
    worker_ids_.resize(links_.size());
  }
  for (size_t i = 0; i < links_.size(); ++i) threads_.emplace_back([this, i] { Run(i); });
}

Registrar::~Registrar() { Stop(); }

void Registrar::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

std::string Registrar::worker_id(size_t coordinator) const {
  absl::MutexLock lock(&mu_);
  return coordinator < worker_ids_.size() ? worker_ids_[coordinator] : std::string();
}

void Registrar::Run(size_t index) {
  const Link& link = links_[index];
  std::string id;
  absl::Duration interval = kRetryInterval;
  bool warned = false;
  for (;;) {
    bool stop;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval);
      stop = stop_;
    }
    if (id.empty()) {
      if (stop) return;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
      auth::AttachBearer(&ctx, token_);
      v1::RegisterWorkerResponse resp;
      const grpc::Status s = link.stub->RegisterWorker(&ctx, registration_, &resp);
      if (!s.ok()) {
        if (!warned) {
          std::fprintf(stderr, "kvgrid-worker: cannot register with %s yet (%s); retrying\n",
                       link.address.c_str(), s.error_message().c_str());
          warned = true;
        }
        interval = kRetryInterval;
        continue;
      }
      id = resp.worker_id();
      interval = absl::Milliseconds(std::max<uint32_t>(50, resp.heartbeat_interval_ms()));
      warned = false;
      std::fprintf(stderr, "kvgrid-worker: registered with %s as %s\n", link.address.c_str(),
                   id.c_str());
      absl::MutexLock lock(&mu_);
      worker_ids_[index] = id;
      continue;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    auth::AttachBearer(&ctx, token_);
    v1::HeartbeatRequest req;
    req.set_worker_id(id);
    *req.mutable_usage() = usage_();
    req.set_draining(draining_());
    if (stalled_) req.set_stalled(stalled_());
    v1::HeartbeatResponse resp;
    const grpc::Status s = link.stub->Heartbeat(&ctx, req, &resp);
    if (stop) return;
    if (s.ok() && !resp.known()) {
      // The coordinator restarted or forgot us: register again at once, so a restarted
      // coordinator has every live worker back within one heartbeat.
      std::fprintf(stderr, "kvgrid-worker: %s no longer knows %s; registering again\n",
                   link.address.c_str(), id.c_str());
      id.clear();
      interval = absl::ZeroDuration();
      absl::MutexLock lock(&mu_);
      worker_ids_[index].clear();
    }
  }
}

}  // namespace kvgrid::worker
