// kvgrid generate: stream a continuation from a running cluster (kvgrid serve, or a
// coordinator anywhere) through the public Generation API.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "auth/bearer_auth.h"
#include "auth/tls.h"
#include "grpcpp/grpcpp.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/grpc_status.h"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/sampling_flags.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid generate [--addr HOST:PORT] (--prompt TEXT | --prompt-ids 1,2,3) [flags]\n"
    "\n"
    "  --addr HOST:PORT            coordinator (default 127.0.0.1:50051)\n"
    "  --model NAME                served model (default: the cluster's only one)\n"
    "  --prompt TEXT | --prompt-ids IDS   prompt as text or comma-separated token ids\n"
    "  --add-bos                   prepend the model's BOS token to a text prompt\n"
    "  --max-new-tokens N          default: the model's generation_config.json, else 16\n"
    "  --temperature T             0 = greedy (default: generation_config.json, else 1)\n"
    "  --top-p P --top-k K --min-p P --repetition-penalty R --seed S\n"
    "  --ignore-eos --stop TEXT --stop-token-ids IDS --include-stop-str-in-output\n"
    "  --min-tokens N --logprobs K --n N --priority P\n"
    "  --timeout-s S               deadline for the whole call\n"
    "  --api-key KEY               sent as 'authorization: Bearer KEY' (default:\n"
    "                              $KVGRID_API_KEY)\n"
    "  --tls                       connect with TLS (system roots); --tls-ca F verifies the\n"
    "                              server against F (implies --tls); --tls-cert F --tls-key F\n"
    "                              present a client certificate (mTLS)\n"
    "  --json                      print one JSON object per continuation at the end\n";

absl::Status Generate(Args& args) {
  const std::string addr = args.GetString("addr").value_or("127.0.0.1:50051");
  v1::GenerateRequest req;
  if (auto model = args.GetString("model")) req.set_model(*model);
  const std::optional<std::string> prompt = args.GetString("prompt");
  const absl::StatusOr<std::optional<std::vector<int32_t>>> prompt_ids =
      args.GetIntList("prompt-ids");
  if (!prompt_ids.ok()) return prompt_ids.status();
  KVGRID_ASSIGN_OR_RETURN(bool add_bos, args.GetBool("add-bos", false));
  KVGRID_ASSIGN_OR_RETURN(bool json, args.GetBool("json", false));
  KVGRID_ASSIGN_OR_RETURN(const SamplingFlags f, ReadSamplingFlags(args));
  KVGRID_ASSIGN_OR_RETURN(auto logprobs, args.GetInt("logprobs"));
  KVGRID_ASSIGN_OR_RETURN(auto n, args.GetInt("n"));
  KVGRID_ASSIGN_OR_RETURN(auto priority, args.GetInt("priority"));
  KVGRID_ASSIGN_OR_RETURN(auto timeout_s, args.GetDouble("timeout-s"));
  std::optional<std::string> api_key = args.GetString("api-key");
  if (!api_key) {
    if (const char* env = std::getenv("KVGRID_API_KEY")) api_key = env;
  }
  const auth::TlsFiles tls_files{.cert = args.GetString("tls-cert"),
                                 .key = args.GetString("tls-key"),
                                 .ca = args.GetString("tls-ca")};
  KVGRID_ASSIGN_OR_RETURN(const bool tls, args.GetBool("tls", tls_files.ca.has_value()));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (prompt.has_value() == prompt_ids->has_value()) {
    return absl::InvalidArgumentError("give exactly one of --prompt and --prompt-ids");
  }
  if (prompt) req.set_prompt(*prompt);
  if (prompt_ids->has_value()) {
    req.mutable_prompt_token_ids()->Add((*prompt_ids)->begin(), (*prompt_ids)->end());
  }
  req.set_add_bos(add_bos);
  v1::SamplingParams* s = req.mutable_sampling();
  if (f.temperature) s->set_temperature(static_cast<float>(*f.temperature));
  if (f.top_p) s->set_top_p(static_cast<float>(*f.top_p));
  if (f.top_k) s->set_top_k(static_cast<int32_t>(*f.top_k));
  if (f.min_p) s->set_min_p(static_cast<float>(*f.min_p));
  if (f.repetition_penalty) s->set_repetition_penalty(static_cast<float>(*f.repetition_penalty));
  if (f.seed) s->set_seed(static_cast<uint64_t>(*f.seed));
  if (logprobs) s->set_logprobs(static_cast<int32_t>(*logprobs));
  v1::StoppingParams* st = req.mutable_stopping();
  if (f.max_new_tokens) st->set_max_new_tokens(static_cast<int32_t>(*f.max_new_tokens));
  if (f.min_tokens) st->set_min_tokens(static_cast<int32_t>(*f.min_tokens));
  st->set_ignore_eos(f.ignore_eos);
  if (f.stop_token_ids) for (int32_t id : *f.stop_token_ids) st->add_stop_token_ids(id);
  if (f.stop) st->add_stop(*f.stop);
  st->set_include_stop_str_in_output(f.include_stop_str_in_output);
  if (n) req.set_n(static_cast<uint32_t>(std::max<int64_t>(0, *n)));
  if (priority) req.set_priority(static_cast<int32_t>(*priority));

  KVGRID_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                          auth::ChannelCredentials(tls, tls_files));
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(addr, credentials));
  grpc::ClientContext ctx;
  auth::AttachBearer(&ctx, api_key.value_or(""));
  if (timeout_s) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         std::chrono::duration<double>(*timeout_s)));
  }
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&ctx, req);
  struct Continuation {
    std::vector<int32_t> ids;
    std::string text, finish, worker;
    v1::Usage usage;
    v1::Timings timings;
  };
  std::vector<Continuation> out(std::max<uint32_t>(1, req.n()));
  v1::GenerateResponse msg;
  const bool stream = !json && out.size() == 1;
  while (reader->Read(&msg)) {
    if (msg.index() >= out.size()) continue;
    Continuation& c = out[msg.index()];
    c.ids.insert(c.ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    c.text += msg.text();
    c.worker = msg.worker_id();
    if (stream && !msg.text().empty()) {
      std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
      std::fflush(stdout);
    }
    if (msg.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      c.finish = msg.finish_reason() == v1::FINISH_REASON_STOP ? "stop" : "length";
      c.usage = msg.usage();
      c.timings = msg.timings();
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    if (stream) std::printf("\n");
    return absl::Status(proto::FromGrpcStatus(status).code(),
                        absl::StrCat(addr, ": ", status.error_message()));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t generated = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const Continuation& c = out[i];
    generated += static_cast<int64_t>(c.ids.size());
    if (json) {
      nlohmann::json j = {{"index", i},
                          {"text", c.text},
                          {"token_ids", c.ids},
                          {"tokens", c.ids.size()},
                          {"finish_reason", c.finish},
                          {"prompt_tokens", c.usage.prompt_tokens()},
                          {"cached_prompt_tokens", c.usage.cached_prompt_tokens()},
                          {"first_token_s", c.timings.first_token_s()},
                          {"finished_s", c.timings.finished_s()},
                          {"worker_id", c.worker}};
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    } else if (!stream) {
      std::printf("### %zu\n%s\n[%zu tokens, %s]\n\n", i, c.text.c_str(), c.ids.size(),
                  c.finish.c_str());
    }
  }
  if (stream) std::printf("\n");
  std::fflush(stdout);
  std::fprintf(stderr, "[%lld tokens in %.2f s from %s, finish: %s, first token after %.3f s]\n",
               static_cast<long long>(generated), seconds, addr.c_str(), out[0].finish.c_str(),
               out[0].timings.first_token_s());
  return absl::OkStatus();
}

}  // namespace

int GenerateCommand(Args& args) { return RunSubcommand(args, "generate", kHelp, Generate); }

}  // namespace kvgrid::cli
