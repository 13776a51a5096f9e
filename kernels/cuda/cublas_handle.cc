#include "kernels/cuda/cublas_handle.h"

#include <utility>

#include "kernels/cuda/cuda_status.h"

namespace kvgrid::kernels::cuda {

absl::StatusOr<CublasHandle> CublasHandle::Create() {
  cublasHandle_t handle = nullptr;
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  return CublasHandle(handle);
}

CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

CublasHandle::~CublasHandle() { Reset(); }

void CublasHandle::Reset() {
  // A destroy failure (the context already gone at process exit) leaves nothing to recover.
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
  handle_ = nullptr;
}

}  // namespace kvgrid::kernels::cuda
