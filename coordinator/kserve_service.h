// KServe v2 / Triton's GRPCInferenceService on the coordinator's API port (proto/inference):
// another front door onto the one request path. A ModelInfer or ModelStreamInfer request is
// parsed (kserve_protocol.h) into a GenerateRequest, admitted by GenerationService::Admit
// (draining, validation, tokenizing), and relayed by a GenerateRelay whose sink turns the
// responses into ModelInferResponses, so placement, flow control, failover, metrics
// (api="kserve_grpc") and abort on cancel are the Generation API's.
//
// KServeApi is what the gRPC service and the HTTP routes (kserve_http.h) share: model lookup,
// readiness, metadata and configuration, admission of a parsed call, and the per-model
// statistics of ModelStatistics.
//
// Every method but ServerLive and ServerReady (probes) needs an API key when the coordinator
// has them. ModelInfer and ModelStreamInfer are registered raw and parse their own requests,
// so a string that is not UTF-8 is INVALID_ARGUMENT naming the field.
//
// Thread-safety: methods run concurrently on gRPC's threads.
#ifndef KVGRID_COORDINATOR_KSERVE_SERVICE_H_
#define KVGRID_COORDINATOR_KSERVE_SERVICE_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "auth/bearer_auth.h"
#include "coordinator/frontend.h"
#include "coordinator/kserve_protocol.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "inference/grpc_service.grpc.pb.h"

namespace kvgrid::coordinator {

class KServeApi {
 public:
  // Not owned; all must outlive the api and every request it admitted.
  KServeApi(GenerationService* generation, const ModelCatalog* catalog,
            const WorkerRegistry* registry);

  // Not draining, and a live worker serves some model.
  [[nodiscard]] bool ServerReady() const;
  // The served model `name` ("": the only one) at `version` ("" or "1"). Errors: NOT_FOUND
  // naming the model or the version; INVALID_ARGUMENT for "" with several models.
  absl::StatusOr<const ServedModel*> FindModel(const std::string& name,
                                               const std::string& version) const;
  // A live worker serves `model`.
  [[nodiscard]] bool ModelReady(const ServedModel& model) const;
  [[nodiscard]] inference::ModelMetadataResponse Metadata(const ServedModel& model) const;
  [[nodiscard]] inference::ModelConfig Config(const ServedModel& model) const;
  // Statistics of `name` ("": every model). Errors: as FindModel.
  absl::StatusOr<inference::ModelStatisticsResponse> Statistics(const std::string& name,
                                                                const std::string& version) const;

  // A parsed call for the door `api`: its model resolved, bad words turned into logit biases,
  // then GenerationService::Admit (the prompt tokenized with the tokenizer's special tokens, as
  // the vLLM backend does; a sequence beyond the context refused). Counts the request in the
  // statistics. Errors: as FindModel; INVALID_ARGUMENT naming bad_words for a word that is not
  // one token; as Admit.
  absl::StatusOr<GenerationService::Admitted> Admit(kserve::GenerateCall& call,
                                                    const std::string& api);
  // A request's end, for ModelStatistics: `ok`, its time since `arrival`, and how long it
  // waited for placement.
  void Finished(const std::string& model, bool ok, std::chrono::steady_clock::time_point arrival,
                double queued_s);

  [[nodiscard]] GenerationService* generation() const { return generation_; }

 private:
  struct Counters {
    uint64_t inference_count = 0;
    uint64_t last_inference_ms = 0;
    uint64_t success_count = 0;
    uint64_t success_ns = 0;
    uint64_t fail_count = 0;
    uint64_t fail_ns = 0;
    uint64_t queue_count = 0;
    uint64_t queue_ns = 0;
  };

  GenerationService* const generation_;
  const ModelCatalog* const catalog_;
  const WorkerRegistry* const registry_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Counters> counters_ ABSL_GUARDED_BY(mu_);
};

// Every method a callback one; built on the synchronous base because the raw bidirectional
// method's signature differs from the typed one only in its return type.
using KServeGrpc = inference::GRPCInferenceService;
using KServeServiceBase = KServeGrpc::WithCallbackMethod_ServerLive<
    KServeGrpc::WithCallbackMethod_ServerReady<KServeGrpc::WithCallbackMethod_ModelReady<
        KServeGrpc::WithCallbackMethod_ServerMetadata<KServeGrpc::WithCallbackMethod_ModelMetadata<
            KServeGrpc::WithCallbackMethod_ModelConfig<KServeGrpc::WithCallbackMethod_ModelStatistics<
                KServeGrpc::WithRawCallbackMethod_ModelInfer<
                    KServeGrpc::WithRawCallbackMethod_ModelStreamInfer<KServeGrpc::Service>>>>>>>>>;

class KServeService final : public KServeServiceBase {
 public:
  // Not owned; both must outlive the service and its calls.
  KServeService(KServeApi* api, const auth::BearerAuth* api_keys);

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(
      grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
      inference::ModelStatisticsResponse* response) override;
  // Raw forms of ModelInfer and ModelStreamInfer.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;

 private:
  grpc::ServerUnaryReactor* RefuseUnauthenticated(grpc::CallbackServerContext* context) const {
    return coordinator::RefuseUnauthenticated(*api_keys_, context);
  }

  KServeApi* const api_;
  const auth::BearerAuth* const api_keys_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_KSERVE_SERVICE_H_
