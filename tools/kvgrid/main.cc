// kvgrid: command-line entry point.
#include <cstdio>
#include <cstring>
#include <string>

#include "kernels/cpu/openmp_wait.h"
#include "tools/kvgrid/args.h"
#include "tools/kvgrid/commands.h"

namespace {

constexpr char kUsage[] =
    "usage: kvgrid <command> [flags]\n"
    "\n"
    "commands:\n"
    "  serve      start a local cluster: coordinator + worker processes on loopback\n"
    "  generate   stream a continuation from a running cluster\n"
    "  chat       a conversation with a model on a running cluster (lines from stdin)\n"
    "  chat-template  render a chat template for a request, as the server does\n"
    "  run        stream a continuation of a prompt in-process (default: the embedded model)\n"
    "  logits     print last-position logits as JSON (for reference checks)\n"
    "  perplexity held-out perplexity of a text file\n"
    "  tokenize   encode/decode JSON lines with a tokenizer.json or a .gguf file\n"
    "  plan       KV capacity per dtype for a model and a memory budget\n"
    "  gguf-info  the metadata and tensors of a GGUF file\n"
    "\n"
    "run 'kvgrid <command> --help' for the flags of a command.\n";

}  // namespace

int main(int argc, char** argv) {
  // A local cluster's workers share the machine's cores (kernels/cpu/openmp_wait.h).
  if (argc >= 2 && !std::strcmp(argv[1], "serve")) {
    kvgrid::kernels::cpu::ChooseOpenMpWaitPolicy(argv);  // may start the program again
  }
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  auto args = kvgrid::cli::Args::Parse(argc, argv, 2);
  if (!args.ok()) {
    std::fprintf(stderr, "kvgrid %s: %s\n", command.c_str(),
                 std::string(args.status().message()).c_str());
    return 2;
  }
  if (command == "serve") return kvgrid::cli::ServeCommand(*args);
  if (command == "generate") return kvgrid::cli::GenerateCommand(*args);
  if (command == "chat") return kvgrid::cli::ChatCommand(*args);
  if (command == "chat-template") return kvgrid::cli::ChatTemplateCommand(*args);
  if (command == "run") return kvgrid::cli::RunCommand(*args);
  if (command == "logits") return kvgrid::cli::LogitsCommand(*args);
  if (command == "perplexity") return kvgrid::cli::PerplexityCommand(*args);
  if (command == "tokenize") return kvgrid::cli::TokenizeCommand(*args);
  if (command == "plan") return kvgrid::cli::PlanCommand(*args);
  if (command == "gguf-info") return kvgrid::cli::GgufInfoCommand(*args);
  std::fprintf(stderr, "kvgrid: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}
