#include "tools/kvgrid/cluster_client.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "auth/bearer_auth.h"
#include "grpcpp/grpcpp.h"
#include "model/status_macros.h"
#include "proto/grpc_status.h"

namespace kvgrid::cli {

absl::StatusOr<ConnectionFlags> ReadConnectionFlags(Args& args) {
  ConnectionFlags f;
  f.addr = args.GetString("addr").value_or("127.0.0.1:50051");
  if (std::optional<std::string> key = args.GetString("api-key")) {
    f.api_key = *key;
  } else if (const char* env = std::getenv("KVGRID_API_KEY")) {
    f.api_key = env;
  }
  f.tls_files = {.cert = args.GetString("tls-cert"),
                 .key = args.GetString("tls-key"),
                 .ca = args.GetString("tls-ca")};
  KVGRID_ASSIGN_OR_RETURN(f.tls, args.GetBool("tls", f.tls_files.ca.has_value()));
  KVGRID_ASSIGN_OR_RETURN(f.timeout_s, args.GetDouble("timeout-s"));
  return f;
}

absl::StatusOr<std::unique_ptr<v1::Generation::Stub>> Connect(const ConnectionFlags& flags) {
  KVGRID_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                          auth::ChannelCredentials(flags.tls, flags.tls_files));
  return v1::Generation::NewStub(grpc::CreateChannel(flags.addr, credentials));
}

void ApplySamplingFlags(const SamplingFlags& f, v1::GenerateRequest* req) {
  v1::SamplingParams* s = req->mutable_sampling();
  if (f.temperature) s->set_temperature(static_cast<float>(*f.temperature));
  if (f.top_p) s->set_top_p(static_cast<float>(*f.top_p));
  if (f.top_k) s->set_top_k(static_cast<int32_t>(*f.top_k));
  if (f.min_p) s->set_min_p(static_cast<float>(*f.min_p));
  if (f.repetition_penalty) s->set_repetition_penalty(static_cast<float>(*f.repetition_penalty));
  if (f.presence_penalty) s->set_presence_penalty(static_cast<float>(*f.presence_penalty));
  if (f.frequency_penalty) s->set_frequency_penalty(static_cast<float>(*f.frequency_penalty));
  for (const auto& [id, bias] : f.logit_bias) (*s->mutable_logit_bias())[id] = bias;
  if (f.seed) s->set_seed(static_cast<uint64_t>(*f.seed));
  v1::StoppingParams* st = req->mutable_stopping();
  if (f.max_new_tokens) st->set_max_new_tokens(static_cast<int32_t>(*f.max_new_tokens));
  if (f.min_tokens) st->set_min_tokens(static_cast<int32_t>(*f.min_tokens));
  st->set_ignore_eos(f.ignore_eos);
  if (f.stop_token_ids) for (int32_t id : *f.stop_token_ids) st->add_stop_token_ids(id);
  if (f.stop) st->add_stop(*f.stop);
  st->set_include_stop_str_in_output(f.include_stop_str_in_output);
}

absl::StatusOr<std::vector<Continuation>> StreamGenerate(
    v1::Generation::Stub& stub, const ConnectionFlags& flags, const v1::GenerateRequest& request,
    const std::function<void(uint32_t index, const std::string& text)>& on_text) {
  grpc::ClientContext ctx;
  auth::AttachBearer(&ctx, flags.api_key);
  if (flags.timeout_s) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(*flags.timeout_s)));
  }
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, request);
  std::vector<Continuation> out(std::max<uint32_t>(1, request.n()));
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.index() >= out.size()) continue;
    Continuation& c = out[msg.index()];
    c.ids.insert(c.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    c.text += msg.text();
    c.worker = msg.worker_id();
    if (on_text) on_text(msg.index(), msg.text());
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      c.finish = msg.finish_reason() == v1::FINISH_REASON_STOP ? "stop" : "length";
      c.usage = msg.usage();
      c.timings = msg.timings();
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    return absl::Status(proto::FromGrpcStatus(status).code(),
                        absl::StrCat(flags.addr, ": ", status.error_message()));
  }
  return out;
}

}  // namespace kvgrid::cli
