// kvgrid generate: stream a continuation of a prompt, or a reply to a chat message, from a
// running cluster (kvgrid serve, or a coordinator anywhere) through the public Generation API.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/cluster_client.h"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/sampling_flags.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid generate [--addr HOST:PORT] (--prompt TEXT | --prompt-ids 1,2,3 |\n"
    "                       --chat TEXT [--system TEXT]) [flags]\n"
    "\n"
    "  --addr HOST:PORT            coordinator (default 127.0.0.1:50051)\n"
    "  --model NAME                served model (default: the cluster's only one)\n"
    "  --prompt TEXT | --prompt-ids IDS   prompt as text or comma-separated token ids\n"
    "  --chat TEXT                 a user message instead, rendered by the model's chat\n"
    "                              template (kvgrid chat holds a whole conversation)\n"
    "  --system TEXT               a system message before it\n"
    "  --chat-template-kwargs JSON extra template variables, e.g. '{\"enable_thinking\": false}'\n"
    "  --add-bos                   prepend the model's BOS token (never twice)\n"
    "  --max-new-tokens N          default: the model's generation_config.json, else 16\n"
    "  --temperature T             0 = greedy (default: generation_config.json, else 1)\n"
    "  --top-p P --top-k K --min-p P --repetition-penalty R --seed S\n"
    "  --presence-penalty P --frequency-penalty F   OpenAI's, over the generated tokens\n"
    "  --logit-bias ID:BIAS,...    add BIAS (in [-100, 100]) to each token id's logit\n"
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
  KVGRID_ASSIGN_OR_RETURN(const ConnectionFlags conn, ReadConnectionFlags(args));
  const std::string& addr = conn.addr;
  v1::GenerateRequest req;
  if (auto model = args.GetString("model")) req.set_model(*model);
  const std::optional<std::string> prompt = args.GetString("prompt");
  const absl::StatusOr<std::optional<std::vector<int32_t>>> prompt_ids =
      args.GetIntList("prompt-ids");
  if (!prompt_ids.ok()) return prompt_ids.status();
  const std::optional<std::string> chat = args.GetString("chat");
  const std::optional<std::string> system = args.GetString("system");
  const std::optional<std::string> kwargs = args.GetString("chat-template-kwargs");
  KVGRID_ASSIGN_OR_RETURN(bool add_bos, args.GetBool("add-bos", false));
  KVGRID_ASSIGN_OR_RETURN(bool json, args.GetBool("json", false));
  KVGRID_ASSIGN_OR_RETURN(const SamplingFlags f, ReadSamplingFlags(args));
  KVGRID_ASSIGN_OR_RETURN(auto logprobs, args.GetInt("logprobs"));
  KVGRID_ASSIGN_OR_RETURN(auto n, args.GetInt("n"));
  KVGRID_ASSIGN_OR_RETURN(auto priority, args.GetInt("priority"));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (prompt.has_value() + prompt_ids->has_value() + chat.has_value() != 1) {
    return absl::InvalidArgumentError("give exactly one of --prompt, --prompt-ids and --chat");
  }
  if ((system || kwargs) && !chat) {
    return absl::InvalidArgumentError(
        absl::StrCat(system ? "--system" : "--chat-template-kwargs", ": only with --chat"));
  }
  if (prompt) req.set_prompt(*prompt);
  if (prompt_ids->has_value()) {
    req.mutable_prompt_token_ids()->Add((*prompt_ids)->begin(), (*prompt_ids)->end());
  }
  if (chat) {
    if (system) {
      v1::ChatMessage* m = req.add_messages();
      m->set_role("system");
      m->set_content(*system);
    }
    v1::ChatMessage* m = req.add_messages();
    m->set_role("user");
    m->set_content(*chat);
    if (kwargs) req.set_chat_template_kwargs_json(*kwargs);
  }
  req.set_add_bos(add_bos);
  ApplySamplingFlags(f, &req);
  if (logprobs) req.mutable_sampling()->set_logprobs(static_cast<int32_t>(*logprobs));
  if (n) req.set_n(static_cast<uint32_t>(std::max<int64_t>(0, *n)));
  if (priority) req.set_priority(static_cast<int32_t>(*priority));

  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<v1::Generation::Stub> stub, Connect(conn));
  const auto start = std::chrono::steady_clock::now();
  const bool stream = !json && std::max<uint32_t>(1, req.n()) == 1;
  bool printed = false;
  absl::StatusOr<std::vector<Continuation>> done =
      StreamGenerate(*stub, conn, req, [&](uint32_t, const std::string& text) {
        if (!stream || text.empty()) return;
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
        printed = true;
      });
  if (!done.ok()) {
    if (printed) std::printf("\n");
    return done.status();
  }
  const std::vector<Continuation>& out = *done;
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
