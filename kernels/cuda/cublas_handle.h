// An owned cuBLAS handle: created with Create(), destroyed with the object.
#ifndef KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_
#define KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_

#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace kvgrid::kernels::cuda {

// Move-only owner of one cublasHandle_t, bound to the device current when Create() ran.
// Thread-safety: none. A handle carries mutable state (its stream, pointer mode and math mode,
// which the wrappers here set on every call), so give each thread that launches GEMMs its own.
class CublasHandle {
 public:
  // Errors: INTERNAL / RESOURCE_EXHAUSTED naming cublasCreate and the cuBLAS status (e.g.
  // CUBLAS_STATUS_NOT_INITIALIZED where no device is visible).
  static absl::StatusOr<CublasHandle> Create();

  CublasHandle() = default;  // holds nothing; get() is null
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle();

  [[nodiscard]] cublasHandle_t get() const { return handle_; }

 private:
  explicit CublasHandle(cublasHandle_t handle) : handle_(handle) {}
  void Reset();

  cublasHandle_t handle_ = nullptr;
};

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_
