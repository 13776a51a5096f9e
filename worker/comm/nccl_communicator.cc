#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/store.h"
#include "kernels/cuda/cuda_status.h"
#include "model/status_macros.h"

namespace kvgrid::worker {
namespace {

absl::Status NcclStatus(ncclResult_t result, const char* call, const char* file, int line) {
  if (result == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(call, " failed at ", file, ":", line, ": ",
                                             ncclGetErrorString(result)));
}

#define KVGRID_NCCL_RETURN_IF_ERROR(call)                                                 \
  do {                                                                                    \
    ::absl::Status kvgrid_nccl_status_ = NcclStatus((call), #call, __FILE__, __LINE__);   \
    if (!kvgrid_nccl_status_.ok()) return kvgrid_nccl_status_;                            \
  } while (0)

// A call on a State's communicator: it is non-blocking (see Join), so a call may return
// ncclInProgress, and the next one may only follow once its state leaves ncclInProgress.
#define KVGRID_NCCL_CALL(state, call, timeout)                                          \
  do {                                                                                  \
    ::absl::Status kvgrid_nccl_status_ = Settle(&(state)->comm, &(state)->aborted, (call), \
                                                #call, __FILE__, __LINE__, (timeout),   \
                                                ::absl::StatusCode::kUnavailable);      \
    if (!kvgrid_nccl_status_.ok()) return kvgrid_nccl_status_;                          \
  } while (0)

// Waits while the communicator `*comm` is busy with `call` (which returned `result`), up to
// `timeout`. A failure or the timeout aborts the communicator and clears `*comm` (a later call
// finds the group broken): UNAVAILABLE naming the call and NCCL's error, `on_timeout` past
// the timeout.
absl::Status Settle(ncclComm_t* comm, bool* aborted, ncclResult_t result, const char* call,
                    const char* file, int line, std::chrono::milliseconds timeout,
                    absl::StatusCode on_timeout) {
  auto abort = [&] {
    if (*comm == nullptr) return;
    *aborted = true;
    (void)ncclCommAbort(*comm);
    *comm = nullptr;
  };
  if (result != ncclInProgress) {
    if (result != ncclSuccess) abort();
    return NcclStatus(result, call, file, line);
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int64_t polls = 0;
  for (;;) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(*comm, &async);
    if (query != ncclSuccess) async = query;
    if (async == ncclSuccess) return absl::OkStatus();
    if (async != ncclInProgress) {
      abort();
      return NcclStatus(async, call, file, line);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      abort();
      return absl::Status(
          on_timeout, absl::StrCat(call, " did not complete within ", timeout.count(), " ms at ",
                                   file, ":", line,
                                   " (a rank of the group never joined, or its device hangs)"));
    }
    if (++polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

}  // namespace

// Owns what Join creates, so that a Join failing halfway releases what it had made.
struct NcclCommunicator::State {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (comm != nullptr && !aborted) {
      // A non-blocking communicator finalizes asynchronously: wait for it (a peer that is gone
      // would hold it, hence the bound), then free it; Settle aborts it otherwise.
      (void)Settle(&comm, &aborted, ncclCommFinalize(comm), "ncclCommFinalize", __FILE__,
                   __LINE__, std::chrono::seconds(10), absl::StatusCode::kDeadlineExceeded);
    }
    if (comm != nullptr) {
      if (aborted) {
        (void)ncclCommAbort(comm);
      } else {
        (void)ncclCommDestroy(comm);
      }
    }
    if (barrier_buffer != nullptr) (void)cudaFree(barrier_buffer);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  bool aborted = false;
  float* barrier_buffer = nullptr;  // one float all-reduced as a barrier
};


absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Connect(
    int rank, int size, int device, gloo::rendezvous::Store& store,
    std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size || device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", size, " on device ",
                                                   device, " is not a valid place in a group"));
  }
  ncclUniqueId id;
  try {
    if (rank == 0) {
      KVGRID_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
      store.set("nccl_unique_id", std::vector<char>(id.internal, id.internal + sizeof(id)));
    } else {
      store.wait({"nccl_unique_id"}, timeout);
      const std::vector<char> bytes = store.get("nccl_unique_id");
      if (bytes.size() != sizeof(id)) {
        return absl::UnavailableError("the group's NCCL id in the store has the wrong size");
      }
      std::memcpy(id.internal, bytes.data(), sizeof(id));
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("sharing the NCCL id: ", e.what()));
  }
  return Join(&id, rank, size, device, timeout);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Connect(
    Communicator& host, int device, std::chrono::milliseconds timeout) {
  const int rank = host.rank(), size = host.size();
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " is not a device"));
  }
  ncclUniqueId id;
  std::string bytes;
  if (rank == 0) {
    KVGRID_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    bytes.assign(id.internal, sizeof(id));
  }
  if (absl::Status s = BroadcastBytes(host, &bytes, /*root=*/0); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("sharing the NCCL id: ", s.message()));
  }
  if (bytes.size() != sizeof(id)) {
    return absl::UnavailableError("the group's NCCL id has the wrong size");
  }
  std::memcpy(id.internal, bytes.data(), sizeof(id));
  return Join(&id, rank, size, device, timeout);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Join(
    const void* id_bytes, int rank, int size, int device, std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  std::memcpy(&id, id_bytes, sizeof(id));
  auto state = std::make_unique<State>();
  state->device = device;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking));
  KVGRID_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&state->barrier_buffer), sizeof(float)));
  // Non-blocking, so that a rank that never joins (its pod never started, its card hangs)
  // cannot hold this one in ncclCommInitRank forever: the join is bounded by `timeout`, then
  // aborted.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  KVGRID_RETURN_IF_ERROR(Settle(&state->comm, &state->aborted,
                                ncclCommInitRankConfig(&state->comm, size, id, rank, &config),
                                "ncclCommInitRankConfig", __FILE__, __LINE__, timeout,
                                absl::StatusCode::kDeadlineExceeded));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state), rank, size, timeout));
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<State> state, int rank, int size,
                                   std::chrono::milliseconds timeout)
    : state_(std::move(state)), rank_(rank), size_(size), timeout_(timeout) {}

NcclCommunicator::~NcclCommunicator() = default;  // State releases the communicator

bool NcclCommunicator::broken() const { return state_->comm == nullptr; }

absl::Status NcclCommunicator::Wait(cudaStream_t stream, const char* what) {
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  int64_t polls = 0;
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return absl::OkStatus();
    if (done != cudaErrorNotReady) {
      return kernels::cuda::CudaStatus(done, "cudaStreamQuery", __FILE__, __LINE__);
    }
    // "Not ready" is no error, but the runtime may keep it as the thread's last error, which
    // the next launch's cudaGetLastError would then report as its own failure.
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    ncclResult_t async = ncclSuccess;
    KVGRID_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(state_->comm, &async));
    if (async == ncclInProgress) async = ncclSuccess;  // a call still settling: not an error
    if (async != ncclSuccess || std::chrono::steady_clock::now() > deadline) {
      state_->aborted = true;
      (void)ncclCommAbort(state_->comm);
      state_->comm = nullptr;
      return absl::UnavailableError(absl::StrCat(
          "nccl ", what, ": ",
          async != ncclSuccess ? ncclGetErrorString(async) : "timed out (a peer is gone?)"));
    }
    // A step's collectives finish in microseconds to milliseconds: spin briefly, then sleep a
    // little, so that a waiting rank does not hold a core the CPU threads could use.
    if (++polls < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::Status NcclCommunicator::AllReduceSum(std::span<float> data) {
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  KVGRID_NCCL_CALL(state_.get(),
                   ncclAllReduce(data.data(), data.data(), data.size(), ncclFloat32, ncclSum,
                                 state_->comm, state_->stream),
                   timeout_);
  return Wait(state_->stream, "allreduce");
}

absl::Status NcclCommunicator::AllGather(std::span<const float> in, std::span<float> out) {
  if (out.size() != in.size() * static_cast<size_t>(size_)) {
    return absl::InvalidArgumentError("AllGather: out must hold size() * in.size() values");
  }
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  KVGRID_NCCL_CALL(state_.get(),
                   ncclAllGather(in.data(), out.data(), in.size(), ncclFloat32, state_->comm,
                                 state_->stream),
                   timeout_);
  return Wait(state_->stream, "allgather");
}

absl::Status NcclCommunicator::Broadcast(std::span<char> data, int root) {
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  KVGRID_NCCL_CALL(state_.get(),
                   ncclBroadcast(data.data(), data.data(), data.size(), ncclInt8, root,
                                 state_->comm, state_->stream),
                   timeout_);
  return Wait(state_->stream, "broadcast");
}

absl::Status NcclCommunicator::Barrier() {
  return AllReduceSum(std::span<float>(state_->barrier_buffer, 1));
}

absl::Status NcclCommunicator::AllReduceSumOn(float* data, int64_t count, cudaStream_t stream) {
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  KVGRID_NCCL_CALL(state_.get(),
                   ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum,
                                 state_->comm, stream),
                   timeout_);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AllGatherOn(const float* in, float* out, int64_t count,
                                           cudaStream_t stream) {
  if (state_->comm == nullptr) return absl::UnavailableError("nccl: the group is broken");
  KVGRID_NCCL_CALL(state_.get(),
                   ncclAllGather(in, out, static_cast<size_t>(count), ncclFloat32, state_->comm,
                                 stream),
                   timeout_);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Synchronize(cudaStream_t stream) {
  return Wait(stream, "step");
}

}  // namespace kvgrid::worker
