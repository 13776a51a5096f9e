// The CUDA executor as a plugin that kvgrid-worker loads at run time (dlopen) for
// --device cuda. The worker binary then links no CUDA library: it runs on machines without
// them, and the libraries' large static TLS (cuBLASLt's ~90 KiB) does not shrink every thread's
// stack (civetweb's threads, with their fixed small stacks, cannot start once it is loaded at
// startup).
//
// The plugin (libkvgrid_cuda_plugin.so, built with CUDA) is looked up at $KVGRID_CUDA_PLUGIN,
// else beside the running executable. Both sides are built from this tree by one compiler.
#ifndef KVGRID_WORKER_EXECUTOR_CUDA_PLUGIN_H_
#define KVGRID_WORKER_EXECUTOR_CUDA_PLUGIN_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "worker/executor/executor.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::worker {

// The GPU executor's pool, swap space and steps (CudaExecutor::PoolOptions); declared here,
// where no CUDA header is needed, so that the worker fills it in without one.
struct CudaPoolOptions {
  int64_t block_size = 16;
  kernels::KvDType k_dtype = kernels::KvDType::kF16;
  kernels::KvDType v_dtype = kernels::KvDType::kF16;
  int64_t kv_cache_memory = 0;            // bytes; 0: size by gpu_memory_utilization
  double gpu_memory_utilization = 0.9;    // share of the card this process (with the group's
                                          // other ranks on the card) may fill
  int64_t max_num_batched_tokens = 8192;  // sizes the step buffers, allocated at creation
  int64_t max_num_seqs = 64;
  int64_t max_model_len = 0;              // longest sequence served; 0: the model's
                                          // max_position_embeddings (sizes the attention
                                          // workspace and block tables reserved at creation)
  int64_t swap_space = 0;                 // pinned host bytes; 0: none
  bool cuda_graphs = true;                // decode steps replayed from CUDA graphs
  // Ranks of the group on this card (set by the plugin): a pool sized by utilization is their
  // share of it.
  int ranks_on_card = 1;
};

struct CudaExecutorOptions {
  std::string dense_dtype = "auto";  // auto (the checkpoint's torch_dtype), fp16, bf16, fp32
  CudaPoolOptions pool;
  int device = -1;       // the CUDA device; -1: device_slot (else the rank) modulo the visible ones
  int device_slot = -1;  // the worker's place among its machine's workers; -1: none given
  // Seconds a step's collectives may take before the group counts as broken.
  double collective_timeout_s = 30.0;
  // Random dense weights made on the card (CudaLlamaModel::Random) from the model's config;
  // the model passed in then holds none (LlamaModel::WithoutWeights). One rank only.
  bool random_weights = false;
  uint64_t random_weights_seed = 0;
};

// The plugin's entry point: uploads `model`'s weights (dense matrices in
// options.dense_dtype), or makes random ones on the card (options.random_weights), and builds
// a CudaExecutor; the host model is dropped. A model sharded
// over a group (model->tensor_parallel().size > 1, with the group's host communicator) gets
// device collectives for its ranks: NCCL when each rank has its own card, else staged through
// host memory over the host communicator (ranks that share a card; NCCL refuses them). Every
// rank of the group calls it at the same time.
using CreateCudaExecutorFn = absl::StatusOr<std::unique_ptr<Executor>> (*)(
    std::unique_ptr<LlamaModel> model, const CudaExecutorOptions& options);
inline constexpr char kCreateCudaExecutorSymbol[] = "kvgrid_create_cuda_executor";

// Loads the plugin (once; it stays loaded) and returns its entry point. Errors:
// FAILED_PRECONDITION naming the path when it is missing or not a kvgrid CUDA plugin.
absl::StatusOr<CreateCudaExecutorFn> LoadCudaPlugin();

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_CUDA_PLUGIN_H_
