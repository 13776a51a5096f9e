#include "coordinator/kserve_http.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/openai_protocol.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"

namespace kvgrid::coordinator {
namespace {

using Json = nlohmann::json;
constexpr char kJson[] = "application/json";
constexpr char kApi[] = "kserve_http";

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void RespondError(HttpResponder& responder, const absl::Status& status) {
  responder.Respond(openai::HttpStatusFor(status.code()), kJson,
                    kserve::ErrorJson(std::string(status.message())));
}

// A message as protobuf's JSON with the .proto's field names, as Triton renders its model
// configuration.
std::string ProtoJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) return "{}";
  return out;
}

Json MetadataJson(const inference::ModelMetadataResponse& m) {
  auto tensors = [](const auto& list) {
    Json out = Json::array();
    for (const auto& t : list) {
      out.push_back(Json{{"name", t.name()},
                         {"datatype", t.datatype()},
                         {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}});
    }
    return out;
  };
  return Json{{"name", m.name()},
              {"versions", std::vector<std::string>(m.versions().begin(), m.versions().end())},
              {"platform", m.platform()},
              {"inputs", tensors(m.inputs())},
              {"outputs", tensors(m.outputs())}};
}

// One generate or generate_stream request: the relay's sink, on the connection's strand.
//
// Lifetime: keeps itself alive (self_) until its relay ended.
class HttpGenerateCall final : public std::enable_shared_from_this<HttpGenerateCall>,
                               public RelaySink {
 public:
  HttpGenerateCall(KServeApi* api, kserve::GenerateCall call, std::shared_ptr<HttpResponder> responder,
                   const GenerationService::Admitted& admitted)
      : api_(api),
        call_(std::move(call)),
        responder_(std::move(responder)),
        model_(admitted.model->name),
        progress_(admitted.request.prompt_token_ids_size()) {}

  void Start(GenerationService::Admitted admitted) {
    self_ = shared_from_this();
    relay_ = api_->generation()->NewRelay(std::move(admitted), this,
                                          std::chrono::system_clock::time_point::max(), kApi);
    responder_->OnClientGone([self = shared_from_this()] { self->OnGone(); });
    responder_->Post([self = shared_from_this()] {
      if (!self->gone_) self->relay_->Start();
    });
  }

  void Write(const v1::GenerateResponse& msg) override {
    responder_->Post([self = shared_from_this(), msg] { self->OnMessage(msg); });
  }
  void End(const grpc::Status& status) override {
    responder_->Post([self = shared_from_this(), status] { self->OnEnd(status); });
  }

 private:
  void OnMessage(const v1::GenerateResponse& msg) {
    const kserve::Result chunk = progress_.Add(msg);
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) queued_s_ = msg.timings().queued_s();
    if (!call_.stream || gone_) {
      relay_->OnWriteDone(!gone_);
      return;
    }
    if (!head_sent_) {
      head_sent_ = true;
      responder_->StartStream(200, "text/event-stream; charset=utf-8");
    }
    responder_->WriteChunk(absl::StrCat("data: ", kserve::MakeGenerateJson(call_, model_, chunk), "\n\n"),
                           [self = shared_from_this()](bool ok) { self->relay_->OnWriteDone(ok); });
  }

  void OnEnd(const grpc::Status& status) {
    done_ = true;
    relay_->OnDone();
    api_->Finished(model_, status.ok(), arrival_, queued_s_);
    if (!status.ok()) {
      const absl::Status s = proto::FromGrpcStatus(status);
      if (head_sent_) {
        responder_->WriteChunk(
            absl::StrCat("data: ", kserve::ErrorJson(std::string(s.message())), "\n\n"), nullptr);
        responder_->EndStream();
      } else {
        RespondError(*responder_, s);
      }
    } else if (call_.stream) {
      if (!head_sent_) responder_->StartStream(200, "text/event-stream; charset=utf-8");
      responder_->EndStream();
    } else {
      responder_->Respond(200, kJson, kserve::MakeGenerateJson(call_, model_, progress_.total()));
    }
    self_.reset();
  }

  void OnGone() {
    gone_ = true;
    if (!done_) relay_->OnCancel();
  }

  KServeApi* const api_;
  const kserve::GenerateCall call_;
  const std::shared_ptr<HttpResponder> responder_;
  const std::string model_;
  const std::chrono::steady_clock::time_point arrival_ = std::chrono::steady_clock::now();
  std::shared_ptr<HttpGenerateCall> self_;
  GenerateRelay* relay_ = nullptr;
  // On the strand, from here on.
  kserve::Progress progress_;
  double queued_s_ = 0;
  bool head_sent_ = false;
  bool gone_ = false;
  bool done_ = false;
};

}  // namespace

KServeHttp::KServeHttp(KServeApi* api, const auth::BearerAuth* api_keys)
    : api_(api), api_keys_(api_keys) {}

bool KServeHttp::Serves(const std::string& path) {
  return path == "/v2" || path.starts_with("/v2/");
}

void KServeHttp::Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder) {
  const std::string& path = request.path;
  auto require = [&](const char* method) {
    if (request.method == method) return true;
    responder->Respond(405, kJson, kserve::ErrorJson(absl::StrCat(path, " takes ", method)));
    return false;
  };
  if (path == "/v2/health/live") {
    if (require("GET")) responder->Respond(200, kJson, "{}");
    return;
  }
  if (path == "/v2/health/ready") {
    if (!require("GET")) return;
    if (api_->ServerReady()) {
      responder->Respond(200, kJson, "{}");
    } else {
      responder->Respond(503, kJson, kserve::ErrorJson("not ready: draining, or no live worker"));
    }
    return;
  }
  const grpc::Status auth = api_keys_->CheckHeader(
      request.authorization.empty() ? std::nullopt
                                    : std::optional<std::string_view>(request.authorization));
  if (!auth.ok()) {
    api_->generation()->CountRefused(kApi, auth.error_code());
    RespondError(*responder, proto::FromGrpcStatus(auth));
    return;
  }
  if (path == "/v2") {
    if (!require("GET")) return;
    responder->Respond(200, kJson,
                       Dump(Json{{"name", "kvgrid"},
                                 {"version", KVGRID_VERSION},
                                 {"extensions", {"model_configuration", "parameters",
                                                 "statistics", "generate"}}}));
    return;
  }
  if (path == "/v2/models/stats") {
    if (!require("GET")) return;
    absl::StatusOr<inference::ModelStatisticsResponse> stats = api_->Statistics("", "");
    if (!stats.ok()) return RespondError(*responder, stats.status());
    responder->Respond(200, kJson, ProtoJson(*stats));
    return;
  }
  // /v2/models/{name}[/versions/{version}][/{action}]
  constexpr std::string_view kModels = "/v2/models/";
  if (!path.starts_with(kModels)) {
    responder->Respond(404, kJson, kserve::ErrorJson(absl::StrCat("no route ", path)));
    return;
  }
  std::vector<std::string> parts =
      absl::StrSplit(path.substr(kModels.size()), '/', absl::SkipEmpty());
  std::string version;
  std::string action;
  if (parts.size() >= 3 && parts[1] == "versions") {
    version = parts[2];
    if (parts.size() == 4) action = parts[3];
    if (parts.size() > 4) parts.clear();
  } else if (parts.size() == 2) {
    action = parts[1];
  } else if (parts.size() != 1) {
    parts.clear();
  }
  const bool known_action = action.empty() || action == "ready" || action == "config" ||
                            action == "stats" || action == "generate" ||
                            action == "generate_stream";
  if (parts.empty() || !known_action) {
    responder->Respond(404, kJson, kserve::ErrorJson(absl::StrCat("no route ", path)));
    return;
  }
  absl::StatusOr<const ServedModel*> model = api_->FindModel(parts[0], version);
  if (!model.ok()) return RespondError(*responder, model.status());
  if (action == "generate" || action == "generate_stream") {
    if (!require("POST")) return;
    return Generate(**model, request, action == "generate_stream", responder);
  }
  if (!require("GET")) return;
  if (action.empty()) {
    responder->Respond(200, kJson, Dump(MetadataJson(api_->Metadata(**model))));
  } else if (action == "ready") {
    if (api_->ModelReady(**model)) {
      responder->Respond(200, kJson, "{}");
    } else {
      responder->Respond(503, kJson, kserve::ErrorJson(absl::StrCat(
                                         "model '", (*model)->name, "' has no live worker")));
    }
  } else if (action == "config") {
    responder->Respond(200, kJson, ProtoJson(api_->Config(**model)));
  } else {
    absl::StatusOr<inference::ModelStatisticsResponse> stats =
        api_->Statistics((*model)->name, version);
    if (!stats.ok()) return RespondError(*responder, stats.status());
    responder->Respond(200, kJson, ProtoJson(*stats));
  }
}

void KServeHttp::Generate(const ServedModel& model, const HttpRequest& request, bool stream,
                          const std::shared_ptr<HttpResponder>& responder) {
  absl::StatusOr<kserve::GenerateCall> call =
      kserve::ParseGenerateBody(model.name, request.body, stream);
  if (!call.ok()) {
    api_->generation()->CountRefused(kApi, proto::ToGrpcStatus(call.status()).error_code());
    return RespondError(*responder, call.status());
  }
  absl::StatusOr<GenerationService::Admitted> admitted = api_->Admit(*call, kApi);
  if (!admitted.ok()) return RespondError(*responder, admitted.status());
  auto generate = std::make_shared<HttpGenerateCall>(api_, *std::move(call), responder, *admitted);
  generate->Start(*std::move(admitted));
}

}  // namespace kvgrid::coordinator
