#include "kernels/cpu/openmp_wait.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace kvgrid::kernels::cpu {

void ChooseOpenMpWaitPolicy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") ||
      std::getenv(kOpenMpWaitChosenEnv)) {
    return;
  }
  setenv("GOMP_SPINCOUNT", kOpenMpSpinCount, 1);
  setenv(kOpenMpWaitChosenEnv, "1", 1);
  // The command line as the kernel started it, which is argv unless the program was started
  // through its dynamic loader (`ld-linux-x86-64.so.2 --library-path DIR prog args`, as
  // tools/gpu-check.sh runs the GPU bundle): then /proc/self/exe is the loader, which must get
  // its own arguments again, not the program's.
  std::vector<std::string> words;
  if (std::ifstream cmdline("/proc/self/cmdline", std::ios::binary); cmdline) {
    for (std::string word; std::getline(cmdline, word, '\0');) words.push_back(word);
  }
  std::vector<char*> args;
  for (std::string& w : words) args.push_back(w.data());
  args.push_back(nullptr);
  execv("/proc/self/exe", words.empty() ? argv : args.data());
  // Only reached when the exec failed: libgomp keeps the policy it started with.
}

}  // namespace kvgrid::kernels::cpu
