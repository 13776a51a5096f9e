// An owned cuBLAS handle: created with Create(), destroyed with the object.
#ifndef KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_
#define KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvgrid::kernels::cuda {

// Move-only owner of one cublasHandle_t and of its workspace on the device current when
// Create() ran. Thread-safety: none. A handle carries mutable state (its stream, pointer mode
// and math mode, which the wrappers here set on every call), so give each thread that launches
// GEMMs its own.
class CublasHandle {
 public:
  // The workspace: what cuBLAS's documentation recommends for Hopper and later (32 MiB), and
  // 4 MiB on older parts. Counted in the step workspace the KV budget leaves (kv_planner.h).
  static constexpr int64_t kWorkspaceBytes = 32ll << 20;
  static constexpr int64_t kWorkspaceBytesBeforeHopper = 4ll << 20;

  // Errors: INTERNAL / RESOURCE_EXHAUSTED naming cublasCreate or cudaMalloc and the status
  // (e.g. CUBLAS_STATUS_NOT_INITIALIZED where no device is visible).
  static absl::StatusOr<CublasHandle> Create();

  // Points the handle at `stream` and at its own workspace. cublasSetStream alone resets the
  // handle to cuBLAS's internal workspace pool, from which cuBLAS may allocate inside a CUDA
  // graph capture (memory that grows with every captured graph): every GEMM launch binds both.
  // Errors: as CublasStatus.
  absl::Status Bind(cudaStream_t stream) const;

  CublasHandle() = default;  // holds nothing; get() is null
  CublasHandle(CublasHandle&& other) noexcept;
  CublasHandle& operator=(CublasHandle&& other) noexcept;
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  ~CublasHandle();

  [[nodiscard]] cublasHandle_t get() const { return handle_; }

 private:
  CublasHandle(cublasHandle_t handle, void* workspace, int64_t workspace_bytes)
      : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes) {}
  void Reset();

  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;  // device memory, owned
  int64_t workspace_bytes_ = 0;
};

}  // namespace kvgrid::kernels::cuda

#endif  // KVGRID_KERNELS_CUDA_CUBLAS_HANDLE_H_
