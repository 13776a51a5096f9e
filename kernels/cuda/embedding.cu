#include "kernels/cuda/embedding.cuh"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/numeric.cuh"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <model::DType D>
__device__ __forceinline__ float LoadAsFloat(const void* table, int64_t i) {
  if constexpr (D == model::DType::kF32) {
    return static_cast<const float*>(table)[i];
  } else if constexpr (D == model::DType::kF16) {
    return F16BitsToF32(static_cast<const uint16_t*>(table)[i]);
  } else {
    return BF16BitsToF32(static_cast<const uint16_t*>(table)[i]);
  }
}

// One block per token (grid-stride over tokens); the threads copy the row's columns, so reads
// and writes are coalesced.
template <model::DType D>
__global__ void EmbeddingKernel(const void* __restrict__ table, const int32_t* __restrict__ ids,
                                float* __restrict__ output, int32_t* invalid_id_flag,
                                int64_t vocab, int64_t vocab_begin, int64_t table_rows,
                                int64_t hidden, int64_t num_tokens) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t id = ids[t];
    float* y = output + t * hidden;
    if (id < 0 || id >= vocab) {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) y[i] = 0.f;
      if (threadIdx.x == 0 && invalid_id_flag != nullptr) atomicExch(invalid_id_flag, 1);
      continue;
    }
    const int64_t local = static_cast<int64_t>(id) - vocab_begin;
    if (local < 0 || local >= table_rows) {  // another rank's row
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) y[i] = 0.f;
      continue;
    }
    const int64_t row = local * hidden;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      y[i] = LoadAsFloat<D>(table, row + i);
    }
  }
}

}  // namespace

absl::Status EmbeddingParams::Validate() const {
  if (table == nullptr) return absl::InvalidArgumentError("EmbeddingParams.table is null");
  if (output == nullptr) return absl::InvalidArgumentError("EmbeddingParams.output is null");
  if (ids == nullptr && num_tokens > 0) {
    return absl::InvalidArgumentError("EmbeddingParams.ids is null");
  }
  if (table_dtype != model::DType::kF32 && table_dtype != model::DType::kF16 &&
      table_dtype != model::DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("EmbeddingParams.table_dtype must be f32, f16 or bf16, got ",
                     std::string(model::DTypeName(table_dtype))));
  }
  if (!IsAligned(table, model::DTypeSize(table_dtype))) {
    return absl::InvalidArgumentError("EmbeddingParams.table is not aligned to its element size");
  }
  if (!IsAligned(output, alignof(float))) {
    return absl::InvalidArgumentError("EmbeddingParams.output is not 4-byte aligned");
  }
  if (vocab <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("EmbeddingParams.vocab must be > 0: ", vocab));
  }
  if (vocab_begin < 0 || table_rows < 0 || vocab_begin + table_rows > vocab ||
      (table_rows == 0 && vocab_begin != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EmbeddingParams.vocab_begin + table_rows (", vocab_begin, " + ", table_rows,
        ") must lie within the vocabulary of ", vocab));
  }
  if (hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("EmbeddingParams.hidden must be > 0: ", hidden));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("EmbeddingParams.num_tokens must be >= 0: ", num_tokens));
  }
  return absl::OkStatus();
}

absl::Status LaunchEmbedding(const EmbeddingParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0) return absl::OkStatus();
  const unsigned blocks = GridStrideBlocks(p.num_tokens, 1);
  const int64_t rows = p.table_rows == 0 ? p.vocab : p.table_rows;
  switch (p.table_dtype) {
    case model::DType::kF16:
      EmbeddingKernel<model::DType::kF16><<<blocks, kThreads, 0, stream>>>(
          p.table, p.ids, p.output, p.invalid_id_flag, p.vocab, p.vocab_begin, rows, p.hidden,
          p.num_tokens);
      break;
    case model::DType::kBF16:
      EmbeddingKernel<model::DType::kBF16><<<blocks, kThreads, 0, stream>>>(
          p.table, p.ids, p.output, p.invalid_id_flag, p.vocab, p.vocab_begin, rows, p.hidden,
          p.num_tokens);
      break;
    default:
      EmbeddingKernel<model::DType::kF32><<<blocks, kThreads, 0, stream>>>(
          p.table, p.ids, p.output, p.invalid_id_flag, p.vocab, p.vocab_begin, rows, p.hidden,
          p.num_tokens);
      break;
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
