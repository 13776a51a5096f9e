// The OpenAI-compatible HTTP API of the coordinator, as a handler of HttpServer: another front
// door onto the one request path. A generate request is parsed (openai_protocol.h) into
// GenerateRequests, admitted by GenerationService::Admit (draining, validation, tokenizing,
// the chat template), relayed by a GenerateRelay whose sink turns responses into OpenAI's
// JSON or SSE chunks, so placement, flow control, failover, metrics (api="http") and abort on
// disconnect are the gRPC API's.
//
//   GET  /health               200, or 503 while draining or with no live worker (no key)
//   GET  /v1/models            the served models, OpenAI's list shape
//   POST /v1/completions       prompt: string, [string], [ids], [[ids]]; stream, n, logprobs
//   POST /v1/chat/completions  messages, tools, tool_choice, chat_template_kwargs, ...
//   POST /tokenize             vLLM's: {prompt | messages} -> {count, max_model_len, tokens}
//   POST /detokenize           vLLM's: {tokens} -> {prompt}
//
// Every path but /health needs an API key (Authorization: Bearer) when the coordinator has
// them; errors are OpenAI's error body with the status of openai::HttpStatusFor.
//
// Thread-safety: Handle runs concurrently on the server's threads.
#ifndef KVGRID_COORDINATOR_OPENAI_API_H_
#define KVGRID_COORDINATOR_OPENAI_API_H_

#include <memory>

#include "auth/bearer_auth.h"
#include "coordinator/frontend.h"
#include "coordinator/http_server.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"

namespace kvgrid::coordinator {

class OpenAiApi {
 public:
  // Not owned; all must outlive every request the server passes in (the relays it starts
  // included: see GenerateRelay::NumAlive).
  OpenAiApi(GenerationService* generation, const ModelCatalog* catalog,
            const WorkerRegistry* registry, const auth::BearerAuth* api_keys);

  void Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder);

 private:
  void Generate(int endpoint, const HttpRequest& request,
                const std::shared_ptr<HttpResponder>& responder);
  void Models(const std::shared_ptr<HttpResponder>& responder);
  void Tokenize(const HttpRequest& request, const std::shared_ptr<HttpResponder>& responder);
  void Detokenize(const HttpRequest& request, const std::shared_ptr<HttpResponder>& responder);

  GenerationService* generation_;
  const ModelCatalog* catalog_;
  const WorkerRegistry* registry_;
  const auth::BearerAuth* api_keys_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_OPENAI_API_H_
