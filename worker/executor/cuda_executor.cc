#include "worker/executor/cuda_executor.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "model/status_macros.h"
#include "worker/kv/kv_planner.h"

namespace kvgrid::worker {

namespace cuda = kernels::cuda;

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(int64_t bytes) {
  PinnedBuffer b;
  if (bytes <= 0) return b;
  const cudaError_t err = cudaMallocHost(&b.ptr_, static_cast<size_t>(bytes));
  if (err != cudaSuccess) {
    b.ptr_ = nullptr;
    absl::Status s = cuda::CudaStatus(err, "cudaMallocHost", __FILE__, __LINE__);
    return absl::ResourceExhaustedError(absl::StrCat(s.message(), " (", bytes, " bytes)"));
  }
  b.bytes_ = bytes;
  std::memset(b.ptr_, 0, static_cast<size_t>(bytes));
  return b;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

namespace {

// The longest sequence the executor plans its step buffers for.
int64_t MaxSeqLen(const CudaLlamaModel& model, const CudaPoolOptions& options) {
  return options.max_model_len > 0 ? options.max_model_len
                                   : model.config().max_position_embeddings;
}

}  // namespace

absl::StatusOr<CudaExecutor::LocalSizes> CudaExecutor::SizeLocally(const CudaLlamaModel& model,
                                                                   const PoolOptions& options,
                                                                   const KvGeometry& geometry) {
  if (options.swap_space < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--swap-space: must be >= 0, got ", options.swap_space));
  }
  if (options.ranks_on_card < 1) {
    return absl::InvalidArgumentError("CudaPoolOptions.ranks_on_card must be >= 1");
  }
  LocalSizes sizes{.graphs = options.cuda_graphs ? 1 : 0};
  int64_t budget = options.kv_cache_memory;
  if (budget <= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    KVGRID_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
    // Ranks sharing the card share its utilization: each takes its part of what the weights
    // (all of theirs, loaded by now) and every rank's step workspace leave.
    const int64_t shares = options.ranks_on_card;
    const int64_t workspace =
        StepWorkspaceBytes(model.config(), options.max_num_batched_tokens, options.max_num_seqs) +
        model.AttentionWorkspaceBytes(options.max_num_seqs, MaxSeqLen(model, options),
                                      geometry.block_size);
    KVGRID_ASSIGN_OR_RETURN(
        budget, GpuKvBudget(static_cast<int64_t>(total_bytes), static_cast<int64_t>(free_bytes),
                            options.gpu_memory_utilization, shares * workspace));
    budget /= shares;
  }
  absl::StatusOr<int32_t> blocks = CudaKvPool::BlocksFor(geometry, budget);
  if (!blocks.ok()) {
    return absl::Status(blocks.status().code(),
                        absl::StrCat("KV cache: ", blocks.status().message()));
  }
  sizes.blocks = *blocks;
  const int64_t per_block = geometry.BytesPerBlock();  // > 0: BlocksFor checked the geometry
  if (options.swap_space > 0) {
    sizes.swap_blocks = options.swap_space / per_block;
    if (sizes.swap_blocks < 1 || sizes.swap_blocks > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--swap-space: ", options.swap_space, " bytes must hold between one block (",
          per_block, " bytes) and 2^31 blocks"));
    }
  }
  return sizes;
}

absl::StatusOr<std::unique_ptr<CudaExecutor>> CudaExecutor::Create(
    std::unique_ptr<CudaLlamaModel> model, const PoolOptions& options, TensorParallel tp,
    std::unique_ptr<DeviceCommunicator> device_comm, ContextParallel cp,
    std::unique_ptr<DeviceCommunicator> cp_device_comm) {
  KVGRID_RETURN_IF_ERROR(tp.Validate(model->config()));
  KVGRID_RETURN_IF_ERROR(cp.Validate());
  if ((tp.size > 1) != (device_comm != nullptr) ||
      (device_comm != nullptr && (device_comm->rank() != tp.rank ||
                                  device_comm->size() != tp.size))) {
    return absl::InvalidArgumentError(
        "CudaExecutor: a group's executor needs its device communicator, of the same rank");
  }
  if ((cp.size > 1) != (cp_device_comm != nullptr) || model->cp_size() != cp.size ||
      model->cp_rank() != cp.rank ||
      (cp_device_comm != nullptr &&
       (cp_device_comm->rank() != cp.rank || cp_device_comm->size() != cp.size))) {
    return absl::InvalidArgumentError(
        "CudaExecutor: a context-parallel rank needs the model's CP device communicator");
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(model->device()));
  const KvGeometry geometry =
      model->KvGeometryFor(options.block_size, options.k_dtype, options.v_dtype);
  // The group's host meshes: over the TP ranks, then over the CP ranks of the TP results,
  // which reaches every rank of a T x C group.
  std::vector<Communicator*> meshes;
  if (tp.size > 1) meshes.push_back(tp.comm);
  if (cp.size > 1) meshes.push_back(cp.comm);
  const auto min_across = [&](std::span<int64_t> values) -> absl::Status {
    for (Communicator* mesh : meshes) KVGRID_RETURN_IF_ERROR(MinAcrossGroup(*mesh, values));
    return absl::OkStatus();
  };
  // Every rank's weights are on its card before any measures what is left of it.
  for (Communicator* mesh : meshes) KVGRID_RETURN_IF_ERROR(mesh->Barrier());
  absl::StatusOr<LocalSizes> local = SizeLocally(*model, options, geometry);
  if (!meshes.empty()) {
    // The leader's engine hands out pool and swap blocks by its own counts, and every rank
    // must run the same step shapes: the group takes the smallest counts and runs graphs only
    // if every rank asked for them. A rank that cannot size its pool sends -1, and the group
    // fails together rather than waiting for it.
    const LocalSizes mine = local.ok() ? *local : LocalSizes{.blocks = -1};
    int64_t agreed[] = {mine.blocks, mine.swap_blocks, mine.graphs};
    KVGRID_RETURN_IF_ERROR(min_across(agreed));
    if (local.ok() && agreed[0] < 0) {
      return absl::UnavailableError("KV cache: another rank of the group could not size its pool");
    }
    if (local.ok()) local = LocalSizes{.blocks = agreed[0], .swap_blocks = agreed[1],
                                       .graphs = agreed[2]};
  }
  if (!local.ok()) return local.status();
  absl::StatusOr<std::unique_ptr<CudaExecutor>> executor =
      Allocate(std::move(model), options, geometry, *local);
  if (!meshes.empty()) {
    // Out of device or pinned memory on one rank fails the group now, not at its first step.
    int64_t all_ok[] = {executor.ok() ? 1 : 0};
    KVGRID_RETURN_IF_ERROR(min_across(all_ok));
    if (executor.ok() && all_ok[0] == 0) {
      return absl::UnavailableError("KV cache: another rank of the group could not allocate");
    }
  }
  if (!executor.ok()) return executor.status();
  (*executor)->tp_ = tp;
  (*executor)->device_comm_ = std::move(device_comm);
  (*executor)->cp_ = cp;
  (*executor)->cp_device_comm_ = std::move(cp_device_comm);
  return executor;
}

absl::StatusOr<std::unique_ptr<CudaExecutor>> CudaExecutor::Allocate(
    std::unique_ptr<CudaLlamaModel> model, const PoolOptions& options,
    const KvGeometry& geometry, const LocalSizes& sizes) {
  absl::StatusOr<std::unique_ptr<CudaKvPool>> pool =
      CudaKvPool::Create(geometry, sizes.blocks * geometry.BytesPerBlock());
  if (!pool.ok()) {
    return absl::Status(pool.status().code(),
                        absl::StrCat("KV cache: ", pool.status().message()));
  }
  std::unique_ptr<CudaExecutor> executor(new CudaExecutor(std::move(model), *std::move(pool)));
  executor->model_->SetDecodeGraphs(sizes.graphs != 0);
  // Taken now from the room GpuKvBudget left for it. No sequence outgrows the group's pools.
  const int64_t pools_tokens =
      sizes.blocks * geometry.block_size * std::max(1, executor->model_->cp_size());
  if (absl::Status s = executor->model_->ReserveSteps(
          options.max_num_batched_tokens, options.max_num_seqs,
          std::min(MaxSeqLen(*executor->model_, options), pools_tokens), geometry.block_size);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("step workspace: ", s.message()));
  }
  if (sizes.swap_blocks > 0) {
    const int64_t blocks = sizes.swap_blocks;
    executor->num_swap_blocks_ = static_cast<int32_t>(blocks);
    for (int64_t layer = 0; layer < geometry.num_layers; ++layer) {
      for (int plane = 0; plane < 4; ++plane) {
        KVGRID_ASSIGN_OR_RETURN(PinnedBuffer b,
                                PinnedBuffer::Allocate(blocks * executor->PlaneBlockBytes(plane)));
        executor->swap_.push_back(std::move(b));
      }
    }
  }
  return executor;
}

int64_t CudaExecutor::PlaneBlockBytes(int plane) const {
  const KvGeometry& g = pool_->geometry();
  const kernels::KvRowLayout l =
      kernels::KvRowLayoutFor(plane % 2 == 0 ? g.k_dtype : g.v_dtype, g.head_dim);
  return g.num_kv_heads * g.block_size * (plane < 2 ? l.value_bytes : l.meta_bytes);
}

void* CudaExecutor::DevicePlane(int64_t layer, int plane) const {
  switch (plane) {
    case 0: return pool_->k(layer);
    case 1: return pool_->v(layer);
    case 2: return pool_->k_meta(layer);
    default: return pool_->v_meta(layer);
  }
}

absl::Status CudaExecutor::Forward(const ForwardBatch& batch, std::vector<float>* logits) {
  absl::Status s = model_->Forward(batch, *pool_, logits);
  if (s.ok() || s.code() == absl::StatusCode::kUnavailable) return s;
  // After a fault in a kernel, the call that reports it first may be cuBLAS's or NCCL's, with
  // a status of their own (INTERNAL here): the context is lost all the same, and the worker
  // must leave (UNAVAILABLE), not fail its requests one step at a time.
  if (const cudaError_t e = cudaPeekAtLastError(); kernels::cuda::IsStickyCudaError(e)) {
    return kernels::cuda::CudaStatus(e, std::string(s.message()).c_str(), __FILE__, __LINE__);
  }
  return s;
}

absl::Status CudaExecutor::CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) {
  if (cp_.size > 1) {
    KVGRID_RETURN_IF_ERROR(LocalizeBlockCopies(kind, copies, cp_.size, cp_.rank, num_blocks(),
                                               num_swap_blocks_, &local_copies_));
    copies = local_copies_;
  }
  if (kind != BlockCopyKind::kDeviceToDevice && num_swap_blocks_ == 0) {
    return absl::FailedPreconditionError("block copy: a swap without a swap space");
  }
  const int32_t src_blocks = kind == BlockCopyKind::kSwapToDevice ? num_swap_blocks_ : num_blocks();
  const int32_t dst_blocks = kind == BlockCopyKind::kDeviceToSwap ? num_swap_blocks_ : num_blocks();
  for (const BlockCopy& c : copies) {
    if (c.src < 0 || c.src >= src_blocks || c.dst < 0 || c.dst >= dst_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block copy ", c.src, " -> ", c.dst,
                                                     ": outside the pool (", num_blocks(),
                                                     " blocks) or swap space (",
                                                     num_swap_blocks_, ")"));
    }
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(model_->device()));
  const cudaMemcpyKind direction = kind == BlockCopyKind::kDeviceToDevice
                                       ? cudaMemcpyDeviceToDevice
                                       : kind == BlockCopyKind::kDeviceToSwap
                                             ? cudaMemcpyDeviceToHost
                                             : cudaMemcpyHostToDevice;
  // On the model's stream: a copy is ordered after the forward passes that wrote its source
  // and before the ones that read its destination.
  for (int64_t layer = 0; layer < pool_->geometry().num_layers; ++layer) {
    for (int plane = 0; plane < 4; ++plane) {
      const int64_t bytes = PlaneBlockBytes(plane);
      if (bytes == 0) continue;  // no metadata plane for float dtypes
      auto* device = static_cast<std::byte*>(DevicePlane(layer, plane));
      auto* host = num_swap_blocks_ > 0 ? static_cast<std::byte*>(swap_[layer * 4 + plane].get())
                                        : nullptr;
      std::byte* src_base = kind == BlockCopyKind::kSwapToDevice ? host : device;
      std::byte* dst_base = kind == BlockCopyKind::kDeviceToSwap ? host : device;
      for (const BlockCopy& c : copies) {
        KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst_base + c.dst * bytes,
                                                    src_base + c.src * bytes,
                                                    static_cast<size_t>(bytes), direction,
                                                    model_->stream()));
      }
    }
  }
  // Swaps are waited for: they are rare, and the engine times them to choose between swapping
  // and recomputing (a copy still queued would look free and slow down the next step).
  if (kind != BlockCopyKind::kDeviceToDevice) {
    KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_->stream()));
  }
  return absl::OkStatus();
}

CudaExecutor::~CudaExecutor() {
  // Copies into or out of the pinned swap space may still be queued; wait before freeing it.
  if (model_ != nullptr) cudaStreamSynchronize(model_->stream());
}

}  // namespace kvgrid::worker
