// Runs a kernel's blocks on the calling host thread: one fiber per emulated thread, switched
// cooperatively at the block and warp barriers (and so at every shuffle).
#ifndef KVGRID_TESTS_CUDA_EMU_BLOCK_RUNNER_H_
#define KVGRID_TESTS_CUDA_EMU_BLOCK_RUNNER_H_

#include <functional>
#include <string>

#include "tests/cuda_emu/kernel_api.h"

namespace kvgrid::cuda_emu {

// Runs `body` for every thread of every block of `config`, blocks in order. Returns an empty
// string, or what went wrong: a deadlock (threads waiting at barriers that can never all be
// reached), a warp-synchronous call naming a lane that has exited or that does not exist.
// A failed block ends the launch. Not reentrant: the runtime serializes launches.
std::string RunGrid(const LaunchConfig& config, const std::function<void()>& body);

}  // namespace kvgrid::cuda_emu

#endif  // KVGRID_TESTS_CUDA_EMU_BLOCK_RUNNER_H_
