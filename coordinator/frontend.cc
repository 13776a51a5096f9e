#include "coordinator/frontend.h"

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/chat_request.h"
#include "coordinator/request_parse.h"
#include "model/status_macros.h"
#include "proto/grpc_status.h"

namespace kvgrid::coordinator {
namespace {

// Bounds that keep one request from tying up the coordinator.
constexpr uint32_t kMaxN = 256;
constexpr int64_t kMaxStopStrings = 16;
// OpenAI's bounds on the penalties and biases; the entry cap is the worker sampler's.
constexpr float kMaxPenalty = 2.f;
constexpr float kMaxLogitBias = 100.f;
constexpr int kMaxLogitBiasEntries = 1024;
// request_id is echoed in every response of a stream and the model name in errors: a client's
// megabyte-long id would otherwise be multiplied by every token it is sent back with.
constexpr size_t kMaxRequestIdBytes = 256;
constexpr size_t kMaxModelNameBytes = 256;

// The presence and frequency penalties and logit_bias, checked here because only the
// coordinator can name the field as the client sent it before placement (the worker checks
// them again, with the other sampling fields). Errors: INVALID_ARGUMENT naming the field.
absl::Status CheckPenaltiesAndBias(const v1::SamplingParams& s, int64_t vocab) {
  for (const auto& [name, value] : {std::pair{"presence_penalty", s.presence_penalty()},
                                    std::pair{"frequency_penalty", s.frequency_penalty()}}) {
    if (!(std::abs(value) <= kMaxPenalty)) {  // NaN fails too
      return absl::InvalidArgumentError(absl::StrCat("sampling.", name, ": must be in [-",
                                                     kMaxPenalty, ", ", kMaxPenalty, "], got ",
                                                     value));
    }
  }
  if (s.logit_bias_size() > kMaxLogitBiasEntries) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias: at most ",
                                                   kMaxLogitBiasEntries, " entries, got ",
                                                   s.logit_bias_size()));
  }
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias: token id ", id,
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
    if (!(std::abs(bias) <= kMaxLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias[", id, "]: must be in [-",
                                                     kMaxLogitBias, ", ", kMaxLogitBias,
                                                     "], got ", bias));
    }
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(proto::ToGrpcStatus(s));
  return reactor;
}

// Finishes the unary call with `expr`'s status when that is not OK.
#define KVGRID_DONE_IF_ERROR(context, expr)                                 \
  if (absl::Status kvgrid_done_status = (expr); !kvgrid_done_status.ok()) \
  return Done(context, kvgrid_done_status)

absl::Status CheckModelName(const std::string& model) {
  if (model.size() > kMaxModelNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: at most ", kMaxModelNameBytes, " bytes, got ", model.size()));
  }
  return absl::OkStatus();
}

// The gRPC side of a relayed Generate call: the relay's sink, as a server write reactor. The
// method is registered raw, so each response is serialized here; the relay writes one at a
// time (the next after OnWriteDone), so one buffer is enough.
class GrpcGenerateStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer>,
                                 public RelaySink {
 public:
  // A call that fails at once (credentials, validation, draining).
  explicit GrpcGenerateStream(const grpc::Status& status) { Finish(status); }
  GrpcGenerateStream() = default;
  // Set before the relay starts, which is before gRPC calls anything.
  void Attach(GenerateRelay* relay) { relay_ = relay; }

  void Write(const v1::GenerateResponse& msg) override {
    // Cannot fail for a response under protobuf's 2 GiB; if it did, the relay ends the call
    // as it does for a write that failed.
    if (!SerializeMessage(msg, &buffer_).ok()) {
      relay_->OnWriteDone(false);
      return;
    }
    StartWrite(&buffer_);
  }
  void End(const grpc::Status& status) override { Finish(status); }

  void OnWriteDone(bool ok) override { relay_->OnWriteDone(ok); }
  void OnCancel() override {
    if (relay_ != nullptr) relay_->OnCancel();
  }
  void OnDone() override {
    if (relay_ != nullptr) relay_->OnDone();
    delete this;
  }

 private:
  GenerateRelay* relay_ = nullptr;
  grpc::ByteBuffer buffer_;  // the response being written
};

}  // namespace

GenerationService::GenerationService(const ModelCatalog* catalog, WorkerRegistry* registry,
                                     CoordinatorMetrics* metrics, RelayOptions relay_options,
                                     const auth::BearerAuth* api_keys)
    : catalog_(catalog),
      registry_(registry),
      metrics_(metrics),
      relay_options_(std::move(relay_options)),
      api_keys_(api_keys) {}

absl::StatusOr<v1::WorkerGenerateRequest> GenerationService::Prepare(
    const v1::GenerateRequest& request, const ServedModel** served) const {
  if (request.request_id().size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id: at most ", kMaxRequestIdBytes,
                                                   " bytes, got ", request.request_id().size()));
  }
  KVGRID_RETURN_IF_ERROR(CheckModelName(request.model()));
  absl::StatusOr<const ServedModel*> found = catalog_->Find(request.model());
  if (!found.ok()) return found.status();
  const ServedModel& m = **found;
  *served = &m;
  v1::WorkerGenerateRequest out;
  const bool has_text = !request.prompt().empty();
  const bool has_ids = request.prompt_token_ids_size() > 0;
  const bool has_messages = IsChatRequest(request);
  if (has_text + has_ids + has_messages > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        has_messages ? "messages" : "prompt",
        ": give one of prompt, prompt_token_ids and messages, not several"));
  }
  if (!has_text && !has_ids && !has_messages) {
    return absl::InvalidArgumentError(
        "prompt: must not be empty (set prompt, prompt_token_ids or messages)");
  }
  if (request.add_special_tokens() && !has_text) {
    return absl::InvalidArgumentError("add_special_tokens: only with a text prompt");
  }
  if (has_messages) {
    // A conversation becomes a prompt of token ids here; from then on it is one request path.
    KVGRID_ASSIGN_OR_RETURN(const std::vector<int32_t> ids, EncodeChat(m, request));
    out.mutable_prompt_token_ids()->Add(ids.begin(), ids.end());
  } else {
    KVGRID_RETURN_IF_ERROR(CheckNoChatFields(request));
  }
  if (has_text) {
    if (!m.tokenizer) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: model '", m.name, "' has no tokenizer; send prompt_token_ids"));
    }
    KVGRID_ASSIGN_OR_RETURN(const std::vector<int32_t> ids,
                            EncodeText(m, request.prompt(), request.add_bos(),
                                       request.add_special_tokens()));
    out.mutable_prompt_token_ids()->Add(ids.begin(), ids.end());
  } else if (has_ids) {
    const int64_t vocab = m.config.vocab_size;
    for (int i = 0; i < request.prompt_token_ids_size(); ++i) {
      const int32_t id = request.prompt_token_ids(i);
      if (id < 0 || id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids[", i, "]: token id ",
                                                       id, " is outside the vocabulary [0, ",
                                                       vocab, ")"));
      }
      out.add_prompt_token_ids(id);
    }
  }
  const int64_t max_len = m.config.max_position_embeddings;
  if (max_len > 0 && out.prompt_token_ids_size() >= max_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: ", out.prompt_token_ids_size(),
                                                   " tokens leave no room in the context window "
                                                   "of ", max_len, " tokens"));
  }
  *out.mutable_sampling() = request.sampling();
  KVGRID_RETURN_IF_ERROR(CheckPenaltiesAndBias(out.sampling(), m.config.vocab_size));
  *out.mutable_stopping() = request.stopping();
  ApplyGenerationDefaults(m.generation, out.mutable_sampling(), out.mutable_stopping());
  if (!out.stopping().has_max_new_tokens()) out.mutable_stopping()->set_max_new_tokens(16);
  if (has_messages) AddEndOfTurn(m, out.mutable_stopping());
  if (out.stopping().max_new_tokens() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("stopping.max_new_tokens: must be >= 1, got ",
                                                   out.stopping().max_new_tokens()));
  }
  if (out.stopping().stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat("stopping.stop: at most ", kMaxStopStrings, " stop strings"));
  }
  if (request.n() > kMaxN) {
    return absl::InvalidArgumentError(
        absl::StrCat("n: must be in [1, ", kMaxN, "], got ", request.n()));
  }
  out.set_n(std::max<uint32_t>(1, request.n()));
  out.set_priority(request.priority());
  return out;
}

absl::StatusOr<GenerationService::Admitted> GenerationService::Admit(
    const v1::GenerateRequest& request, const std::string& api,
    const AdmitOptions& options) const {
  auto refuse = [&](const absl::Status& s, const ServedModel* model) {
    // The served model's name when the request named one (or the only one); otherwise no
    // model, so that label values stay the catalog's.
    if (metrics_ != nullptr) {
      metrics_->CountError(model != nullptr ? model->name : "", api,
                           proto::ToGrpcStatus(s).error_code());
    }
    return s;
  };
  if (draining_.load()) {
    return refuse(absl::UnavailableError("the coordinator is draining"), nullptr);
  }
  Admitted out;
  absl::StatusOr<v1::WorkerGenerateRequest> prepared = Prepare(request, &out.model);
  if (!prepared.ok()) {
    absl::StatusOr<const ServedModel*> named = catalog_->Find(request.model());
    return refuse(prepared.status(), named.ok() ? *named : nullptr);
  }
  out.request = *std::move(prepared);
  const int64_t max_len = out.model->config.max_position_embeddings;
  const int64_t prompt_len = out.request.prompt_token_ids_size();
  if (max_len > 0) {
    if (options.max_new_tokens_fills_context && !request.stopping().has_max_new_tokens()) {
      out.request.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(max_len - prompt_len));
    } else if (options.refuse_beyond_context &&
               prompt_len + out.request.stopping().max_new_tokens() > max_len) {
      const int64_t max_new = out.request.stopping().max_new_tokens();
      return refuse(
          absl::InvalidArgumentError(absl::StrCat(
              "max_tokens: this model's maximum context length is ", max_len,
              " tokens. However, you requested ", prompt_len + max_new, " tokens (", prompt_len,
              " in the prompt, ", max_new,
              " in the completion). Please reduce the length of the prompt or completion.")),
          out.model);
    }
  }
  out.request_id = request.request_id();
  if (out.request_id.empty()) out.request_id = absl::StrCat("req-", next_id_.fetch_add(1));
  return out;
}

GenerateRelay* GenerationService::NewRelay(Admitted admitted, RelaySink* sink,
                                           std::chrono::system_clock::time_point deadline,
                                           const std::string& api) {
  return new GenerateRelay(sink, deadline, registry_, metrics_, relay_options_, &in_flight_, api,
                           admitted.model->name, std::move(admitted.request_id),
                           std::move(admitted.request));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw) {
  if (grpc::Status auth = api_keys_->Check(*context); !auth.ok()) {
    CountRefused("grpc", auth.error_code());
    return new GrpcGenerateStream(auth);
  }
  v1::GenerateRequest request;
  if (absl::Status parsed = ParseRequest(*raw, &request); !parsed.ok()) {
    CountRefused("grpc", grpc::StatusCode::INVALID_ARGUMENT);
    return new GrpcGenerateStream(proto::ToGrpcStatus(parsed));
  }
  absl::StatusOr<Admitted> admitted = Admit(request, "grpc");
  if (!admitted.ok()) return new GrpcGenerateStream(proto::ToGrpcStatus(admitted.status()));
  auto* stream = new GrpcGenerateStream();
  GenerateRelay* relay = NewRelay(*std::move(admitted), stream, context->deadline(), "grpc");
  stream->Attach(relay);
  relay->Start();
  return stream;
}

grpc::ServerUnaryReactor* RefuseUnauthenticated(const auth::BearerAuth& keys,
                                                grpc::CallbackServerContext* context) {
  const grpc::Status auth = keys.Check(*context);
  if (auth.ok()) return nullptr;
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(auth);
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::Tokenize(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* raw,
                                                      grpc::ByteBuffer* raw_response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  v1::TokenizeRequest request;
  KVGRID_DONE_IF_ERROR(context, ParseRequest(*raw, &request));
  KVGRID_DONE_IF_ERROR(context, CheckModelName(request.model()));
  absl::StatusOr<const ServedModel*> m = catalog_->FindWithTokenizer(request.model());
  if (!m.ok()) return Done(context, m.status());
  absl::StatusOr<std::vector<int32_t>> ids = EncodeText(**m, request.text(), request.add_bos());
  if (!ids.ok()) return Done(context, ids.status());
  v1::TokenizeResponse response;
  response.mutable_token_ids()->Add(ids->begin(), ids->end());
  return Done(context, SerializeMessage(response, raw_response));
}

grpc::ServerUnaryReactor* GenerationService::Detokenize(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* raw,
                                                        grpc::ByteBuffer* raw_response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  v1::DetokenizeRequest request;
  KVGRID_DONE_IF_ERROR(context, ParseRequest(*raw, &request));
  KVGRID_DONE_IF_ERROR(context, CheckModelName(request.model()));
  absl::StatusOr<const ServedModel*> m = catalog_->FindWithTokenizer(request.model());
  if (!m.ok()) return Done(context, m.status());
  const std::vector<int32_t> ids(request.token_ids().begin(), request.token_ids().end());
  absl::StatusOr<std::string> text = (*m)->tokenizer->Decode(ids, request.skip_special_tokens());
  if (!text.ok()) {
    return Done(context, absl::InvalidArgumentError(
                             absl::StrCat("token_ids: ", text.status().message())));
  }
  v1::DetokenizeResponse response;
  response.set_text(*std::move(text));
  return Done(context, SerializeMessage(response, raw_response));
}

grpc::ServerUnaryReactor* GenerationService::ListModels(grpc::CallbackServerContext* context,
                                                        const v1::ListModelsRequest* request,
                                                        v1::ListModelsResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  for (const auto& m : catalog_->models()) {
    v1::ModelInfo* info = response->add_models();
    info->set_id(m->name);
    info->set_max_model_len(static_cast<int32_t>(m->config.max_position_embeddings));
    info->set_vocab_size(static_cast<int32_t>(m->config.vocab_size));
    info->set_num_workers(registry_->NumLive(m->name));
  }
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* GenerationService::ClusterStatus(
    grpc::CallbackServerContext* context, const v1::ClusterStatusRequest* request,
    v1::ClusterStatusResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  registry_->FillStatus(response);
  response->set_in_flight(static_cast<int32_t>(in_flight_.load()));
  response->set_draining(draining_.load());
  return Done(context, absl::OkStatus());
}

}  // namespace kvgrid::coordinator
