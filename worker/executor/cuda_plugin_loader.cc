#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "worker/executor/cuda_plugin.h"

namespace kvgrid::worker {

namespace {

std::string PluginPath() {
  if (const char* env = std::getenv("KVGRID_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
    return env;
  }
  char exe[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return "libkvgrid_cuda_plugin.so";
  exe[n] = '\0';
  return (std::filesystem::path(exe).parent_path() / "libkvgrid_cuda_plugin.so").string();
}

}  // namespace

absl::StatusOr<CreateCudaExecutorFn> LoadCudaPlugin() {
  static std::once_flag once;
  static absl::StatusOr<CreateCudaExecutorFn> loaded =
      absl::FailedPreconditionError("not loaded");
  std::call_once(once, [] {
    const std::string path = PluginPath();
    // RTLD_LOCAL: in a static build the plugin's own copy of kvgrid's code stays its own (a
    // shared build loads one copy of each kvgrid library, which both use).
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      loaded = absl::FailedPreconditionError(absl::StrCat(
          "--device cuda: cannot load the CUDA plugin ", path, " (", why ? why : "?",
          "); build kvgrid with CUDA (the target kvgrid_cuda_plugin, or everything), or set "
          "KVGRID_CUDA_PLUGIN"));
      return;
    }
    void* symbol = dlsym(handle, kCreateCudaExecutorSymbol);
    if (symbol == nullptr) {
      loaded = absl::FailedPreconditionError(
          absl::StrCat("--device cuda: ", path, " has no ", kCreateCudaExecutorSymbol));
      return;
    }
    loaded = reinterpret_cast<CreateCudaExecutorFn>(symbol);
  });
  return loaded;
}

}  // namespace kvgrid::worker
