#include "kernels/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels::cuda {

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Take the error out of the runtime's last-error slot, so that a failure reported here (a
  // cudaMalloc that did not fit, say) is not reported again by the next launch's
  // cudaGetLastError. Sticky errors (a fault in a kernel) stay, as they must.
  (void)cudaGetLastError();
  std::string message = absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                     cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CublasStatus(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                     cublasGetStatusName(status), ": ",
                                     cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return absl::UnimplementedError(message);
  return absl::InternalError(message);
}

}  // namespace kvgrid::kernels::cuda
