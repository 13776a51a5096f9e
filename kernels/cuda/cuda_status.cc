#include "kernels/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels::cuda {

bool IsStickyCudaError(cudaError_t err) {
  switch (err) {
    // The runtime's documentation says of each: the process is left in an inconsistent state,
    // any further CUDA work returns the same error, and it must be terminated and relaunched.
    case cudaErrorContained:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    // Not so documented, but no context survives them either.
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
      return true;
    default:
      return false;
  }
}

absl::Status CudaStatus(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  // Take the error out of the runtime's last-error slot, so that a failure reported here (a
  // cudaMalloc that did not fit, say) is not reported again by the next launch's
  // cudaGetLastError. Sticky errors (a fault in a kernel) stay, as they must.
  (void)cudaGetLastError();
  std::string message = absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                     cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (IsStickyCudaError(err)) {
    return absl::UnavailableError(
        absl::StrCat(message, " (the device's context is lost: the process must restart)"));
  }
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
