// The CUDA runtime API as the emulator provides it (see runtime.h): the functions kvgrid's
// kernels, executor and tests call, defined against the toolkit's declarations.
#include "tests/cuda_emu/runtime.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tests/cuda_emu/block_runner.h"
#include "tests/cuda_emu/kernel_api.h"

using Work = std::function<void()>;

struct CUstream_st {
  unsigned flags = cudaStreamDefault;  // cudaStreamNonBlocking: no implicit sync with legacy
  // Written under capture_mu; read without it by the stream's own calls.
  std::atomic<bool> capturing{false};
  std::atomic<bool> invalidated{false};
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id owner;
  std::vector<Work> nodes;  // recorded by the capture
  std::mutex mu;            // guards pending; held while it runs
  std::vector<Work> pending;  // enqueued, not yet run (deferred streams)
};

struct CUgraph_st {
  std::vector<Work> nodes;
};

struct CUgraphExec_st {
  // Shared with launches still queued: CUDA lets an exec be destroyed while they run.
  std::shared_ptr<const std::vector<Work>> nodes;
};

struct EventTime {
  std::chrono::steady_clock::time_point time;
  bool recorded = false;
};

struct CUevent_st {
  std::shared_ptr<EventTime> time = std::make_shared<EventTime>();  // shared with queued records
  bool captured = false;  // last recorded into a capturing stream: it cannot be waited on
  cudaStream_t stream = nullptr;  // where it was last recorded (maybe destroyed since)
};

namespace kvgrid::cuda_emu {
namespace {

constexpr size_t kAlign = 256;                  // cudaMalloc's alignment
constexpr int kSharedOptin = static_cast<int>(kSharedMemoryOptinBytes);
constexpr int kSharedDefault = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kDefaultMemory = size_t{2} << 30;

struct Allocation {
  char* mapping = nullptr;
  size_t mapping_bytes = 0;
  size_t bytes = 0;
  bool device = true;
};

std::mutex mem_mu;
std::map<uintptr_t, Allocation> allocations;  // by the pointer handed out; guarded by mem_mu
size_t device_bytes_in_use = 0;               // guarded by mem_mu

std::mutex kernel_mu;  // one grid at a time (kernels' shared memory is static)

std::mutex func_mu;
std::unordered_map<const void*, int> max_dynamic_shared;  // guarded by func_mu

std::atomic<bool> sticky{false};
std::mutex streams_mu;  // guards live_streams; held while flushing others' streams
std::vector<CUstream_st*> live_streams;
std::mutex capture_mu;
std::vector<CUstream_st*> capturing_streams;  // every stream being captured; guarded by capture_mu
thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

size_t EnvBytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  return (end != nullptr && *end == '\0' && n > 0) ? static_cast<size_t>(n) : fallback;
}

// KVGRID_CUDA_EMU_MEMORY: the emulated card's memory in bytes (default 2 GiB).
size_t TotalMemory() {
  static const size_t total = EnvBytes("KVGRID_CUDA_EMU_MEMORY", kDefaultMemory);
  return total;
}

// KVGRID_CUDA_EMU_DEVICES: how many cards cudaGetDeviceCount reports (default 1). They share
// one memory.
int DeviceCount() {
  static const int count = static_cast<int>(EnvBytes("KVGRID_CUDA_EMU_DEVICES", 1));
  return count;
}

// KVGRID_CUDA_EMU_FAULT_FILE: once a file at this path exists, the next kernel launched
// faults (an illegal address, sticky), as a kernel bug or a failing card would: how tests show
// what a process does when its device is lost while it serves.
bool FaultInjected() {
  static const char* path = std::getenv("KVGRID_CUDA_EMU_FAULT_FILE");
  return path != nullptr && *path != '\0' && access(path, F_OK) == 0;
}

cudaError_t Result(cudaError_t e) {
  if (sticky.load()) e = cudaErrorLaunchFailure;
  if (e != cudaSuccess) last_error = e;
  return e;
}

bool IsSpecialStream(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

// Work on created streams runs when something waits for it (a synchronization, a query, the
// legacy stream, an implicitly synchronizing call), not when it is enqueued, so that a missing
// wait shows as data not yet there. KVGRID_CUDA_EMU_STREAMS=eager runs it at once instead.
bool DeferredStreams() {
  static const bool deferred = [] {
    const char* v = std::getenv("KVGRID_CUDA_EMU_STREAMS");
    return v == nullptr || std::strcmp(v, "eager") != 0;
  }();
  return deferred;
}

// Runs a stream's pending work, in order (skipped after a sticky fault, as on a GPU). Returns
// whether there was any.
bool Flush(CUstream_st* s) {
  std::lock_guard<std::mutex> lock(s->mu);
  const bool had = !s->pending.empty();
  std::vector<Work> work = std::move(s->pending);
  s->pending.clear();
  for (Work& w : work) {
    if (!sticky.load()) w();
  }
  return had;
}

// Flushes every created stream (all: a device-wide synchronization), or only the blocking ones
// (what the legacy stream waits for).
void FlushStreams(bool blocking_only) {
  std::lock_guard<std::mutex> lock(streams_mu);
  for (CUstream_st* s : live_streams) {
    if (!blocking_only || (s->flags & cudaStreamNonBlocking) == 0) Flush(s);
  }
}

// Waits for `stream`: the legacy stream waits for the blocking streams too.
void WaitFor(cudaStream_t stream) {
  if (IsSpecialStream(stream)) {
    FlushStreams(/*blocking_only=*/true);
  } else {
    Flush(stream);
  }
}

// Runs what an event waits for: its stream's work, if that stream still exists.
void FlushForEvent(cudaStream_t stream) {
  if (IsSpecialStream(stream)) {
    FlushStreams(/*blocking_only=*/true);
    return;
  }
  std::lock_guard<std::mutex> lock(streams_mu);
  if (std::find(live_streams.begin(), live_streams.end(), stream) != live_streams.end()) {
    Flush(stream);
  }
}

// Invalidates (and counts) the captures `which` selects.
template <typename Pred>
int InvalidateCaptures(Pred which) {
  std::lock_guard<std::mutex> lock(capture_mu);
  int n = 0;
  for (CUstream_st* s : capturing_streams) {
    if (which(*s)) {
      s->invalidated = true;
      ++n;
    }
  }
  return n;
}

// "Potentially unsafe" calls (allocation, synchronous copies, synchronization) fail while this
// thread captures in global or thread-local mode, or any thread captures in global mode, and
// invalidate those captures.
bool CaptureForbidsUnsafeCall() {
  const std::thread::id me = std::this_thread::get_id();
  return InvalidateCaptures([me](const CUstream_st& s) {
           return s.mode == cudaStreamCaptureModeGlobal ||
                  (s.mode == cudaStreamCaptureModeThreadLocal && s.owner == me);
         }) > 0;
}

// The legacy stream synchronizes with every blocking stream, so using it while any blocking
// stream (of any thread) is being captured would join the capture: CUDA refuses it.
bool CaptureForbidsLegacyStream() {
  return InvalidateCaptures([](const CUstream_st& s) {
           return (s.flags & cudaStreamNonBlocking) == 0;
         }) > 0;
}

// Synchronizing the whole device is invalid while any stream is being captured.
bool CaptureForbidsDeviceSync() {
  return InvalidateCaptures([](const CUstream_st&) { return true; }) > 0;
}

// Waiting on, or querying, a stream that is being captured is invalid and spoils the capture;
// so is the legacy stream while a blocking stream is captured.
bool CaptureForbidsWaitingOn(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy) {
    return CaptureForbidsLegacyStream();
  }
  if (IsSpecialStream(stream)) return false;
  std::lock_guard<std::mutex> lock(capture_mu);
  if (!stream->capturing) return false;
  stream->invalidated = true;
  return true;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

const Allocation* FindLocked(const void* p, uintptr_t* start) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return nullptr;
  --it;
  if (a >= it->first + std::max<size_t>(it->second.bytes, 1)) return nullptr;
  *start = it->first;
  return &it->second;
}

// Where a pointer range lies: in no allocation, inside one (device or pinned host), or
// starting in one and running past its end.
enum class Range { kUnknownHost, kDevice, kPinned, kOverrun };

Range Classify(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(mem_mu);
  uintptr_t start = 0;
  const Allocation* a = FindLocked(p, &start);
  if (a == nullptr) return Range::kUnknownHost;
  if (reinterpret_cast<uintptr_t>(p) + bytes > start + a->bytes) return Range::kOverrun;
  return a->device ? Range::kDevice : Range::kPinned;
}

cudaError_t Allocate(void** out, size_t bytes, bool device) {
  if (out == nullptr) return cudaErrorInvalidValue;
  *out = nullptr;
  if (bytes == 0) return cudaSuccess;
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t user = RoundUp(bytes, kAlign);
  const size_t inner = RoundUp(user, page);
  {
    std::lock_guard<std::mutex> lock(mem_mu);
    if (device && device_bytes_in_use + user > TotalMemory()) return cudaErrorMemoryAllocation;
    if (device) device_bytes_in_use += user;
  }
  void* m = mmap(nullptr, inner + 2 * page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(mem_mu);
    if (device) device_bytes_in_use -= user;
    return cudaErrorMemoryAllocation;
  }
  char* base = static_cast<char*>(m);
  // Unmapped pages on both sides: the buffer ends against the upper one.
  mprotect(base, page, PROT_NONE);
  mprotect(base + page + inner, page, PROT_NONE);
  char* p = base + page + (inner - user);
  std::memset(p, 0xFF, user);
  std::lock_guard<std::mutex> lock(mem_mu);
  allocations[reinterpret_cast<uintptr_t>(p)] = {base, inner + 2 * page, bytes, device};
  *out = p;
  return cudaSuccess;
}

cudaError_t Release(void* p, bool device) {
  if (p == nullptr) return cudaSuccess;
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(mem_mu);
    auto it = allocations.find(reinterpret_cast<uintptr_t>(p));
    if (it == allocations.end() || it->second.device != device) return cudaErrorInvalidValue;
    a = it->second;
    allocations.erase(it);
    if (device) device_bytes_in_use -= RoundUp(a.bytes, kAlign);
  }
  // Quarantined, not unmapped: a later allocation never reuses the range, so a stale pointer
  // (a freed buffer still named by a captured graph, say) faults instead of reading new data.
  mprotect(a.mapping, a.mapping_bytes, PROT_NONE);
  madvise(a.mapping, a.mapping_bytes, MADV_DONTNEED);
  return cudaSuccess;
}

bool CopyOk(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (bytes == 0) return true;
  if (dst == nullptr || src == nullptr) return false;
  const Range d = Classify(dst, bytes);
  const Range s = Classify(src, bytes);
  if (d == Range::kOverrun || s == Range::kOverrun) return false;
  const bool dev_d = d == Range::kDevice;
  const bool dev_s = s == Range::kDevice;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return dev_d && !dev_s;
    case cudaMemcpyDeviceToHost:
      return dev_s && !dev_d;
    case cudaMemcpyDeviceToDevice:
      return dev_d && dev_s;
    case cudaMemcpyHostToHost:
      return !dev_d && !dev_s;
    case cudaMemcpyDefault:
      return true;
  }
  return false;
}

// True when `p` is ordinary (pageable) host memory: neither device nor cudaMallocHost's.
bool IsPageable(const void* p, size_t bytes) { return Classify(p, bytes) == Range::kUnknownHost; }

// `height` rows of `width` bytes.
void CopyRows(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
              size_t height) {
  for (size_t r = 0; r < height; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                width);
  }
}

std::string Site(const LaunchConfig& c) {
  return std::string(c.site.file) + ":" + std::to_string(c.site.line);
}

cudaError_t CheckLaunch(const LaunchConfig& c) {
  const uint64_t threads = uint64_t{c.block.x} * c.block.y * c.block.z;
  if (threads == 0 || threads > 1024 || c.block.x > 1024 || c.block.y > 1024 ||
      c.block.z > 64) {
    return cudaErrorInvalidConfiguration;
  }
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 2147483647u ||
      c.grid.y > 65535 || c.grid.z > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  int limit = kSharedDefault;
  {
    std::lock_guard<std::mutex> lock(func_mu);
    auto it = max_dynamic_shared.find(c.kernel);
    if (it != max_dynamic_shared.end()) limit = it->second;
  }
  if (c.shared_bytes > static_cast<size_t>(limit)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work) {
  if (sticky.load()) return Result(cudaErrorLaunchFailure);
  if (!IsSpecialStream(stream) && stream->capturing) {
    if (stream->invalidated) return Result(cudaErrorStreamCaptureInvalidated);
    stream->nodes.push_back(std::move(work));
    return cudaSuccess;
  }
  if (stream == nullptr || stream == cudaStreamLegacy) {
    if (CaptureForbidsLegacyStream()) return Result(cudaErrorStreamCaptureImplicit);
  }
  if (IsSpecialStream(stream)) {
    FlushStreams(/*blocking_only=*/true);  // the legacy stream waits for the blocking streams
    work();
  } else if (DeferredStreams()) {
    std::lock_guard<std::mutex> lock(stream->mu);
    stream->pending.push_back(std::move(work));
  } else {
    work();
  }
  return Result(cudaSuccess);
}

bool IsDeviceRange(const void* p, size_t bytes) { return Classify(p, bytes) == Range::kDevice; }

bool IsCapturing(cudaStream_t stream) {
  return !IsSpecialStream(stream) && stream->capturing.load();
}

void StickyFault(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  sticky.store(true);
}

void ResetStickyFaultForTest() {
  sticky.store(false);
  last_error = cudaSuccess;
}

void SubmitKernel(const LaunchConfig& config, const std::vector<const void*>& pointers,
                  std::function<void()> body) {
  if (!sticky.load() && FaultInjected()) {
    (void)Enqueue(config.stream, [config] {
      StickyFault(("kernel launched at " + Site(config) +
                   ": a fault injected by KVGRID_CUDA_EMU_FAULT_FILE").c_str());
    });
    return;
  }
  for (size_t i = 0; i < pointers.size(); ++i) {
    if (pointers[i] != nullptr && Classify(pointers[i], 1) == Range::kUnknownHost) {
      // A GPU faults (an illegal address, sticky) when the kernel dereferences it.
      StickyFault(("kernel launched at " + Site(config) + ": pointer argument " +
                   std::to_string(i) + " is host memory, which the device cannot read")
                      .c_str());
      Result(cudaErrorLaunchFailure);
      return;
    }
  }
  if (const cudaError_t e = CheckLaunch(config); e != cudaSuccess) {
    std::fprintf(stderr, "cuda_emu: launch at %s refused (%s): grid (%u,%u,%u) block (%u,%u,%u) "
                 "dynamic shared %zu bytes\n",
                 Site(config).c_str(), cudaGetErrorName(e), config.grid.x, config.grid.y,
                 config.grid.z, config.block.x, config.block.y, config.block.z,
                 config.shared_bytes);
    Result(e);
    return;
  }
  (void)Enqueue(config.stream, [config, body = std::move(body)]() {
    std::lock_guard<std::mutex> lock(kernel_mu);
    const std::string fault = RunGrid(config, body);
    if (!fault.empty()) {
      StickyFault(("kernel launched at " + Site(config) + ": " + fault).c_str());
    }
  });
}

}  // namespace kvgrid::cuda_emu

using kvgrid::cuda_emu::Enqueue;
namespace emu = kvgrid::cuda_emu;

// ---------------------------------------------------------------------------------------------
// Errors and devices.

extern "C" {

cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::sticky.load() ? cudaErrorLaunchFailure : emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  return emu::sticky.load() ? cudaErrorLaunchFailure : emu::last_error;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidPitchValue: return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulated kernel fault)";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return cudaGetErrorName(e);
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = emu::DeviceCount();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= emu::DeviceCount()) return emu::Result(cudaErrorInvalidDevice);
  emu::current_device = device;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return emu::Result(cudaErrorInvalidValue);
  *device = emu::current_device;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
  if (bus_id == nullptr || len <= 0 || device < 0 || device >= emu::DeviceCount()) {
    return emu::Result(cudaErrorInvalidValue);
  }
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:00.0", device + 1);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr || device < 0 || device >= emu::DeviceCount()) {
    return emu::Result(cudaErrorInvalidValue);
  }
  std::memset(prop, 0, sizeof *prop);
  std::snprintf(prop->name, sizeof prop->name, "kvgrid CUDA emulator (CPU)");
  prop->totalGlobalMem = emu::TotalMemory();
  prop->sharedMemPerBlock = emu::kSharedDefault;
  prop->sharedMemPerBlockOptin = emu::kSharedOptin;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 4;
  prop->pciBusID = device + 1;
  prop->memoryBusWidth = 64;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (value == nullptr || device < 0 || device >= emu::DeviceCount()) {
    return emu::Result(cudaErrorInvalidValue);
  }
  switch (attr) {
    case cudaDevAttrMemoryClockRate: *value = 1000000; break;  // kHz
    case cudaDevAttrGlobalMemoryBusWidth: *value = 64; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;  // as cudaGetDeviceProperties
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: return emu::Result(cudaErrorInvalidValue);
  }
  return emu::Result(cudaSuccess);
}

cudaError_t cudaDeviceSynchronize() {
  if (emu::CaptureForbidsDeviceSync()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  emu::FlushStreams(/*blocking_only=*/false);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (func == nullptr) return emu::Result(cudaErrorInvalidDeviceFunction);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > emu::kSharedOptin) return emu::Result(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(emu::func_mu);
    emu::max_dynamic_shared[func] = value;
  }
  return emu::Result(cudaSuccess);
}

// ---------------------------------------------------------------------------------------------
// Memory.

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  return emu::Result(emu::Allocate(p, bytes, /*device=*/true));
}

cudaError_t cudaFree(void* p) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  emu::FlushStreams(/*blocking_only=*/false);  // cudaFree synchronizes the device
  return emu::Result(emu::Release(p, /*device=*/true));
}

cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  return emu::Result(emu::Allocate(p, bytes, /*device=*/false));
}

cudaError_t cudaFreeHost(void* p) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  emu::FlushStreams(/*blocking_only=*/false);
  return emu::Result(emu::Release(p, /*device=*/false));
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return emu::Result(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(emu::mem_mu);
  *total_bytes = emu::TotalMemory();
  *free_bytes = emu::TotalMemory() - emu::device_bytes_in_use;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  if (width > dpitch || width > spitch) return emu::Result(cudaErrorInvalidPitchValue);
  if (width == 0 || height == 0) return emu::Result(cudaSuccess);
  for (size_t r = 0; r < height; ++r) {
    if (!emu::CopyOk(static_cast<char*>(dst) + r * dpitch,
                     static_cast<const char*>(src) + r * spitch, width, kind)) {
      return emu::Result(cudaErrorInvalidValue);
    }
  }
  if (!emu::IsSpecialStream(stream) && !stream->capturing) {
    // Into pageable host memory the copy is complete when the call returns; from it, the
    // source is staged at the call and the stream writes the device later.
    if (emu::IsPageable(dst, width)) {
      emu::Flush(stream);
      emu::CopyRows(dst, dpitch, src, spitch, width, height);
      return emu::Result(cudaSuccess);
    }
    if (emu::IsPageable(src, width)) {
      auto staged = std::make_shared<std::vector<char>>(width * height);
      emu::CopyRows(staged->data(), width, src, spitch, width, height);
      return Enqueue(stream, [=]() {
        emu::CopyRows(dst, dpitch, staged->data(), width, width, height);
      });
    }
  }
  return Enqueue(stream, [=]() { emu::CopyRows(dst, dpitch, src, spitch, width, height); });
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return cudaMemcpy2DAsync(dst, bytes, src, bytes, bytes, 1, kind, stream);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return emu::Result(cudaSuccess);
  if (!emu::IsDeviceRange(p, bytes)) return emu::Result(cudaErrorInvalidValue);
  return Enqueue(stream, [=]() { std::memset(p, value, bytes); });
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (emu::CaptureForbidsUnsafeCall()) return emu::Result(cudaErrorStreamCaptureUnsupported);
  return cudaMemsetAsync(p, value, bytes, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Streams, events, graphs.

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr) return emu::Result(cudaErrorInvalidValue);
  *stream = new CUstream_st();
  (*stream)->flags = flags;
  std::lock_guard<std::mutex> lock(emu::streams_mu);
  emu::live_streams.push_back(*stream);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (emu::IsSpecialStream(stream)) return emu::Result(cudaErrorInvalidResourceHandle);
  if (stream->capturing) return emu::Result(cudaErrorIllegalState);
  {
    // Work already enqueued still completes, before anyone can miss it in live_streams.
    std::lock_guard<std::mutex> lock(emu::streams_mu);
    emu::Flush(stream);
    auto& all = emu::live_streams;
    all.erase(std::remove(all.begin(), all.end(), stream), all.end());
  }
  delete stream;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (emu::CaptureForbidsWaitingOn(stream) || emu::CaptureForbidsUnsafeCall()) {
    return emu::Result(cudaErrorStreamCaptureUnsupported);
  }
  emu::WaitFor(stream);
  return emu::Result(cudaSuccess);
}

// Work still pending is "not ready"; the query lets it run, as a GPU gets on with it anyway.
// "Not ready" is left as the thread's last error, as a runtime may leave it: a caller that
// polls must clear it, or its next launch check reports it.
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (emu::CaptureForbidsWaitingOn(stream)) return emu::Result(cudaErrorStreamCaptureUnsupported);
  if (!emu::IsSpecialStream(stream) && emu::Flush(stream)) return emu::Result(cudaErrorNotReady);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (emu::IsSpecialStream(stream)) return emu::Result(cudaErrorStreamCaptureUnsupported);
  std::lock_guard<std::mutex> lock(emu::capture_mu);
  if (stream->capturing) return emu::Result(cudaErrorIllegalState);
  stream->capturing = true;
  stream->invalidated = false;
  stream->mode = mode;
  stream->owner = std::this_thread::get_id();
  stream->nodes.clear();
  emu::capturing_streams.push_back(stream);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (graph == nullptr || emu::IsSpecialStream(stream)) return emu::Result(cudaErrorInvalidValue);
  *graph = nullptr;
  std::vector<Work> nodes;
  {
    std::lock_guard<std::mutex> lock(emu::capture_mu);
    if (!stream->capturing) return emu::Result(cudaErrorIllegalState);
    if (stream->mode != cudaStreamCaptureModeRelaxed &&
        stream->owner != std::this_thread::get_id()) {
      return emu::Result(cudaErrorStreamCaptureWrongThread);
    }
    stream->capturing = false;
    auto& all = emu::capturing_streams;
    all.erase(std::remove(all.begin(), all.end(), stream), all.end());
    nodes = std::move(stream->nodes);
    stream->nodes.clear();
  }
  if (stream->invalidated) return emu::Result(cudaErrorStreamCaptureInvalidated);
  *graph = new CUgraph_st{std::move(nodes)};
  return emu::Result(cudaSuccess);
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags) {
  if (exec == nullptr || graph == nullptr) return emu::Result(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{std::make_shared<const std::vector<Work>>(graph->nodes)};
  return emu::Result(cudaSuccess);
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return emu::Result(cudaErrorInvalidValue);
  return Enqueue(stream, [nodes = exec->nodes]() {
    for (const Work& node : *nodes) node();
  });
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (event == nullptr) return emu::Result(cudaErrorInvalidValue);
  *event = new CUevent_st();
  return emu::Result(cudaSuccess);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return emu::Result(cudaSuccess);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return emu::Result(cudaErrorInvalidResourceHandle);
  event->captured = !emu::IsSpecialStream(stream) && stream->capturing;
  event->stream = stream;
  if (!event->captured) event->time->recorded = false;  // until this record has run
  return Enqueue(stream, [t = event->time]() {
    t->time = std::chrono::steady_clock::now();
    t->recorded = true;
  });
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return emu::Result(cudaErrorInvalidResourceHandle);
  if (event->captured || emu::CaptureForbidsUnsafeCall()) {
    return emu::Result(cudaErrorStreamCaptureUnsupported);
  }
  emu::FlushForEvent(event->stream);
  return emu::Result(cudaSuccess);
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr || start == nullptr || end == nullptr) {
    return emu::Result(cudaErrorInvalidValue);
  }
  if (!start->time->recorded || !end->time->recorded) return emu::Result(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(end->time->time - start->time->time).count();
  return emu::Result(cudaSuccess);
}

}  // extern "C"
