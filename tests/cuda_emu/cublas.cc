// The cuBLAS calls kvgrid makes, as the emulator provides them: column-major GEMM with
// cuBLAS's argument checks, enqueued on the handle's stream (and so captured into graphs).
// Products accumulate in float, as CUBLAS_COMPUTE_32F does, one output element at a time.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "tests/cuda_emu/runtime.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
  // A workspace the caller set (cublasSetWorkspace); cublasSetStream clears it, as cuBLAS does.
  bool own_workspace = false;
};

namespace kvgrid::cuda_emu {
namespace {

float Load(const void* p, cudaDataType type, int64_t i) {
  switch (type) {
    case CUDA_R_32F: return static_cast<const float*>(p)[i];
    case CUDA_R_16F: return __half2float(static_cast<const __half*>(p)[i]);
    case CUDA_R_16BF: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return 0.f;
  }
}

void Store(void* p, cudaDataType type, int64_t i, float v) {
  switch (type) {
    case CUDA_R_32F: static_cast<float*>(p)[i] = v; break;
    case CUDA_R_16F: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case CUDA_R_16BF: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: break;
  }
}

int64_t Bytes(cudaDataType type) { return type == CUDA_R_32F ? 4 : 2; }

bool Supported(cudaDataType type) {
  return type == CUDA_R_32F || type == CUDA_R_16F || type == CUDA_R_16BF;
}

// C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C, column-major; the checks cuBLAS makes on
// the shapes, plus that every operand lies inside one device allocation.
cublasStatus_t Gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                    int k, const void* alpha_p, const void* a, cudaDataType at, int lda,
                    const void* b, cudaDataType bt, int ldb, const void* beta_p, void* c,
                    cudaDataType ct, int ldc) {
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  // Stricter than cuBLAS, which would take memory from its own pool inside the capture (more
  // with every graph captured): a GEMM captured without a workspace of the caller's is refused.
  if (IsCapturing(h->stream) && !h->own_workspace) {
    std::fprintf(stderr, "cuda_emu: a cuBLAS GEMM captured into a graph without a workspace set "
                         "by cublasSetWorkspace (cublasSetStream resets it)\n");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  // cublasGemmEx with 32-bit compute takes A and B of one type, C of that type or fp32.
  if (!Supported(at) || at != bt || (ct != at && ct != CUDA_R_32F)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const bool a_t = ta != CUBLAS_OP_N;
  const bool b_t = tb != CUBLAS_OP_N;
  const int a_rows = a_t ? k : m;  // A as stored: a_rows x (a_t ? m : k)
  const int b_rows = b_t ? n : k;
  if (m < 0 || n < 0 || k < 0 || lda < std::max(1, a_rows) || ldb < std::max(1, b_rows) ||
      ldc < std::max(1, m) || alpha_p == nullptr || beta_p == nullptr) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const int64_t a_cols = a_t ? m : k;
  const int64_t b_cols = b_t ? k : n;
  auto extent = [](int64_t ld, int64_t rows, int64_t cols, cudaDataType t) {
    return cols == 0 ? 0 : ((cols - 1) * ld + rows) * Bytes(t);
  };
  if ((k > 0 && (!IsDeviceRange(a, extent(lda, a_rows, a_cols, at)) ||
                 !IsDeviceRange(b, extent(ldb, b_rows, b_cols, bt)))) ||
      !IsDeviceRange(c, extent(ldc, m, n, ct))) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const bool host_scalars = h->pointer_mode == CUBLAS_POINTER_MODE_HOST;
  // Scalars where the pointer mode says: a device address read on the host (or a host one on
  // the device) crashes on a GPU.
  for (const void* scalar : {alpha_p, beta_p}) {
    const bool on_device = IsDeviceRange(scalar, sizeof(float));
    if (host_scalars == on_device) return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Host scalars are read at the call (and so at capture), device ones when the work runs.
  const float alpha_now = host_scalars ? *static_cast<const float*>(alpha_p) : 0.f;
  const float beta_now = host_scalars ? *static_cast<const float*>(beta_p) : 0.f;
  const cudaError_t e = Enqueue(h->stream, [=]() {
    const float alpha = host_scalars ? alpha_now : *static_cast<const float*>(alpha_p);
    const float beta = host_scalars ? beta_now : *static_cast<const float*>(beta_p);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t i = 0; i < m; ++i) {
        float acc = 0.f;
        for (int64_t l = 0; l < k; ++l) {
          const float av = Load(a, at, a_t ? l + i * lda : i + l * lda);
          const float bv = Load(b, bt, b_t ? j + l * ldb : l + j * ldb);
          acc += av * bv;
        }
        const int64_t ci = i + j * ldc;
        // beta == 0: C is not read, as in cuBLAS (it may hold NaN).
        Store(c, ct, ci, beta == 0.f ? alpha * acc : alpha * acc + beta * Load(c, ct, ci));
      }
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace
}  // namespace kvgrid::cuda_emu

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  handle->own_workspace = false;  // "resets the workspace to the default workspace pool"
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes > 0 && !kvgrid::cuda_emu::IsDeviceRange(workspace, bytes)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->own_workspace = bytes > 0;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  return handle == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

const char* cublasGetStatusString(cublasStatus_t status) {
  return cublasGetStatusName(status);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
                              cublasOperation_t transb, int m, int n, int k, const float* alpha,
                              const float* A, int lda, const float* B, int ldb,
                              const float* beta, float* C, int ldc) {
  return kvgrid::cuda_emu::Gemm(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B,
                                CUDA_R_32F, ldb, beta, C, CUDA_R_32F, ldc);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
  if (computeType != CUBLAS_COMPUTE_32F && computeType != CUBLAS_COMPUTE_32F_PEDANTIC) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return kvgrid::cuda_emu::Gemm(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype,
                                ldb, beta, C, Ctype, ldc);
}

}  // extern "C"
