// The Coordinator gRPC service workers call (proto/kvgrid/v1/worker.proto): registration and
// heartbeats into the WorkerRegistry.
//
// Thread-safety: methods run concurrently on gRPC's threads; the registry synchronizes.
#ifndef KVGRID_COORDINATOR_REGISTRY_SERVICE_H_
#define KVGRID_COORDINATOR_REGISTRY_SERVICE_H_

#include <functional>

#include "auth/bearer_auth.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "coordinator/rendezvous_store.h"
#include "kvgrid/v1/worker.grpc.pb.h"

namespace kvgrid::coordinator {

class RegistryService final : public v1::Coordinator::CallbackService {
 public:
  // `registry`, `catalog` and `cluster` are not owned and must outlive the service.
  // `on_change` runs after a registration (e.g. to update health). When `cluster` holds a
  // token, callers must present it (UNAUTHENTICATED otherwise): only workers hold it.
  RegistryService(WorkerRegistry* registry, const ModelCatalog* catalog,
                  const auth::BearerAuth* cluster, std::function<void()> on_change);

  grpc::ServerUnaryReactor* StoreSet(grpc::CallbackServerContext* context,
                                     const v1::StoreSetRequest* request,
                                     v1::StoreSetResponse* response) override;
  grpc::ServerUnaryReactor* StoreGet(grpc::CallbackServerContext* context,
                                     const v1::StoreGetRequest* request,
                                     v1::StoreGetResponse* response) override;

  // Errors: INVALID_ARGUMENT for a missing address, a model this coordinator does not serve,
  // or a vocabulary size that disagrees with the coordinator's config.json.
  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* context,
                                           const v1::RegisterWorkerRequest* request,
                                           v1::RegisterWorkerResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;

 private:
  WorkerRegistry* registry_;
  const ModelCatalog* catalog_;
  const auth::BearerAuth* cluster_;
  std::function<void()> on_change_;
  RendezvousStore store_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_REGISTRY_SERVICE_H_
