// Process plumbing shared by the programs that start or are kvgrid processes: spawning child
// processes, finding sibling executables, and the entry point of the long-running services
// (kvgrid-coordinator, kvgrid-worker).
#ifndef KVGRID_TOOLS_KVGRID_PROCESS_H_
#define KVGRID_TOOLS_KVGRID_PROCESS_H_

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tools/kvgrid/args.h"

namespace kvgrid::cli {

// The directory of the running executable (where its sibling binaries are).
std::filesystem::path SelfDir();

// Starts `argv` (argv[0] a path) with an empty signal mask and default SIGTERM/SIGINT
// handling, whatever the caller blocks. Errors: INTERNAL with errno's text.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv);

// main() of a service: blocks SIGTERM and SIGINT before any thread starts (the service waits
// for them with WaitForShutdownSignal), parses flags, lets KVGRID_* environment variables
// stand in for absent flags, and runs `body` as RunSubcommand does.
int ServiceMain(int argc, char** argv, const char* name, const char* help,
                absl::Status (*body)(Args& args));

// Blocks until SIGTERM or SIGINT (which ServiceMain blocked); returns the signal.
int WaitForShutdownSignal();

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_PROCESS_H_
