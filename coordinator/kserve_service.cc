#include "coordinator/kserve_service.h"

#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/request_parse.h"
#include "proto/grpc_status.h"

namespace kvgrid::coordinator {
namespace {

constexpr char kApi[] = "kserve_grpc";
// -100 all but bans a token (SamplingParams.logit_bias).
constexpr float kBanBias = -100.f;

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(proto::ToGrpcStatus(s));
  return reactor;
}

uint64_t NowMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// The parsed and admitted form of one ModelInferRequest's wire bytes.
struct Started {
  kserve::GenerateCall call;
  GenerationService::Admitted admitted;
};

// `unary`: for ModelInfer, which refuses to stream.
absl::StatusOr<Started> ParseAndAdmit(KServeApi* api, const grpc::ByteBuffer& bytes,
                                      bool unary) {
  inference::ModelInferRequest request;
  if (absl::Status s = ParseRequest(bytes, &request); !s.ok()) {
    api->generation()->CountRefused(kApi, grpc::StatusCode::INVALID_ARGUMENT);
    return s;
  }
  absl::StatusOr<kserve::GenerateCall> call = kserve::ParseInferRequest(request);
  if (!call.ok()) {
    api->generation()->CountRefused(kApi, proto::ToGrpcStatus(call.status()).error_code());
    return call.status();
  }
  if (unary && call->stream) {
    api->generation()->CountRefused(kApi, grpc::StatusCode::INVALID_ARGUMENT);
    return absl::InvalidArgumentError(
        "input 'stream': ModelInfer returns one response; stream with ModelStreamInfer");
  }
  absl::StatusOr<GenerationService::Admitted> admitted = api->Admit(*call, kApi);
  if (!admitted.ok()) return admitted.status();
  return Started{*std::move(call), *std::move(admitted)};
}

// One ModelInfer call: the relay's sink, gathering the whole completion.
class InferCall final : public grpc::ServerUnaryReactor, public RelaySink {
 public:
  InferCall(KServeApi* api, grpc::ByteBuffer* response, Started started,
            std::chrono::system_clock::time_point deadline)
      : api_(api),
        response_(response),
        call_(std::move(started.call)),
        model_(started.admitted.model->name),
        progress_(started.admitted.request.prompt_token_ids_size()) {
    relay_ = api_->generation()->NewRelay(std::move(started.admitted), this, deadline, kApi);
  }
  void Start() { relay_->Start(); }

  void Write(const v1::GenerateResponse& msg) override {
    progress_.Add(msg);
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) queued_s_ = msg.timings().queued_s();
    relay_->OnWriteDone(true);
  }
  void End(const grpc::Status& status) override {
    api_->Finished(model_, status.ok(), arrival_, queued_s_);
    if (!status.ok()) {
      Finish(status);
      return;
    }
    const inference::ModelInferResponse response =
        kserve::MakeInferResponse(call_, model_, progress_.total(), std::nullopt);
    Finish(proto::ToGrpcStatus(SerializeMessage(response, response_)));
  }
  void OnCancel() override { relay_->OnCancel(); }
  void OnDone() override {
    relay_->OnDone();
    delete this;
  }

 private:
  KServeApi* const api_;
  grpc::ByteBuffer* const response_;
  const kserve::GenerateCall call_;
  const std::string model_;
  const std::chrono::steady_clock::time_point arrival_ = std::chrono::steady_clock::now();
  kserve::Progress progress_;
  double queued_s_ = 0;
  GenerateRelay* relay_ = nullptr;
};

// One ModelStreamInfer call: reads requests until the client half-closes, relays each (a
// Part), and writes their responses, one write in flight, in the order they are ready. It
// finishes once reading ended and every part ended.
//
// A part's relay is called only through CallRelay, which keeps it alive across the call: the
// relay may end (Part::End) from another thread at any moment, and its OnDone, after which
// it must not be called, waits until no call into it is in progress.
class StreamCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamCall(KServeApi* api, const grpc::Status& auth) : api_(api) {
    if (!auth.ok()) {
      api_->generation()->CountRefused(kApi, auth.error_code());
      Finish(auth);
      return;
    }
    StartRead(&read_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      {
        absl::MutexLock lock(&mu_);
        reading_ = false;
      }
      MaybeFinish();
      return;
    }
    absl::StatusOr<Started> started = ParseAndAdmit(api_, read_, /*unary=*/false);
    read_.Clear();
    if (!started.ok()) {
      inference::ModelStreamInferResponse error;
      error.set_error_message(std::string(started.status().message()));
      Enqueue(error, nullptr);
    } else {
      auto part = std::make_unique<Part>(this, *std::move(started));
      Part* p = part.get();
      {
        absl::MutexLock lock(&mu_);
        parts_.push_back(std::move(part));
        ++live_parts_;
      }
      CallRelay(p, [](GenerateRelay* r) { r->Start(); });
    }
    StartRead(&read_);
  }

  void OnWriteDone(bool ok) override {
    Part* acked = nullptr;
    grpc::ByteBuffer* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      acked = queue_.front().part;
      queue_.pop_front();
      if (!ok) write_failed_ = true;
      if (!queue_.empty()) {
        next = &queue_.front().buffer;  // stays put: only this pops, after its write
      } else {
        writing_ = false;
      }
    }
    if (next != nullptr) StartWrite(next);
    if (acked != nullptr) CallRelay(acked, [ok](GenerateRelay* r) { r->OnWriteDone(ok); });
    MaybeFinish();
  }

  void OnCancel() override {
    std::vector<Part*> live;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      for (const auto& p : parts_) {
        if (!p->ended) live.push_back(p.get());
      }
    }
    for (Part* p : live) CallRelay(p, [](GenerateRelay* r) { r->OnCancel(); });
  }

  void OnDone() override { delete this; }

 private:
  struct Part final : RelaySink {
    Part(StreamCall* stream, Started started)
        : stream(stream),
          call(std::move(started.call)),
          model(started.admitted.model->name),
          progress(started.admitted.request.prompt_token_ids_size()) {
      relay = stream->api_->generation()->NewRelay(
          std::move(started.admitted), this, std::chrono::system_clock::time_point::max(), kApi);
    }
    void Write(const v1::GenerateResponse& msg) override { stream->OnPartMessage(this, msg); }
    void End(const grpc::Status& status) override { stream->OnPartEnd(this, status); }

    StreamCall* const stream;
    const kserve::GenerateCall call;
    const std::string model;
    const std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();
    kserve::Progress progress;
    double queued_s = 0;
    GenerateRelay* relay = nullptr;
    // Guarded by the stream's mu_.
    int calls = 0;           // calls into the relay in progress
    bool ended = false;      // End came
    bool done_sent = false;  // the relay was told OnDone
  };

  struct Pending {
    grpc::ByteBuffer buffer;
    Part* part;  // whose relay hears when the write is done; null: none
  };

  // Runs `fn` on `p`'s relay unless it was told OnDone, and tells it OnDone after the last
  // call once the part ended.
  template <typename Fn>
  void CallRelay(Part* p, Fn fn) {
    {
      absl::MutexLock lock(&mu_);
      if (p->done_sent) return;
      ++p->calls;
    }
    fn(p->relay);
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      --p->calls;
      done = TakeDoneLocked(p);
    }
    if (done) SendDone(p);
  }

  // Whether `p` should be told OnDone now (then marked so).
  bool TakeDoneLocked(Part* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!p->ended || p->calls > 0 || p->done_sent) return false;
    p->done_sent = true;
    return true;
  }

  void SendDone(Part* p) {
    p->relay->OnDone();
    {
      absl::MutexLock lock(&mu_);
      --live_parts_;
    }
    MaybeFinish();
  }

  void OnPartMessage(Part* p, const v1::GenerateResponse& msg) {
    const kserve::Result chunk = p->progress.Add(msg);
    const bool last = msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED;
    if (last) p->queued_s = msg.timings().queued_s();
    if (!p->call.stream) {
      // One response with the whole completion, at the end.
      CallRelay(p, [](GenerateRelay* r) { r->OnWriteDone(true); });
      return;
    }
    inference::ModelStreamInferResponse out;
    *out.mutable_infer_response() = kserve::MakeInferResponse(p->call, p->model, chunk, last);
    Enqueue(out, p);
  }

  void OnPartEnd(Part* p, const grpc::Status& status) {
    api_->Finished(p->model, status.ok(), p->arrival, p->queued_s);
    if (!status.ok()) {
      inference::ModelStreamInferResponse error;
      error.set_error_message(std::string(status.error_message()));
      error.mutable_infer_response()->set_model_name(p->model);
      error.mutable_infer_response()->set_model_version(kserve::kModelVersion);
      error.mutable_infer_response()->set_id(p->call.id);
      Enqueue(error, nullptr);
    } else if (!p->call.stream) {
      inference::ModelStreamInferResponse out;
      *out.mutable_infer_response() =
          kserve::MakeInferResponse(p->call, p->model, p->progress.total(), true);
      Enqueue(out, nullptr);
    }
    bool done = false;
    {
      absl::MutexLock lock(&mu_);
      p->ended = true;
      done = TakeDoneLocked(p);
    }
    if (done) SendDone(p);
  }

  // Queues `msg` for writing; `part`'s relay hears when it was written.
  void Enqueue(const inference::ModelStreamInferResponse& msg, Part* part) {
    Pending pending{.part = part};
    if (!SerializeMessage(msg, &pending.buffer).ok()) {
      if (part != nullptr) CallRelay(part, [](GenerateRelay* r) { r->OnWriteDone(false); });
      return;
    }
    grpc::ByteBuffer* first = nullptr;
    {
      absl::MutexLock lock(&mu_);
      queue_.push_back(std::move(pending));
      if (!writing_) {
        writing_ = true;
        first = &queue_.front().buffer;
      }
    }
    if (first != nullptr) StartWrite(first);
  }

  void MaybeFinish() {
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || reading_ || live_parts_ > 0 || writing_) return;
      finished_ = true;
      failed = cancelled_ || write_failed_;
    }
    Finish(failed ? grpc::Status::CANCELLED : grpc::Status::OK);
  }

  KServeApi* const api_;
  grpc::ByteBuffer read_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Part>> parts_ ABSL_GUARDED_BY(mu_);
  int live_parts_ ABSL_GUARDED_BY(mu_) = 0;  // not yet told OnDone
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_ ABSL_GUARDED_BY(mu_) = true;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

KServeApi::KServeApi(GenerationService* generation, const ModelCatalog* catalog,
                     const WorkerRegistry* registry)
    : generation_(generation), catalog_(catalog), registry_(registry) {}

bool KServeApi::ServerReady() const {
  if (generation_->draining()) return false;
  for (const auto& m : catalog_->models()) {
    if (registry_->NumLive(m->name) > 0) return true;
  }
  return false;
}

absl::StatusOr<const ServedModel*> KServeApi::FindModel(const std::string& name,
                                                        const std::string& version) const {
  absl::StatusOr<const ServedModel*> m = catalog_->Find(name);
  if (!m.ok()) return m.status();
  if (!version.empty() && version != kserve::kModelVersion) {
    return absl::NotFoundError(absl::StrCat("model '", (*m)->name, "' has no version '", version,
                                            "' (kvgrid serves version ", kserve::kModelVersion,
                                            ")"));
  }
  return m;
}

bool KServeApi::ModelReady(const ServedModel& model) const {
  return !generation_->draining() && registry_->NumLive(model.name) > 0;
}

inference::ModelMetadataResponse KServeApi::Metadata(const ServedModel& model) const {
  inference::ModelMetadataResponse out;
  out.set_name(model.name);
  out.add_versions(kserve::kModelVersion);
  out.set_platform("kvgrid");
  for (const kserve::TensorSpec& t : kserve::InputSpecs()) {
    auto* m = out.add_inputs();
    m->set_name(t.name);
    m->set_datatype(t.datatype);
    m->add_shape(t.dim);
  }
  for (const kserve::TensorSpec& t : kserve::OutputSpecs()) {
    auto* m = out.add_outputs();
    m->set_name(t.name);
    m->set_datatype(t.datatype);
    m->add_shape(t.dim);
  }
  return out;
}

namespace {

inference::DataType ConfigType(std::string_view datatype) {
  if (datatype == "BYTES") return inference::TYPE_STRING;
  if (datatype == "BOOL") return inference::TYPE_BOOL;
  if (datatype == "INT32") return inference::TYPE_INT32;
  if (datatype == "UINT32") return inference::TYPE_UINT32;
  if (datatype == "UINT64") return inference::TYPE_UINT64;
  if (datatype == "FP32") return inference::TYPE_FP32;
  return inference::TYPE_INVALID;
}

}  // namespace

inference::ModelConfig KServeApi::Config(const ServedModel& model) const {
  inference::ModelConfig out;
  out.set_name(model.name);
  out.set_platform("kvgrid");
  out.set_backend("kvgrid");
  out.set_max_batch_size(0);
  for (const kserve::TensorSpec& t : kserve::InputSpecs()) {
    auto* m = out.add_input();
    m->set_name(t.name);
    m->set_data_type(ConfigType(t.datatype));
    m->add_dims(t.dim);
    m->set_optional(t.optional);
  }
  for (const kserve::TensorSpec& t : kserve::OutputSpecs()) {
    auto* m = out.add_output();
    m->set_name(t.name);
    m->set_data_type(ConfigType(t.datatype));
    m->add_dims(t.dim);
  }
  out.mutable_model_transaction_policy()->set_decoupled(true);
  (*out.mutable_parameters())["max_model_len"].set_string_value(
      absl::StrCat(model.config.max_position_embeddings));
  return out;
}

absl::StatusOr<inference::ModelStatisticsResponse> KServeApi::Statistics(
    const std::string& name, const std::string& version) const {
  std::vector<const ServedModel*> models;
  if (name.empty() && version.empty()) {
    for (const auto& m : catalog_->models()) models.push_back(m.get());
  } else {
    absl::StatusOr<const ServedModel*> m = FindModel(name, version);
    if (!m.ok()) return m.status();
    models.push_back(*m);
  }
  inference::ModelStatisticsResponse out;
  absl::MutexLock lock(&mu_);
  for (const ServedModel* m : models) {
    Counters c;
    if (auto it = counters_.find(m->name); it != counters_.end()) c = it->second;
    inference::ModelStatistics* s = out.add_model_stats();
    s->set_name(m->name);
    s->set_version(kserve::kModelVersion);
    s->set_last_inference(c.last_inference_ms);
    s->set_inference_count(c.inference_count);
    s->set_execution_count(c.inference_count);
    s->mutable_inference_stats()->mutable_success()->set_count(c.success_count);
    s->mutable_inference_stats()->mutable_success()->set_ns(c.success_ns);
    s->mutable_inference_stats()->mutable_fail()->set_count(c.fail_count);
    s->mutable_inference_stats()->mutable_fail()->set_ns(c.fail_ns);
    s->mutable_inference_stats()->mutable_queue()->set_count(c.queue_count);
    s->mutable_inference_stats()->mutable_queue()->set_ns(c.queue_ns);
  }
  return out;
}

absl::StatusOr<GenerationService::Admitted> KServeApi::Admit(kserve::GenerateCall& call,
                                                             const std::string& api) {
  absl::StatusOr<const ServedModel*> model = catalog_->Find(call.model_name);
  if (!model.ok()) {
    generation_->CountRefused(api, proto::ToGrpcStatus(model.status()).error_code());
    return model.status();
  }
  for (const std::string& word : call.bad_words) {
    if (!(*model)->tokenizer) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad_words: model '", (*model)->name, "' has no tokenizer"));
    }
    absl::StatusOr<std::vector<int32_t>> ids = EncodeText(**model, word, /*add_bos=*/false);
    if (!ids.ok()) return ids.status();
    if (ids->size() != 1) {
      generation_->CountRefused(api, grpc::StatusCode::INVALID_ARGUMENT);
      return absl::InvalidArgumentError(absl::StrCat(
          "bad_words: '", word, "' is ", ids->size(),
          " tokens; kvgrid bans words of one token of the vocabulary only"));
    }
    (*call.request.mutable_sampling()->mutable_logit_bias())[ids->front()] = kBanBias;
  }
  v1::GenerateRequest request = call.request;
  request.set_model((*model)->name);
  request.set_add_special_tokens(true);
  AdmitOptions options;
  options.refuse_beyond_context = true;
  absl::StatusOr<GenerationService::Admitted> admitted = generation_->Admit(request, api, options);
  if (!admitted.ok()) return admitted.status();
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[(*model)->name];
  ++c.inference_count;
  c.last_inference_ms = NowMs();
  return admitted;
}

void KServeApi::Finished(const std::string& model, bool ok,
                         std::chrono::steady_clock::time_point arrival, double queued_s) {
  const auto ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::steady_clock::now() - arrival)
                                            .count());
  absl::MutexLock lock(&mu_);
  Counters& c = counters_[model];
  if (ok) {
    ++c.success_count;
    c.success_ns += ns;
    ++c.queue_count;
    c.queue_ns += static_cast<uint64_t>(queued_s * 1e9);
  } else {
    ++c.fail_count;
    c.fail_ns += ns;
  }
}

KServeService::KServeService(KServeApi* api, const auth::BearerAuth* api_keys)
    : api_(api), api_keys_(api_keys) {}

grpc::ServerUnaryReactor* KServeService::ServerLive(grpc::CallbackServerContext* context,
                                                    const inference::ServerLiveRequest*,
                                                    inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ServerReady(grpc::CallbackServerContext* context,
                                                     const inference::ServerReadyRequest*,
                                                     inference::ServerReadyResponse* response) {
  response->set_ready(api_->ServerReady());
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ModelReady(grpc::CallbackServerContext* context,
                                                    const inference::ModelReadyRequest* request,
                                                    inference::ModelReadyResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  absl::StatusOr<const ServedModel*> m = api_->FindModel(request->name(), request->version());
  if (!m.ok()) return Done(context, m.status());
  response->set_ready(api_->ModelReady(**m));
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  response->set_name("kvgrid");
  response->set_version(KVGRID_VERSION);
  for (const char* e : {"model_configuration", "parameters", "statistics", "generate"}) {
    response->add_extensions(e);
  }
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  absl::StatusOr<const ServedModel*> m = api_->FindModel(request->name(), request->version());
  if (!m.ok()) return Done(context, m.status());
  *response = api_->Metadata(**m);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ModelConfig(grpc::CallbackServerContext* context,
                                                     const inference::ModelConfigRequest* request,
                                                     inference::ModelConfigResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  absl::StatusOr<const ServedModel*> m = api_->FindModel(request->name(), request->version());
  if (!m.ok()) return Done(context, m.status());
  *response->mutable_config() = api_->Config(**m);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  if (grpc::ServerUnaryReactor* refused = RefuseUnauthenticated(context)) return refused;
  absl::StatusOr<inference::ModelStatisticsResponse> stats =
      api_->Statistics(request->name(), request->version());
  if (!stats.ok()) return Done(context, stats.status());
  *response = *std::move(stats);
  return Done(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeService::ModelInfer(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* raw,
                                                    grpc::ByteBuffer* raw_response) {
  if (grpc::Status auth = api_keys_->Check(*context); !auth.ok()) {
    api_->generation()->CountRefused(kApi, auth.error_code());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(auth);
    return reactor;
  }
  absl::StatusOr<Started> started = ParseAndAdmit(api_, *raw, /*unary=*/true);
  if (!started.ok()) return Done(context, started.status());
  auto* call = new InferCall(api_, raw_response, *std::move(started), context->deadline());
  call->Start();
  return call;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KServeService::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  return new StreamCall(api_, api_keys_->Check(*context));
}

}  // namespace kvgrid::coordinator
