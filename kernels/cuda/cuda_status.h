// Turns CUDA runtime errors into absl::Status values that name the call, file and line.
// Nothing in kvgrid aborts on a device error: a server returns the error instead.
#ifndef KVGRID_KERNELS_CUDA_CUDA_STATUS_H_
#define KVGRID_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

// OK for cudaSuccess; otherwise INTERNAL (RESOURCE_EXHAUSTED for out-of-memory) with
// "<call> failed at <file>:<line>: <cuda error name>: <description>".
absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line);

}  // namespace kvgrid::kernels::cuda

// Evaluates a CUDA runtime call and returns its Status from the enclosing function on error.
#define KVGRID_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                      \
    ::absl::Status kvgrid_cuda_status_ =                                                    \
        ::kvgrid::kernels::cuda::CudaStatus((call), #call, __FILE__, __LINE__);             \
    if (!kvgrid_cuda_status_.ok()) return kvgrid_cuda_status_;                              \
  } while (0)

#endif  // KVGRID_KERNELS_CUDA_CUDA_STATUS_H_
