// Subcommands of the kvgrid CLI. Each parses its own flags from `args` and returns the
// process exit code; errors are printed to stderr as "kvgrid <cmd>: <message>".
#ifndef KVGRID_TOOLS_KVGRID_COMMANDS_H_
#define KVGRID_TOOLS_KVGRID_COMMANDS_H_

#include "tools/kvgrid/args.h"

namespace kvgrid::cli {

// run: stream a continuation of --prompt (or --prompt-ids) to stdout.
int RunCommand(Args& args);
// logits: last-position logits after prefilling --prompt-ids and decoding --decode-ids.
int LogitsCommand(Args& args);
// perplexity: held-out perplexity of a text file through the paged KV cache.
int PerplexityCommand(Args& args);
// tokenize: JSON lines in (strings), JSON lines out (ids), against a tokenizer.json.
int TokenizeCommand(Args& args);
// serve: a local cluster (coordinator + worker processes on loopback) until interrupted.
int ServeCommand(Args& args);
// generate: stream a continuation (or a reply to one chat message) from a running cluster.
int GenerateCommand(Args& args);
// chat: a multi-turn conversation with a model on a running cluster, from stdin.
int ChatCommand(Args& args);
// chat-template: render a chat template file for a request, as the server does.
int ChatTemplateCommand(Args& args);
// gguf-info: the metadata and tensors of a GGUF file, or one tensor's values.
int GgufInfoCommand(Args& args);
// plan: KV bytes per token, max tokens and max sequences per dtype for a memory budget.
int PlanCommand(Args& args);

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_COMMANDS_H_
