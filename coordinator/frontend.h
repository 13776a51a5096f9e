// The public Generation service (proto/kvgrid/v1/generation.proto): validates and tokenizes
// requests (rendering conversations with the chat template first), hands Generate calls to
// relays, and answers the text and status calls.
//
// Thread-safety: methods run concurrently on gRPC's threads.
#ifndef KVGRID_COORDINATOR_FRONTEND_H_
#define KVGRID_COORDINATOR_FRONTEND_H_

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"
#include "auth/bearer_auth.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "coordinator/relay.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "kvgrid/v1/worker.pb.h"

namespace kvgrid::coordinator {

class GenerationService final : public v1::Generation::CallbackService {
 public:
  // Not owned; all must outlive the service. `metrics` may be null. Every method requires
  // one of `api_keys` (UNAUTHENTICATED otherwise) when it holds any.
  GenerationService(const ModelCatalog* catalog, WorkerRegistry* registry,
                    CoordinatorMetrics* metrics, RelayOptions relay_options,
                    const auth::BearerAuth* api_keys);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* ClusterStatus(grpc::CallbackServerContext* context,
                                          const v1::ClusterStatusRequest* request,
                                          v1::ClusterStatusResponse* response) override;

  // Draining: new Generate calls get UNAVAILABLE; running ones go on.
  void SetDraining(bool draining) { draining_.store(draining); }
  // Generate calls still open.
  [[nodiscard]] int64_t InFlight() const { return in_flight_.load(); }

  // The worker request for a public one: model resolved, prompt tokenized (BOS on request)
  // or messages rendered with the model's chat template and tokenized (chat_request.h; the
  // end-of-turn token then also stops), generation defaults applied. Errors:
  // INVALID_ARGUMENT naming the field (also for a model without a chat template, and with
  // the template's message when it raises); NOT_FOUND for an unknown model.
  absl::StatusOr<v1::WorkerGenerateRequest> Prepare(const v1::GenerateRequest& request,
                                                    const ServedModel** model) const;

 private:
  // A reactor finished with UNAUTHENTICATED when the call carries no accepted API key, else
  // null.
  grpc::ServerUnaryReactor* RefuseUnauthenticated(grpc::CallbackServerContext* context) const;

  const ModelCatalog* catalog_;
  WorkerRegistry* registry_;
  CoordinatorMetrics* metrics_;
  RelayOptions relay_options_;
  const auth::BearerAuth* api_keys_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> next_id_{1};
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_FRONTEND_H_
