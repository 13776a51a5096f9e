#include <cstdio>
#include "tools/kvgrid/commands.h"
namespace kvgrid::cli {
int TokenizeCommand(Args& args) { std::fputs("kvgrid tokenize: not built yet\n", stderr); return 1; }
}  // namespace kvgrid::cli
