#include "kernels/cuda/cublas_handle.h"

#include <utility>

#include "kernels/cuda/cuda_status.h"

namespace kvgrid::kernels::cuda {

absl::StatusOr<CublasHandle> CublasHandle::Create() {
  int device = 0, major = 0;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  KVGRID_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const int64_t bytes = major >= 9 ? kWorkspaceBytes : kWorkspaceBytesBeforeHopper;
  void* workspace = nullptr;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMalloc(&workspace, static_cast<size_t>(bytes)));
  cublasHandle_t handle = nullptr;
  if (absl::Status s = CublasStatus(cublasCreate(&handle), "cublasCreate(&handle)", __FILE__,
                                    __LINE__);
      !s.ok()) {
    (void)cudaFree(workspace);
    return s;
  }
  return CublasHandle(handle, workspace, bytes);
}

absl::Status CublasHandle::Bind(cudaStream_t stream) const {
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetStream(handle_, stream));
  KVGRID_CUBLAS_RETURN_IF_ERROR(
      cublasSetWorkspace(handle_, workspace_, static_cast<size_t>(workspace_bytes_)));
  return absl::OkStatus();
}

CublasHandle::CublasHandle(CublasHandle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      workspace_(std::exchange(other.workspace_, nullptr)),
      workspace_bytes_(std::exchange(other.workspace_bytes_, 0)) {}

CublasHandle& CublasHandle::operator=(CublasHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    handle_ = std::exchange(other.handle_, nullptr);
    workspace_ = std::exchange(other.workspace_, nullptr);
    workspace_bytes_ = std::exchange(other.workspace_bytes_, 0);
  }
  return *this;
}

CublasHandle::~CublasHandle() { Reset(); }

void CublasHandle::Reset() {
  // A destroy failure (the context already gone at process exit) leaves nothing to recover.
  // cudaFree waits for the device, so no GEMM still uses the workspace.
  if (handle_ != nullptr) (void)cublasDestroy(handle_);
  if (workspace_ != nullptr) (void)cudaFree(workspace_);
  handle_ = nullptr;
  workspace_ = nullptr;
  workspace_bytes_ = 0;
}

}  // namespace kvgrid::kernels::cuda
