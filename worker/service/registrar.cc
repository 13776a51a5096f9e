#include "worker/service/registrar.h"

#include <chrono>
#include <cstdio>
#include <utility>

#include "absl/time/time.h"
#include "auth/bearer_auth.h"
#include "grpcpp/create_channel.h"

namespace kvgrid::worker {
namespace {

constexpr absl::Duration kRetryInterval = absl::Milliseconds(200);
constexpr auto kRpcTimeout = std::chrono::seconds(2);

}  // namespace

Registrar::Registrar(std::string coordinator_address, std::string token,
                     v1::RegisterWorkerRequest registration,
                     std::function<v1::KvUsage()> usage, std::function<bool()> draining,
                     const auth::ClusterChannels& channels)
    : stub_(v1::Coordinator::NewStub(channels.Create(coordinator_address))),
      token_(std::move(token)),
      registration_(std::move(registration)),
      usage_(std::move(usage)),
      draining_(std::move(draining)) {
  thread_ = std::thread([this] { Run(); });
}

Registrar::~Registrar() { Stop(); }

void Registrar::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::string Registrar::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void Registrar::Run() {
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
      const grpc::Status s = stub_->RegisterWorker(&ctx, registration_, &resp);
      if (!s.ok()) {
        if (!warned) {
          std::fprintf(stderr, "kvgrid-worker: cannot register yet (%s); retrying\n",
                       s.error_message().c_str());
          warned = true;
        }
        interval = kRetryInterval;
        continue;
      }
      id = resp.worker_id();
      interval = absl::Milliseconds(std::max<uint32_t>(50, resp.heartbeat_interval_ms()));
      warned = false;
      std::fprintf(stderr, "kvgrid-worker: registered as %s\n", id.c_str());
      absl::MutexLock lock(&mu_);
      worker_id_ = id;
      continue;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    auth::AttachBearer(&ctx, token_);
    v1::HeartbeatRequest req;
    req.set_worker_id(id);
    *req.mutable_usage() = usage_();
    req.set_draining(draining_());
    v1::HeartbeatResponse resp;
    const grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
    if (stop) return;
    if (s.ok() && !resp.known()) {
      id.clear();  // the coordinator forgot us: register again
      interval = absl::ZeroDuration();
    }
  }
}

}  // namespace kvgrid::worker
