#include "coordinator/openai_api.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "coordinator/chat_request.h"
#include "coordinator/openai_protocol.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"

namespace kvgrid::coordinator {
namespace {

using Json = nlohmann::json;
constexpr char kJson[] = "application/json";
constexpr char kApi[] = "http";

void RespondError(HttpResponder& responder, const absl::Status& status) {
  responder.Respond(openai::HttpStatusFor(status.code()), kJson, openai::ErrorBody(status));
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A response id no other response of this process has: a random prefix per process and a
// counter.
std::string ResponseId(openai::Endpoint endpoint) {
  static const uint64_t prefix = std::random_device{}();
  static std::atomic<uint64_t> next{1};
  return absl::StrCat(endpoint == openai::Endpoint::kChat ? "chatcmpl-" : "cmpl-",
                      absl::Hex(prefix & 0xffffffff, absl::kZeroPad8), absl::Hex(next.fetch_add(1)));
}

openai::TokenText TokenTextOf(const ServedModel& model) {
  openai::TokenText t;
  if (!model.tokenizer) return t;
  const model::Tokenizer* tok = model.tokenizer.get();
  // A token's text as part of the completion, which continues the prompt: a SentencePiece
  // "▁the" is " the" (Decode alone strips that first space), so the tokens add up to the text.
  auto continued = [tok](int32_t id) -> absl::StatusOr<std::string> {
    model::IncrementalDetokenizer d(tok, /*skip_special_tokens=*/false, /*continues_text=*/true);
    absl::StatusOr<std::string> text = d.Push(id);
    if (!text.ok()) return text.status();
    return *text + d.Finish();
  };
  t.text = [continued](int32_t id) {
    absl::StatusOr<std::string> s = continued(id);
    return s.ok() ? *std::move(s) : absl::StrCat("token_id:", id);
  };
  t.bytes = [tok, continued](int32_t id) -> std::optional<std::string> {
    const int32_t ids[1] = {id};
    absl::StatusOr<std::string> s = tok->DecodeBytes(ids, /*skip_special_tokens=*/false);
    if (!s.ok()) return std::nullopt;
    // What continuing adds in front (the space a first token loses), then the bytes.
    absl::StatusOr<std::string> alone = tok->Decode(ids, /*skip_special_tokens=*/false);
    absl::StatusOr<std::string> text = continued(id);
    if (alone.ok() && text.ok() && text->size() > alone->size() && text->ends_with(*alone)) {
      return text->substr(0, text->size() - alone->size()) + *s;
    }
    return *std::move(s);
  };
  return t;
}

// One generate request over HTTP: one relay per prompt, each writing to a Part; the call
// gathers their responses into OpenAI's JSON (or SSE chunks) on the connection's strand.
//
// Lifetime: the call keeps itself alive (self_) until every relay ended; relays call their
// Part only until they end.
class CompletionCall : public std::enable_shared_from_this<CompletionCall> {
 public:
  CompletionCall(openai::GenerateCall call, std::shared_ptr<HttpResponder> responder,
                 const ServedModel* model)
      : call_(std::move(call)), responder_(std::move(responder)), tokens_(TokenTextOf(*model)) {
    header_.id = ResponseId(call_.endpoint);
    header_.created = static_cast<int64_t>(std::time(nullptr));
    header_.model = model->name;
  }

  // Starts the relays of `admitted` (one per prompt, in prompt order).
  void Start(GenerationService* generation, std::vector<GenerationService::Admitted> admitted) {
    self_ = shared_from_this();
    const size_t k = admitted.size();
    choices_.resize(k * call_.n);
    for (size_t i = 0; i < choices_.size(); ++i) choices_[i].index = static_cast<uint32_t>(i);
    parts_.resize(k);
    usage_.resize(k);
    for (size_t i = 0; i < k; ++i) {
      parts_[i] = std::make_unique<Part>(this, i);
      parts_[i]->relay = generation->NewRelay(std::move(admitted[i]), parts_[i].get(),
                                              std::chrono::system_clock::time_point::max(), kApi);
    }
    // Registered before any relay starts, so that a disconnect always reaches them.
    responder_->OnClientGone([self = shared_from_this()] { self->OnGone(); });
    responder_->Post([self = shared_from_this()] {
      // A client already gone cancelled the relays (OnGone), which end without starting.
      if (self->gone_) return;
      for (auto& p : self->parts_) p->relay->Start();
    });
  }

 private:
  struct Part final : RelaySink {
    Part(CompletionCall* call, size_t k) : call(call), k(k) {}
    void Write(const v1::GenerateResponse& msg) override {
      call->responder_->Post([self = call->shared_from_this(), this, msg] {
        self->OnMessage(*this, msg);
      });
    }
    void End(const grpc::Status& status) override {
      call->responder_->Post([self = call->shared_from_this(), this, status] {
        self->OnEnd(*this, status);
      });
    }
    CompletionCall* call;
    size_t k;
    GenerateRelay* relay = nullptr;
    bool done = false;  // its relay ended and was told OnDone
  };

  struct PartUsage {
    int64_t prompt_tokens = 0;
    int64_t cached_tokens = 0;
  };

  void OnMessage(Part& part, const v1::GenerateResponse& msg) {
    const uint32_t index = static_cast<uint32_t>(part.k * call_.n + msg.index());
    if (msg.index() >= call_.n) {
      part.relay->OnWriteDone(true);
      return;
    }
    openai::Choice& c = choices_[index];
    const int64_t offset = static_cast<int64_t>(c.text.size());
    c.text += msg.text();
    c.num_tokens += msg.token_ids_size();
    if (call_.logprobs) c.logprobs.insert(c.logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      c.finish_reason = msg.finish_reason();
      PartUsage& u = usage_[part.k];
      u.prompt_tokens = std::max<int64_t>(u.prompt_tokens, msg.usage().prompt_tokens());
      u.cached_tokens = std::max<int64_t>(u.cached_tokens, msg.usage().cached_prompt_tokens());
    }
    if (!call_.stream || gone_) {
      part.relay->OnWriteDone(!gone_);
      return;
    }
    if (!head_sent_) {
      head_sent_ = true;
      responder_->StartStream(200, "text/event-stream; charset=utf-8");
    }
    std::string out;
    if (call_.endpoint == openai::Endpoint::kChat && !started_.contains(index)) {
      started_.insert(index);
      out = openai::ChunkEvent(call_, header_, index, /*first=*/true, "", {},
                               v1::FINISH_REASON_UNSPECIFIED, tokens_, 0);
    }
    if (!msg.text().empty() || msg.logprobs_size() > 0 ||
        msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      const std::vector<v1::TokenLogprob> lps(msg.logprobs().begin(), msg.logprobs().end());
      out += openai::ChunkEvent(call_, header_, index, /*first=*/false, msg.text(),
                                call_.logprobs ? lps : std::vector<v1::TokenLogprob>{},
                                msg.finish_reason(), tokens_, offset);
    }
    if (out.empty()) {
      part.relay->OnWriteDone(true);
      return;
    }
    responder_->WriteChunk(std::move(out), [self = shared_from_this(), &part](bool ok) {
      part.relay->OnWriteDone(ok);
    });
  }

  void OnEnd(Part& part, const grpc::Status& status) {
    part.done = true;
    part.relay->OnDone();
    ++ended_;
    if (!status.ok()) {
      const absl::Status s = proto::FromGrpcStatus(status);
      // A part cancelled because another failed reports that one's error.
      if (!error_ || (error_->code() == absl::StatusCode::kCancelled &&
                      s.code() != absl::StatusCode::kCancelled)) {
        error_ = s;
      }
      for (auto& p : parts_) {
        if (!p->done) p->relay->OnCancel();
      }
    }
    if (ended_ == parts_.size()) Finish();
  }

  void OnGone() {
    gone_ = true;
    for (auto& p : parts_) {
      if (!p->done) p->relay->OnCancel();
    }
  }

  openai::Usage TotalUsage() const {
    openai::Usage u;
    for (const PartUsage& p : usage_) {
      u.prompt_tokens += p.prompt_tokens;
      u.cached_tokens += p.cached_tokens;
    }
    for (const openai::Choice& c : choices_) u.completion_tokens += c.num_tokens;
    return u;
  }

  void Finish() {
    if (error_) {
      if (head_sent_) {
        std::string out = openai::ErrorEvent(*error_);
        out += openai::kDoneEvent;
        responder_->WriteChunk(std::move(out), nullptr);
        responder_->EndStream();
      } else {
        RespondError(*responder_, *error_);
      }
    } else if (call_.stream) {
      if (!head_sent_) responder_->StartStream(200, "text/event-stream; charset=utf-8");
      std::string out;
      if (call_.include_usage) out = openai::UsageEvent(call_, header_, TotalUsage());
      out += openai::kDoneEvent;
      responder_->WriteChunk(std::move(out), nullptr);
      responder_->EndStream();
    } else {
      responder_->Respond(200, kJson,
                          openai::CompletionResponse(call_, header_, choices_, TotalUsage(), tokens_));
    }
    self_.reset();
  }

  const openai::GenerateCall call_;
  const std::shared_ptr<HttpResponder> responder_;
  const openai::TokenText tokens_;
  openai::ResponseHeader header_;
  std::shared_ptr<CompletionCall> self_;
  // On the strand, from here on.
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<openai::Choice> choices_;
  std::vector<PartUsage> usage_;
  absl::flat_hash_set<uint32_t> started_;  // chat choices whose role chunk was sent
  size_t ended_ = 0;
  bool head_sent_ = false;
  bool gone_ = false;
  std::optional<absl::Status> error_;
};

}  // namespace

OpenAiApi::OpenAiApi(GenerationService* generation, const ModelCatalog* catalog,
                     const WorkerRegistry* registry, const auth::BearerAuth* api_keys)
    : generation_(generation), catalog_(catalog), registry_(registry), api_keys_(api_keys) {}

void OpenAiApi::Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder) {
  const std::string& path = request.path;
  if (path == "/health") {
    bool live = false;
    for (const auto& m : catalog_->models()) live = live || registry_->NumLive(m->name) > 0;
    if (generation_->draining()) {
      responder->Respond(503, kJson, openai::ErrorBody(503, "the coordinator is draining"));
    } else if (!live) {
      responder->Respond(503, kJson, openai::ErrorBody(503, "no live worker"));
    } else {
      responder->Respond(200, kJson, "{}");
    }
    return;
  }
  struct Route {
    const char* path;
    const char* method;
  };
  static constexpr Route kRoutes[] = {{"/v1/models", "GET"},
                                      {"/v1/completions", "POST"},
                                      {"/v1/chat/completions", "POST"},
                                      {"/tokenize", "POST"},
                                      {"/detokenize", "POST"}};
  const Route* route = nullptr;
  for (const Route& r : kRoutes) {
    if (path == r.path) route = &r;
  }
  if (route == nullptr) {
    responder->Respond(404, kJson, openai::ErrorBody(404, absl::StrCat("no route ", path)));
    return;
  }
  if (request.method != route->method) {
    responder->Respond(405, kJson,
                       openai::ErrorBody(405, absl::StrCat(path, " takes ", route->method)));
    return;
  }
  const grpc::Status auth = api_keys_->CheckHeader(
      request.authorization.empty() ? std::nullopt
                                    : std::optional<std::string_view>(request.authorization));
  if (!auth.ok()) {
    generation_->CountRefused(kApi, auth.error_code());
    RespondError(*responder, proto::FromGrpcStatus(auth));
    return;
  }
  if (path == "/v1/models") return Models(responder);
  if (path == "/v1/completions") {
    return Generate(static_cast<int>(openai::Endpoint::kCompletions), request, responder);
  }
  if (path == "/v1/chat/completions") {
    return Generate(static_cast<int>(openai::Endpoint::kChat), request, responder);
  }
  if (path == "/tokenize") return Tokenize(request, responder);
  return Detokenize(request, responder);
}

void OpenAiApi::Generate(int endpoint_int, const HttpRequest& request,
                         const std::shared_ptr<HttpResponder>& responder) {
  const auto endpoint = static_cast<openai::Endpoint>(endpoint_int);
  absl::StatusOr<openai::GenerateCall> call = openai::ParseGenerateCall(endpoint, request.body);
  if (!call.ok()) {
    generation_->CountRefused(kApi, proto::ToGrpcStatus(call.status()).error_code());
    RespondError(*responder, call.status());
    return;
  }
  AdmitOptions options;
  // As vLLM: chat's max_tokens defaults to what the context leaves, completions' to 16.
  options.max_new_tokens_fills_context = endpoint == openai::Endpoint::kChat;
  options.refuse_beyond_context = true;
  if (endpoint == openai::Endpoint::kCompletions && call->add_special_tokens) {
    // As vLLM tokenizes a completion's text prompt: with the post-processor's tokens.
    for (v1::GenerateRequest& r : call->requests) {
      if (!r.prompt().empty()) r.set_add_special_tokens(true);
    }
  }
  std::vector<GenerationService::Admitted> admitted;
  for (const v1::GenerateRequest& r : call->requests) {
    absl::StatusOr<GenerationService::Admitted> a = generation_->Admit(r, kApi, options);
    if (!a.ok()) {
      RespondError(*responder, a.status());
      return;
    }
    admitted.push_back(*std::move(a));
  }
  const ServedModel* model = admitted.front().model;
  auto completion = std::make_shared<CompletionCall>(*std::move(call), responder, model);
  completion->Start(generation_, std::move(admitted));
}

void OpenAiApi::Models(const std::shared_ptr<HttpResponder>& responder) {
  Json data = Json::array();
  for (const auto& m : catalog_->models()) {
    data.push_back(Json{{"id", m->name},
                        {"object", "model"},
                        {"created", 0},
                        {"owned_by", "kvgrid"},
                        {"root", m->name},
                        {"parent", nullptr},
                        {"max_model_len", m->config.max_position_embeddings},
                        {"num_workers", registry_->NumLive(m->name)}});
  }
  responder->Respond(200, kJson, Dump(Json{{"object", "list"}, {"data", std::move(data)}}));
}

void OpenAiApi::Tokenize(const HttpRequest& request,
                         const std::shared_ptr<HttpResponder>& responder) {
  absl::StatusOr<openai::TokenizeCall> call = openai::ParseTokenizeCall(request.body);
  if (!call.ok()) return RespondError(*responder, call.status());
  absl::StatusOr<const ServedModel*> m = catalog_->FindWithTokenizer(call->model);
  if (!m.ok()) return RespondError(*responder, m.status());
  // A prompt with add_special_tokens gets what the tokenizer's post-processor adds, as in
  // vLLM (and as /v1/completions tokenizes it).
  absl::StatusOr<std::vector<int32_t>> ids =
      call->prompt ? EncodeText(**m, *call->prompt, /*add_bos=*/false, call->add_special_tokens)
                   : EncodeChat(**m, call->chat);
  if (!ids.ok()) return RespondError(*responder, ids.status());
  responder->Respond(200, kJson,
                     Dump(Json{{"count", ids->size()},
                               {"max_model_len", (*m)->config.max_position_embeddings},
                               {"tokens", *ids}}));
}

void OpenAiApi::Detokenize(const HttpRequest& request,
                           const std::shared_ptr<HttpResponder>& responder) {
  absl::StatusOr<openai::DetokenizeCall> call = openai::ParseDetokenizeCall(request.body);
  if (!call.ok()) return RespondError(*responder, call.status());
  absl::StatusOr<const ServedModel*> m = catalog_->FindWithTokenizer(call->model);
  if (!m.ok()) return RespondError(*responder, m.status());
  absl::StatusOr<std::string> text = (*m)->tokenizer->Decode(call->tokens, false);
  if (!text.ok()) {
    return RespondError(*responder, absl::InvalidArgumentError(
                                        absl::StrCat("tokens: ", text.status().message())));
  }
  responder->Respond(200, kJson, Dump(Json{{"prompt", *text}}));
}

}  // namespace kvgrid::coordinator
