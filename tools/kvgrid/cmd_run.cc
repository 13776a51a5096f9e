#include <cstdio>
#include "tools/kvgrid/commands.h"
namespace kvgrid::cli {
int RunCommand(Args& args) { std::fputs("kvgrid run: not built yet\n", stderr); return 1; }
}  // namespace kvgrid::cli
