// The CUDA emulator's kernel side: what an emulated thread asks of the block it runs in, and
// how a `kernel<<<grid, block, shared, stream>>>(args)` launch reaches the runtime.
//
// The emulator runs CUDA C++ on the CPU so that the `gpu` tests exercise the kernels' indexing,
// synchronization and numerics, and the host code's streams, graphs and copies, on machines
// without a GPU. Every emulated thread of a block is a fiber; blocks run one after another on
// the launching host thread. A launch runs synchronously (or is recorded, while its stream is
// being captured into a graph), which is one valid order of what a GPU may do.
//
// What it cannot show: real-hardware timing, memory-model races between blocks, the exact
// results of the device's fast math, and any limit it does not check (see runtime.cc).
#ifndef KVGRID_TESTS_CUDA_EMU_KERNEL_API_H_
#define KVGRID_TESTS_CUDA_EMU_KERNEL_API_H_

#include <cuda_runtime_api.h>
#include <vector_types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvgrid::cuda_emu {

// Dynamic shared memory a block may have with cudaFuncSetAttribute (an H100's or H200's).
constexpr size_t kSharedMemoryOptinBytes = 227 * 1024;

// The built-in variables of the emulated thread running now.
struct ThreadPlace {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
};

// Only valid inside a kernel body.
const ThreadPlace& Place();
// __syncthreads(): waits until every thread of the block that has not exited arrives.
void BlockBarrier();
// __syncwarp(mask): waits until every lane in `mask` of the caller's warp arrives. A lane of
// `mask` that has exited, or that is not the caller's, is a kernel fault.
void WarpBarrier(unsigned mask);
// The shuffles: publishes `bits` for the caller's lane, waits for the lanes in `mask`, returns
// lane `src_lane`'s bits (the caller's own when src_lane < 0).
uint64_t WarpExchange(unsigned mask, uint64_t bits, int src_lane);
// The block's `extern __shared__` memory (the launch's dynamic shared bytes).
void* DynamicShared();
// Fills a static __shared__ variable with all-ones bytes the first time the running block
// reaches its declaration (later threads of the block find it done).
void PoisonShared(void* p, size_t bytes);

// Where a launch was written, for error messages.
struct LaunchSite {
  const char* file = "";
  int line = 0;
};

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
  const void* kernel = nullptr;
  LaunchSite site;
};

// Checks the configuration as the CUDA runtime would (the error is then what
// cudaGetLastError returns) and runs `body` once per thread of every block, or records the
// launch when the stream is capturing. A pointer argument (`pointers`) that is neither null nor
// in device or pinned memory is a sticky fault, as the GPU's illegal address would be.
void SubmitKernel(const LaunchConfig& config, const std::vector<const void*>& pointers,
                  std::function<void()> body);

template <typename T>
void CollectPointer(std::vector<const void*>& out, const T& value) {
  if constexpr (std::is_pointer_v<T>) out.push_back(static_cast<const void*>(value));
}

template <typename... A>
struct PendingLaunch {
  LaunchConfig config;
  std::tuple<A...> args;
};

struct Launcher {
  LaunchConfig config;
  template <typename... A>
  PendingLaunch<std::decay_t<A>...> operator()(A&&... args) && {
    return {config, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

// `kernel<<<g, b, s, st>>>(args)` is rewritten to `kernel ^ Launch(__FILE__, __LINE__, g, b,
// s, st)(args)`: the launch parameters bind first, then operator^ receives the kernel.
inline Launcher Launch(const char* file, int line, dim3 grid, dim3 block, size_t shared = 0,
                       cudaStream_t stream = nullptr) {
  Launcher l;
  l.config.grid = grid;
  l.config.block = block;
  l.config.shared_bytes = shared;
  l.config.stream = stream;
  l.config.site = {file, line};
  return l;
}

// The arguments are converted to the kernel's parameter types once, at the launch, as CUDA
// does; each thread then gets its own copy of them.
template <typename... P, typename... A>
void operator^(void (*kernel)(P...), PendingLaunch<A...>&& launch) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
  launch.config.kernel = reinterpret_cast<const void*>(kernel);
  std::tuple<P...> params = std::make_from_tuple<std::tuple<P...>>(std::move(launch.args));
  std::vector<const void*> pointers;
  std::apply([&pointers](const auto&... p) { (CollectPointer(pointers, p), ...); }, params);
  SubmitKernel(launch.config, pointers, [kernel, params]() { std::apply(kernel, params); });
}

}  // namespace kvgrid::cuda_emu

#endif  // KVGRID_TESTS_CUDA_EMU_KERNEL_API_H_
