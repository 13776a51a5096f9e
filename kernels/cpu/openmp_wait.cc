#include "kernels/cpu/openmp_wait.h"

#include <unistd.h>

#include <cstdlib>

namespace kvgrid::kernels::cpu {

void ChooseOpenMpWaitPolicy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT") ||
      std::getenv(kOpenMpWaitChosenEnv)) {
    return;
  }
  setenv("GOMP_SPINCOUNT", kOpenMpSpinCount, 1);
  setenv(kOpenMpWaitChosenEnv, "1", 1);
  execv("/proc/self/exe", argv);
  // Only reached when the exec failed: libgomp keeps the policy it started with.
}

}  // namespace kvgrid::kernels::cpu
