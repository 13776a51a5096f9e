// The HTTP side of KServe v2 on the coordinator's HTTP server, beside the OpenAI API: health,
// server and model metadata, and Triton's generate extension. A generate request is parsed by
// kserve::ParseGenerateBody and admitted and relayed like every other (KServeApi::Admit,
// GenerateRelay; metrics api="kserve_http"), abort on disconnect included.
//
//   GET  /v2/health/live                  200 while the process runs (no key)
//   GET  /v2/health/ready                 200, or 503 while draining or with no live worker
//   GET  /v2                              server metadata
//   GET  /v2/models/{name}[/versions/1]   model metadata (inputs, outputs)
//   GET  .../ready                        200 when a live worker serves the model, else 503
//   GET  .../config                       the model configuration (protobuf JSON, as Triton)
//   GET  .../stats, /v2/models/stats      ModelStatistics as JSON
//   POST .../generate                     {"text_input", "parameters": {...}, inputs by name}
//                                         -> {"model_name", "model_version", "text_output"}
//   POST .../generate_stream              the same as SSE, one event per chunk of new text
//
// Errors are {"error": message} with the status of openai::HttpStatusFor; after a stream
// began, a data: event {"error": ...} ends it. Every path but /v2/health/* needs an API key
// when the coordinator has them.
//
// Thread-safety: Handle runs concurrently on the server's threads.
#ifndef KVGRID_COORDINATOR_KSERVE_HTTP_H_
#define KVGRID_COORDINATOR_KSERVE_HTTP_H_

#include <memory>
#include <string>

#include "auth/bearer_auth.h"
#include "coordinator/http_server.h"
#include "coordinator/kserve_service.h"

namespace kvgrid::coordinator {

class KServeHttp {
 public:
  // Not owned; both must outlive every request the server passes in.
  KServeHttp(KServeApi* api, const auth::BearerAuth* api_keys);

  // Whether `path` is one of these routes' (/v2 and below).
  static bool Serves(const std::string& path);
  void Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder);

 private:
  void Generate(const ServedModel& model, const HttpRequest& request, bool stream,
                const std::shared_ptr<HttpResponder>& responder);

  KServeApi* const api_;
  const auth::BearerAuth* const api_keys_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_KSERVE_HTTP_H_
