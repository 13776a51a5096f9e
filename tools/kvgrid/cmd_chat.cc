// kvgrid chat: a conversation with a model on a running cluster. Each line read from stdin is
// a user message; the whole conversation so far (replies included, as assistant messages) is
// sent each turn, rendered by the model's chat template on the coordinator, and the reply is
// streamed to stdout. Works the same with stdin piped (a script, a test): one reply per input
// line, each ended by a newline.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "model/status_macros.h"
#include "tools/kvgrid/cluster_client.h"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/sampling_flags.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid chat [--addr HOST:PORT] [--system TEXT] [flags]\n"
    "\n"
    "Reads user messages from stdin, one per line, and streams each reply to stdout; the\n"
    "conversation is kept, so every turn sees the earlier ones. Ends at end of input or a\n"
    "line '/exit'; '/reset' starts a new conversation (the system message stays).\n"
    "\n"
    "  --addr HOST:PORT            coordinator (default 127.0.0.1:50051)\n"
    "  --model NAME                served model (default: the cluster's only one)\n"
    "  --system TEXT               the system message\n"
    "  --chat-template-kwargs JSON extra template variables, e.g. '{\"enable_thinking\": false}'\n"
    "  --max-new-tokens N          per reply (default: generation_config.json, else 16)\n"
    "  --temperature T --top-p P --top-k K --min-p P --repetition-penalty R --seed S\n"
    "  --presence-penalty P --frequency-penalty F --logit-bias ID:BIAS,...\n"
    "  --ignore-eos --stop TEXT --stop-token-ids IDS --include-stop-str-in-output\n"
    "  --min-tokens N\n"
    "  --timeout-s S               deadline of each reply\n"
    "  --api-key KEY --tls --tls-ca F --tls-cert F --tls-key F   as for kvgrid generate\n"
    "  --stats                     after each reply, its tokens and finish reason on stderr\n"
    "                              (default: when stdin is a terminal)\n";

absl::Status Chat(Args& args) {
  KVGRID_ASSIGN_OR_RETURN(const ConnectionFlags conn, ReadConnectionFlags(args));
  v1::GenerateRequest base;
  if (auto model = args.GetString("model")) base.set_model(*model);
  const std::optional<std::string> system = args.GetString("system");
  if (auto kwargs = args.GetString("chat-template-kwargs")) {
    base.set_chat_template_kwargs_json(*kwargs);
  }
  KVGRID_ASSIGN_OR_RETURN(const SamplingFlags f, ReadSamplingFlags(args));
  const bool interactive = isatty(STDIN_FILENO) != 0;
  KVGRID_ASSIGN_OR_RETURN(const bool stats, args.GetBool("stats", interactive));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  ApplySamplingFlags(f, &base);
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<v1::Generation::Stub> stub, Connect(conn));

  auto reset = [&] {
    base.clear_messages();
    if (system) {
      v1::ChatMessage* m = base.add_messages();
      m->set_role("system");
      m->set_content(*system);
    }
  };
  reset();
  std::string line;
  for (;;) {
    if (interactive) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    if (!std::getline(std::cin, line)) break;
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty()) continue;
    if (text == "/exit" || text == "/quit") break;
    if (text == "/reset") {
      reset();
      continue;
    }
    v1::ChatMessage* user = base.add_messages();
    user->set_role("user");
    user->set_content(std::string(text));
    absl::StatusOr<std::vector<Continuation>> reply =
        StreamGenerate(*stub, conn, base, [](uint32_t, const std::string& piece) {
          if (piece.empty()) return;
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
        });
    std::fputc('\n', stdout);
    std::fflush(stdout);
    if (!reply.ok()) {
      // The turn did not happen: the conversation goes on without it when a person is
      // typing; a script learns of it by the exit code.
      base.mutable_messages()->RemoveLast();
      if (!interactive) return reply.status();
      std::fprintf(stderr, "kvgrid chat: %s\n", std::string(reply.status().message()).c_str());
      continue;
    }
    const Continuation& c = reply->front();
    v1::ChatMessage* assistant = base.add_messages();
    assistant->set_role("assistant");
    assistant->set_content(c.text);
    if (stats) {
      std::fprintf(stderr, "[%zu tokens, finish: %s, prompt %d tokens]\n", c.ids.size(),
                   c.finish.c_str(), c.usage.prompt_tokens());
    }
  }
  return absl::OkStatus();
}

}  // namespace

int ChatCommand(Args& args) { return RunSubcommand(args, "chat", kHelp, Chat); }

}  // namespace kvgrid::cli
