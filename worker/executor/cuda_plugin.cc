// libkvgrid_cuda_plugin.so: the CUDA executor behind the entry point cuda_plugin.h declares.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_status.h"
#include "model/dtype.h"
#include "model/status_macros.h"
#include "worker/comm/communicator.h"
#include "worker/comm/host_staged_communicator.h"
#include "worker/executor/cuda_executor.h"
#include "worker/executor/cuda_plugin.h"
#if KVGRID_HAVE_NCCL
#include "worker/comm/nccl_communicator.h"
#endif

namespace kvgrid::worker {
namespace {

// The device this rank runs on: the one asked for, else its slot (kvgrid serve numbers a
// machine's workers) or its rank modulo the visible devices: a machine's workers spread over
// its cards, and a process that sees only its own card uses it.
absl::StatusOr<int> ChooseDevice(int requested, int place) {
  int count = 0;
  // A runtime newer than the driver, or a machine whose fabric manager is not up, fails here
  // with a card present: the error says which.
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device cuda: no CUDA device is visible",
        e != cudaSuccess ? absl::StrCat(" (", cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")")
                         : std::string()));
  }
  if (requested >= count) {
    return absl::InvalidArgumentError(absl::StrCat("--cuda-device: ", requested, " but only ",
                                                   count, " CUDA devices are visible"));
  }
  return requested >= 0 ? requested : place % count;
}

// The running kernel's boot id: the same in every container of a machine, different on every
// other machine (hostnames may repeat across containers). The hostname where it is unreadable.
std::string MachineId() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (boot && std::getline(boot, id) && !id.empty()) return id;
  char name[256] = {};
  (void)gethostname(name, sizeof(name) - 1);
  return name;
}

// Where the group's ranks run: how many share this rank's card (same machine, same PCI bus
// id), and whether any card is shared.
struct CardSharing {
  int on_my_card = 1;
  bool any = false;
};
// A T x C group is reached through its TP mesh and then its CP mesh (the TP mesh's lists
// gathered over the CP ranks); either may be null.
absl::StatusOr<CardSharing> ShareCards(Communicator* tp, Communicator* cp, int device) {
  char bus[64] = {};
  KVGRID_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  const std::string mine = absl::StrCat(MachineId(), "/", bus);
  std::vector<std::string> all = {mine};
  for (Communicator* mesh : {tp, cp}) {
    if (mesh == nullptr) continue;
    // One rank's list as one string of newline-ended ids (ids hold no newline).
    std::string joined;
    for (const std::string& id : all) absl::StrAppend(&joined, id, "\n");
    KVGRID_ASSIGN_OR_RETURN(std::vector<std::string> lists, GatherBytes(*mesh, joined));
    all.clear();
    for (const std::string& list : lists) {
      for (absl::string_view id : absl::StrSplit(list, '\n', absl::SkipEmpty())) {
        all.emplace_back(id);
      }
    }
  }
  CardSharing sharing;
  sharing.on_my_card = static_cast<int>(std::count(all.begin(), all.end(), mine));
  std::sort(all.begin(), all.end());
  sharing.any = std::adjacent_find(all.begin(), all.end()) != all.end();
  return sharing;
}

// Device collectives over the host mesh `host` (a TP or a CP mesh); `announce` prints the
// staged-path note once for the group.
absl::StatusOr<std::unique_ptr<DeviceCommunicator>> DeviceCollectives(
    Communicator& host, int device, bool shared, double timeout_s, bool announce) {
  if (shared) {
    if (announce) {
      std::fprintf(stderr, "kvgrid-worker: ranks of the group share a card; their collectives "
                           "go through host memory (slow; no CUDA graphs)\n");
    }
    return std::unique_ptr<DeviceCommunicator>(new HostStagedCommunicator(host));
  }
#if KVGRID_HAVE_NCCL
  KVGRID_ASSIGN_OR_RETURN(
      std::unique_ptr<NcclCommunicator> nccl,
      NcclCommunicator::Connect(host, device,
                                std::chrono::milliseconds(static_cast<int64_t>(1000 * timeout_s))));
  return std::unique_ptr<DeviceCommunicator>(std::move(nccl));
#else
  (void)timeout_s;
  return absl::UnimplementedError(
      "--device cuda: this build has no NCCL, so a group needs its ranks on one card");
#endif
}

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
  const TensorParallel tp = model->tensor_parallel();
  const ContextParallel cp = model->context_parallel();
  const int group_rank = cp.rank * tp.size + tp.rank;  // as GlooWorkerGroup numbers them
  KVGRID_ASSIGN_OR_RETURN(
      const int device,
      ChooseDevice(options.device, options.device_slot >= 0 ? options.device_slot : group_rank));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop{};
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  std::fprintf(stderr, "kvgrid-worker: rank %d on CUDA device %d (%s, sm_%d%d, %.1f GiB)\n",
               group_rank, device, prop.name, prop.major, prop.minor,
               static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  std::unique_ptr<DeviceCommunicator> collectives, cp_collectives;
  CudaPoolOptions pool = options.pool;
  if (tp.size > 1 || cp.size > 1) {
    KVGRID_ASSIGN_OR_RETURN(
        const CardSharing sharing,
        ShareCards(tp.size > 1 ? tp.comm : nullptr, cp.size > 1 ? cp.comm : nullptr, device));
    pool.ranks_on_card = sharing.on_my_card;
    if (tp.size > 1) {
      KVGRID_ASSIGN_OR_RETURN(collectives,
                              DeviceCollectives(*tp.comm, device, sharing.any,
                                                options.collective_timeout_s, group_rank == 0));
    }
    if (cp.size > 1) {
      KVGRID_ASSIGN_OR_RETURN(
          cp_collectives,
          DeviceCollectives(*cp.comm, device, sharing.any, options.collective_timeout_s,
                            group_rank == 0 && tp.size == 1));
    }
  }
  std::unique_ptr<CudaLlamaModel> gpu_model;
  if (options.random_weights) {
    if (collectives || cp_collectives) {
      return absl::UnimplementedError(
          "--load-format dummy: random weights are made for a whole model on one card, not "
          "for a group's ranks");
    }
    KVGRID_ASSIGN_OR_RETURN(gpu_model, CudaLlamaModel::Random(model->config(), dense,
                                                              options.random_weights_seed));
  } else {
    if (!model->has_weights()) {
      return absl::InvalidArgumentError(
          "the model holds no weights and random weights were not asked for");
    }
    KVGRID_ASSIGN_OR_RETURN(gpu_model, CudaLlamaModel::FromWeights(model->config(),
                                                                   model->weights(), dense,
                                                                   collectives.get()));
  }
  model.reset();
  KVGRID_RETURN_IF_ERROR(gpu_model->SetContextParallel(cp.rank, cp.size, cp_collectives.get()));
  KVGRID_ASSIGN_OR_RETURN(
      std::unique_ptr<CudaExecutor> executor,
      CudaExecutor::Create(std::move(gpu_model), pool, tp, std::move(collectives), cp,
                           std::move(cp_collectives)));
  const std::string& off = executor->model().decode_graph_stats().disabled_by;
  std::fprintf(stderr, "kvgrid-worker: rank %d: %lld KV blocks of %lld tokens on the GPU, %s%s\n",
               group_rank, static_cast<long long>(executor->num_blocks()),
               static_cast<long long>(pool.block_size),
               pool.cuda_graphs && off.empty() ? "decode steps from CUDA graphs"
                                               : "no CUDA graphs",
               off.empty() ? "" : absl::StrCat(" (", off, ")").c_str());
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
