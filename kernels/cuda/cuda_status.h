// Turns CUDA runtime and cuBLAS errors into absl::Status values that name the call, file and
// line. Nothing in kvgrid aborts on a device error: a server returns the error instead.
#ifndef KVGRID_KERNELS_CUDA_CUDA_STATUS_H_
#define KVGRID_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"

namespace kvgrid::kernels::cuda {

// OK for cudaSuccess; otherwise INTERNAL with
// "<call> failed at <file>:<line>: <cuda error name>: <description>", RESOURCE_EXHAUSTED for
// out-of-memory, and UNAVAILABLE for a sticky error (IsStickyCudaError): the process cannot
// use the device again, so a worker that sees it shuts down and its requests move elsewhere.
absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line);

// True for the errors after which every CUDA call of the process fails the same way (a fault
// in a kernel, an uncorrectable ECC error): only a new process can use the device.
bool IsStickyCudaError(cudaError_t err);

// OK for CUBLAS_STATUS_SUCCESS; otherwise INTERNAL (RESOURCE_EXHAUSTED for
// CUBLAS_STATUS_ALLOC_FAILED, UNIMPLEMENTED for CUBLAS_STATUS_NOT_SUPPORTED) with
// "<call> failed at <file>:<line>: <cublasStatus_t name>: <description>".
absl::Status CublasStatus(cublasStatus_t status, const char* call, const char* file, int line);

}  // namespace kvgrid::kernels::cuda

// Evaluates a CUDA runtime call and returns its Status from the enclosing function on error.
#define KVGRID_CUDA_RETURN_IF_ERROR(call)                                                   \
  do {                                                                                      \
    ::absl::Status kvgrid_cuda_status_ =                                                    \
        ::kvgrid::kernels::cuda::CudaStatus((call), #call, __FILE__, __LINE__);             \
    if (!kvgrid_cuda_status_.ok()) return kvgrid_cuda_status_;                              \
  } while (0)

// Evaluates a cuBLAS call and returns its Status from the enclosing function on error.
#define KVGRID_CUBLAS_RETURN_IF_ERROR(call)                                                 \
  do {                                                                                      \
    ::absl::Status kvgrid_cublas_status_ =                                                  \
        ::kvgrid::kernels::cuda::CublasStatus((call), #call, __FILE__, __LINE__);           \
    if (!kvgrid_cublas_status_.ok()) return kvgrid_cublas_status_;                          \
  } while (0)

#endif  // KVGRID_KERNELS_CUDA_CUDA_STATUS_H_
