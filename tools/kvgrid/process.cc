#include "tools/kvgrid/process.h"

#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace kvgrid::cli {
namespace {

sigset_t ShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

std::filesystem::path SelfDir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::current_path() : exe.parent_path();
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty;
  sigemptyset(&empty);
  const sigset_t defaults = ShutdownSignals();
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, cargv[0], nullptr, &attr, cargv.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  return pid;
}

int ServiceMain(int argc, char** argv, const char* name, const char* help,
                absl::Status (*body)(Args& args)) {
  const sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto args = Args::Parse(argc, argv, 1);
  if (!args.ok()) {
    std::fprintf(stderr, "kvgrid-%s: %s\n", name, std::string(args.status().message()).c_str());
    return 2;
  }
  args->UseEnvironment("KVGRID_");
  return RunSubcommand(*args, name, help, body);
}

int WaitForShutdownSignal() {
  const sigset_t signals = ShutdownSignals();
  int signal = 0;
  sigwait(&signals, &signal);
  return signal;
}

}  // namespace kvgrid::cli
