#include "worker/comm/coordinator_store.h"

#include <stdexcept>
#include <thread>

#include "absl/strings/str_cat.h"
#include "auth/bearer_auth.h"
#include "grpcpp/create_channel.h"

namespace kvgrid::worker {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(10);
constexpr auto kRpcTimeout = std::chrono::seconds(5);

}  // namespace

CoordinatorStore::CoordinatorStore(const std::string& coordinator_address, std::string token,
                                   const std::string& group_id,
                                   std::chrono::milliseconds timeout,
                                   const auth::ClusterChannels& channels)
    : stub_(v1::Coordinator::NewStub(channels.Create(coordinator_address))),
      token_(std::move(token)),
      prefix_(absl::StrCat("group/", group_id, "/")),
      timeout_(timeout) {}

void CoordinatorStore::set(const std::string& key, const std::vector<char>& data) {
  // The coordinator may not be up yet when a group starts: retry until the timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    auth::AttachBearer(&ctx, token_);
    v1::StoreSetRequest req;
    req.set_key(prefix_ + key);
    req.set_value(std::string(data.begin(), data.end()));
    v1::StoreSetResponse resp;
    const grpc::Status s = stub_->StoreSet(&ctx, req, &resp);
    if (s.ok()) return;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
        std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(absl::StrCat("store set '", key, "': code ", static_cast<int>(s.error_code()), " ", s.error_message()));
    }
    std::this_thread::sleep_for(kPollInterval * 10);
  }
}

bool CoordinatorStore::TryGet(const std::string& key, std::vector<char>* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
  auth::AttachBearer(&ctx, token_);
  v1::StoreGetRequest req;
  req.set_key(prefix_ + key);
  v1::StoreGetResponse resp;
  const grpc::Status s = stub_->StoreGet(&ctx, req, &resp);
  if (!s.ok()) {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return false;  // retried by callers
    throw std::runtime_error(absl::StrCat("store get '", key, "': ", s.error_message()));
  }
  if (!resp.found()) return false;
  out->assign(resp.value().begin(), resp.value().end());
  return true;
}

std::vector<char> CoordinatorStore::get(const std::string& key) {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::vector<char> value;
  while (!TryGet(key, &value)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(absl::StrCat("store get '", key, "': no rank set it within ",
                                            timeout_.count(), " ms"));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  return value;
}

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<char> unused;
  for (const std::string& key : keys) {
    while (!TryGet(key, &unused)) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error(absl::StrCat("store wait '", key, "': no rank set it within ",
                                              timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(kPollInterval);
    }
  }
}

}  // namespace kvgrid::worker
