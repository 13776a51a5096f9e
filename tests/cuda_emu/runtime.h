// The emulator's side of the CUDA runtime that cublas.cc shares: streams, and work enqueued on
// them. The runtime functions themselves (cudaMalloc, cudaMemcpyAsync, cudaStreamBeginCapture,
// ...) are defined in runtime.cc with the toolkit's own declarations, so programs link them in
// place of libcudart.
//
// Work on a created stream is queued and runs, on the thread that waits, when something waits
// for it (cudaStreamSynchronize, a query, an event, the legacy stream, cudaFree,
// cudaDeviceSynchronize), so a missing wait shows as results not yet there; the legacy stream
// runs its work at once. While a stream is captured its work is recorded into the graph. Device memory is host memory from
// mmap, poisoned with all-ones bytes (NaN in every float format) and fenced by unmapped pages,
// so that reading memory nothing wrote shows in the results and running off an allocation
// faults. Copies are checked against the allocations (direction and bounds), and calls that
// CUDA forbids during a capture fail as they do there.
#ifndef KVGRID_TESTS_CUDA_EMU_RUNTIME_H_
#define KVGRID_TESTS_CUDA_EMU_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <functional>

namespace kvgrid::cuda_emu {

// Queues `work` on `stream` (runs it now on the legacy stream), or records it when `stream` is
// capturing. Returns the error CUDA would: work for the legacy stream while a blocking stream is
// captured invalidates the capture.
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work);

// True when [p, p + bytes) lies inside one device allocation (cudaMalloc).
bool IsDeviceRange(const void* p, size_t bytes);

// True while `stream` (a created stream) is being captured into a graph.
bool IsCapturing(cudaStream_t stream);

// Records a fault of enqueued work: printed, and sticky, as CUDA's are (every later call that
// returns an error status returns cudaErrorLaunchFailure).
void StickyFault(const char* what);

// Clears a sticky fault, so that one test program can check several (CUDA cannot do this).
void ResetStickyFaultForTest();

}  // namespace kvgrid::cuda_emu

#endif  // KVGRID_TESTS_CUDA_EMU_RUNTIME_H_
