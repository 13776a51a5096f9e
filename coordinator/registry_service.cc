#include "coordinator/registry_service.h"

#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace kvgrid::coordinator {

RegistryService::RegistryService(WorkerRegistry* registry, const ModelCatalog* catalog,
                                 const auth::BearerAuth* cluster, std::function<void()> on_change)
    : registry_(registry), catalog_(catalog), cluster_(cluster), on_change_(std::move(on_change)) {}

grpc::ServerUnaryReactor* RegistryService::RegisterWorker(
    grpc::CallbackServerContext* context, const v1::RegisterWorkerRequest* request,
    v1::RegisterWorkerResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto fail = [reactor](std::string message) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(message)));
    return reactor;
  };
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  if (request->address().empty()) return fail("address: must be set");
  // Placement matches names exactly: a worker without one could register but never serve.
  if (request->model().empty()) return fail("model: must be set");
  absl::StatusOr<const ServedModel*> model = catalog_->Find(request->model());
  if (!model.ok()) return fail(std::string(model.status().message()));
  if (request->vocab_size() != (*model)->config.vocab_size) {
    return fail(absl::StrCat("vocab_size: the worker's model has ", request->vocab_size(),
                             " tokens, the coordinator's '", (*model)->name, "' has ",
                             (*model)->config.vocab_size));
  }
  if (request->capacity().block_size() <= 0 || request->capacity().blocks_total() <= 0) {
    return fail("capacity: block_size and blocks_total must be > 0");
  }
  // The group formed (its leader registers after the rendezvous): its keys are spent.
  store_.ErasePrefix(absl::StrCat("group/", request->group_id(), "/"));
  response->set_worker_id(registry_->Register(*request));
  response->set_heartbeat_interval_ms(static_cast<uint32_t>(
      absl::ToInt64Milliseconds(registry_->options().heartbeat_interval)));
  std::fprintf(stderr, "kvgrid-coordinator: worker %s at %s (model %s, %d blocks)\n",
               response->worker_id().c_str(), request->address().c_str(),
               request->model().c_str(), request->capacity().blocks_total());
  if (on_change_) on_change_();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::Heartbeat(grpc::CallbackServerContext* context,
                                                     const v1::HeartbeatRequest* request,
                                                     v1::HeartbeatResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  response->set_known(registry_->Heartbeat(*request));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::StoreSet(grpc::CallbackServerContext* context,
                                                    const v1::StoreSetRequest* request,
                                                    v1::StoreSetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  // A group's rank 0 starts each attempt to form it by publishing "group/<id>/attempt"
  // (worker/comm/gloo_communicator.cc): what the group's earlier attempts left is spent, and
  // would otherwise pile up while a group keeps failing to form.
  const std::string& key = request->key();
  constexpr std::string_view kAttempt = "/attempt";
  // (A retried set of the same attempt erases nothing: acknowledgements may already be in.)
  if (key.starts_with("group/") && key.ends_with(kAttempt) &&
      key.find('/', 6) == key.size() - kAttempt.size() &&
      store_.Get(key) != std::optional<std::string>(request->value())) {
    store_.ErasePrefix(key.substr(0, key.size() - kAttempt.size() + 1));
  }
  const absl::Status s = store_.Set(key, request->value());
  reactor->Finish(s.ok() ? grpc::Status::OK
                         : grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                                        std::string(s.message())));
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::StoreGet(grpc::CallbackServerContext* context,
                                                    const v1::StoreGetRequest* request,
                                                    v1::StoreGetResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status auth = cluster_->Check(*context); !auth.ok()) {
    reactor->Finish(auth);
    return reactor;
  }
  if (std::optional<std::string> v = store_.Get(request->key())) {
    response->set_found(true);
    response->set_value(*std::move(v));
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace kvgrid::coordinator
