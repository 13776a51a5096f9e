#include <cstdio>
#include "tools/kvgrid/commands.h"
namespace kvgrid::cli {
int LogitsCommand(Args& args) { std::fputs("kvgrid logits: not built yet\n", stderr); return 1; }
}  // namespace kvgrid::cli
