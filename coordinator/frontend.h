// The public Generation service (proto/kvgrid/v1/generation.proto): validates and tokenizes
// requests (rendering conversations with the chat template first), hands Generate calls to
// relays, and answers the text and status calls. Admit and NewRelay are the one request path
// behind every front door: the gRPC Generate call and the OpenAI HTTP API (http_api.h) both
// go through them.
//
// Thread-safety: methods run concurrently on gRPC's threads.
#ifndef KVGRID_COORDINATOR_FRONTEND_H_
#define KVGRID_COORDINATOR_FRONTEND_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "auth/bearer_auth.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "coordinator/relay.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "kvgrid/v1/worker.pb.h"

namespace kvgrid::coordinator {

// How a front door wants a request's length handled (the gRPC API's defaults are these
// false: max_new_tokens defaults to 16, and a sequence that reaches the context ends there).
struct AdmitOptions {
  // An unset max_new_tokens becomes what the context has left after the prompt (as OpenAI's
  // chat API and vLLM default max_tokens).
  bool max_new_tokens_fills_context = false;
  // A prompt plus max_new_tokens beyond the model's context is INVALID_ARGUMENT with the
  // numbers (as vLLM refuses it), instead of ending at the context.
  bool refuse_beyond_context = false;
};

// A unary reactor finished with UNAUTHENTICATED when `context` carries no key `keys` accepts
// (none needed when `keys` holds none), else null.
grpc::ServerUnaryReactor* RefuseUnauthenticated(const auth::BearerAuth& keys,
                                                grpc::CallbackServerContext* context);

// Generate, Tokenize and Detokenize are registered raw and parse their own requests
// (request_parse.h), so a string that is not UTF-8 is answered INVALID_ARGUMENT naming the
// field rather than gRPC's bare UNIMPLEMENTED.
using GenerationServiceBase = v1::Generation::WithRawCallbackMethod_Generate<
    v1::Generation::WithRawCallbackMethod_Tokenize<
        v1::Generation::WithRawCallbackMethod_Detokenize<v1::Generation::CallbackService>>>;

class GenerationService final : public GenerationServiceBase {
 public:
  // A request that passed Admit: what its relay sends to workers, for which model, and the
  // client's request id (assigned when the request had none).
  struct Admitted {
    v1::WorkerGenerateRequest request;
    const ServedModel* model = nullptr;
    std::string request_id;
  };

  // Not owned; all must outlive the service. `metrics` may be null. Every method requires
  // one of `api_keys` (UNAUTHENTICATED otherwise) when it holds any.
  GenerationService(const ModelCatalog* catalog, WorkerRegistry* registry,
                    CoordinatorMetrics* metrics, RelayOptions relay_options,
                    const auth::BearerAuth* api_keys);

  // Raw (wire bytes in and out) forms of the typed calls below.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* ClusterStatus(grpc::CallbackServerContext* context,
                                          const v1::ClusterStatusRequest* request,
                                          v1::ClusterStatusResponse* response) override;

  // Draining: new Generate calls get UNAVAILABLE; running ones go on.
  void SetDraining(bool draining) { draining_.store(draining); }
  [[nodiscard]] bool draining() const { return draining_.load(); }
  // Generate calls still open, on every front door.
  [[nodiscard]] int64_t InFlight() const { return in_flight_.load(); }

  // A generate request from any front door (the caller has checked its credentials): refused
  // while draining, else prepared (Prepare, then `options`). Errors, counted in the request
  // error metrics under `api`: UNAVAILABLE while draining; as Prepare; INVALID_ARGUMENT for
  // a sequence beyond the context when options say so.
  absl::StatusOr<Admitted> Admit(const v1::GenerateRequest& request, const std::string& api,
                                 const AdmitOptions& options = {}) const;
  // The relay of an admitted request, writing to `sink` (see RelaySink), labelled `api` in the
  // metrics; the caller calls Start() on it once the sink takes calls. The relay deletes
  // itself (GenerateRelay's lifetime).
  GenerateRelay* NewRelay(Admitted admitted, RelaySink* sink,
                          std::chrono::system_clock::time_point deadline,
                          const std::string& api);
  // Counts a request refused by a front door before Admit (credentials, a malformed body), in
  // the error metrics with no model: a caller's strings never become label values.
  void CountRefused(const std::string& api, grpc::StatusCode code) const {
    if (metrics_ != nullptr) metrics_->CountError("", api, code);
  }

  // The worker request for a public one: model resolved, prompt tokenized (BOS on request)
  // or messages rendered with the model's chat template and tokenized (chat_request.h; the
  // end-of-turn token then also stops), generation defaults applied. Errors:
  // INVALID_ARGUMENT naming the field (also for a model without a chat template, and with
  // the template's message when it raises); NOT_FOUND for an unknown model.
  absl::StatusOr<v1::WorkerGenerateRequest> Prepare(const v1::GenerateRequest& request,
                                                    const ServedModel** model) const;

 private:
  grpc::ServerUnaryReactor* RefuseUnauthenticated(grpc::CallbackServerContext* context) const {
    return coordinator::RefuseUnauthenticated(*api_keys_, context);
  }

  const ModelCatalog* catalog_;
  WorkerRegistry* registry_;
  CoordinatorMetrics* metrics_;
  RelayOptions relay_options_;
  const auth::BearerAuth* api_keys_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> in_flight_{0};
  mutable std::atomic<int64_t> next_id_{1};
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_FRONTEND_H_
