// libkvgrid_cuda_plugin.so: the CUDA executor behind the entry point cuda_plugin.h declares.
#include <memory>
#include <type_traits>
#include <utility>

#include "absl/status/statusor.h"
#include "model/dtype.h"
#include "model/status_macros.h"
#include "worker/executor/cuda_executor.h"
#include "worker/executor/cuda_plugin.h"

namespace kvgrid::worker {
namespace {

absl::StatusOr<std::unique_ptr<Executor>> CreateCudaExecutor(
    std::unique_ptr<LlamaModel> model, const CudaExecutorOptions& options) {
  using model::DType;
  DType dense = DType::kF16;
  if (options.dense_dtype == "bf16" ||
      (options.dense_dtype == "auto" && model->config().torch_dtype == "bfloat16")) {
    dense = DType::kBF16;
  } else if (options.dense_dtype == "fp32") {
    dense = DType::kF32;
  }
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<CudaLlamaModel> gpu_model,
                          CudaLlamaModel::FromWeights(model->config(), model->weights(), dense));
  model.reset();
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<CudaExecutor> executor,
                          CudaExecutor::Create(std::move(gpu_model), options.pool));
  return std::unique_ptr<Executor>(std::move(executor));
}

}  // namespace
}  // namespace kvgrid::worker

// The loader reads this symbol as a CreateCudaExecutorFn.
extern "C" __attribute__((visibility("default")))
absl::StatusOr<std::unique_ptr<kvgrid::worker::Executor>>
kvgrid_create_cuda_executor(std::unique_ptr<kvgrid::worker::LlamaModel> model,
                            const kvgrid::worker::CudaExecutorOptions& options) {
  return kvgrid::worker::CreateCudaExecutor(std::move(model), options);
}

static_assert(std::is_same_v<decltype(&kvgrid_create_cuda_executor),
                             kvgrid::worker::CreateCudaExecutorFn>,
              "the entry point must have the type the loader casts it to");
