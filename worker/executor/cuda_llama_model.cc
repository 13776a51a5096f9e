#include "worker/executor/cuda_llama_model.h"

#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/interleaved_linear.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/attention_merge.cuh"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/fill_random.cuh"
#include "kernels/cuda/gemm.cuh"
#include "kernels/cuda/kv_write.cuh"
#include "kernels/cuda/paged_attention.cuh"
#include "kernels/cuda/quant_linear.cuh"
#include "kernels/cuda/rms_norm.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/cuda/silu_and_mul.cuh"
#include "model/status_macros.h"

namespace kvgrid::worker {
namespace cuda = kernels::cuda;
namespace cpu = kernels::cpu;

namespace {

int64_t DTypeBytes(model::DType dtype) { return dtype == model::DType::kF32 ? 4 : 2; }

// Host fp32 values as `dtype` bytes (fp32 copied, 16-bit rounded to nearest even).
std::vector<uint16_t> To16(const std::vector<float>& v, model::DType dtype) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = dtype == model::DType::kF16 ? model::F32ToF16(v[i]) : model::F32ToBF16(v[i]);
  }
  return out;
}

absl::StatusOr<DeviceBuffer> Upload(const void* data, int64_t bytes) {
  KVGRID_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(bytes));
  if (bytes > 0) {
    KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.get(), data, static_cast<size_t>(bytes),
                                           cudaMemcpyHostToDevice));
  }
  return b;
}

template <typename T>
absl::StatusOr<DeviceBuffer> UploadVector(const std::vector<T>& v) {
  return Upload(v.data(), static_cast<int64_t>(v.size() * sizeof(T)));
}


// The checks LlamaModel::Forward gets from cpu::PagedAttentionParams::Validate, done on the host
// copies before anything is uploaded: the kernels trust query_start and the block tables.
// With a KV window (every layer slides) the blocks before the first query's window are never
// read and may be holes.
absl::Status CheckBatch(const ForwardBatch& b, int64_t block_size, int64_t num_blocks,
                        int64_t kv_window) {
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(b.seq_lens.size());
  if (n > 0 && num_seqs == 0) return absl::InvalidArgumentError("ForwardBatch: tokens but no sequence");
  if (b.query_start[0] != 0 || b.query_start[num_seqs] != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ForwardBatch: query_start must run from 0 to the ", n, " tokens"));
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = b.query_start[s + 1] - b.query_start[s];
    const int64_t len = b.seq_lens[s];
    if (q_len < 0 || q_len > len) {
      return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: sequence ", s, " has ", q_len,
                                                     " query tokens for a context of ", len));
    }
    const int64_t used = (len + block_size - 1) / block_size;
    if (used > b.max_blocks_per_seq) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ForwardBatch: sequence ", s, " needs ", used, " blocks, the table holds ",
          b.max_blocks_per_seq));
    }
    const int64_t first_key =
        kv_window > 0 ? std::max<int64_t>(0, len - q_len + 1 - kv_window) : 0;
    for (int64_t i = first_key / block_size; i < used; ++i) {
      const int32_t block = b.block_tables[s * b.max_blocks_per_seq + i];
      if (block < 0 || block >= num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("ForwardBatch: sequence ", s, " block ",
                                                       block, " outside the pool of ",
                                                       num_blocks));
      }
    }
  }
  return absl::OkStatus();
}

// A quantized matrix must hold what its shape says before it is uploaded: the kernels read
// rows x row-bytes blocks and cols permutation entries without further checks.
absl::Status CheckQuantized(const cpu::QuantMatrix& q, int64_t rows, int64_t cols,
                            const char* what) {
  if (q.dtype == cpu::WeightDType::kF32 || q.rows != rows || q.cols != cols ||
      cols % cpu::QuantMatrix::BlockElements(q.dtype) != 0 ||
      static_cast<int64_t>(q.data.size()) != rows * q.RowBytes() ||
      (!q.input_perm.empty() && static_cast<int64_t>(q.input_perm.size()) != cols)) {
    return absl::InvalidArgumentError(absl::StrCat("quantized weight ", what, " is malformed (",
                                                   q.rows, " x ", q.cols, ", ", q.data.size(),
                                                   " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status CheckDenseDType(model::DType dtype) {
  if (dtype != model::DType::kF32 && dtype != model::DType::kF16 && dtype != model::DType::kBF16) {
    return absl::InvalidArgumentError("CudaLlamaModel: dense weights must be fp32, fp16 or bf16");
  }
  return absl::OkStatus();
}

// The attention kernels are instantiated for these head sizes.
absl::Status CheckHeadDim(const model::ModelConfig& c) {
  if (c.head_dim != 64 && c.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("the CUDA attention supports head_dim 64 and 128, "
                                                 "not ", c.head_dim));
  }
  return absl::OkStatus();
}

cuda::QuantFormat FormatOf(cpu::WeightDType dtype) {
  switch (dtype) {
    case cpu::WeightDType::kQ8_0: return cuda::QuantFormat::kQ8_0;
    case cpu::WeightDType::kQ4_0: return cuda::QuantFormat::kQ4_0;
    case cpu::WeightDType::kQ4_1: return cuda::QuantFormat::kQ4_1;
    case cpu::WeightDType::kQ5_0: return cuda::QuantFormat::kQ5_0;
    case cpu::WeightDType::kQ5_1: return cuda::QuantFormat::kQ5_1;
    case cpu::WeightDType::kIQ4_NL: return cuda::QuantFormat::kIQ4_NL;
    case cpu::WeightDType::kQ2_K: return cuda::QuantFormat::kQ2_K;
    case cpu::WeightDType::kQ3_K: return cuda::QuantFormat::kQ3_K;
    case cpu::WeightDType::kQ4_K: return cuda::QuantFormat::kQ4_K;
    case cpu::WeightDType::kQ5_K: return cuda::QuantFormat::kQ5_K;
    case cpu::WeightDType::kQ6_K: return cuda::QuantFormat::kQ6_K;
    default: return cuda::QuantFormat::kQ4_Z;
  }
}

}  // namespace

// --- DeviceBuffer -------------------------------------------------------------------------

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int64_t bytes) {
  DeviceBuffer b;
  if (bytes <= 0) return b;
  const cudaError_t err = cudaMalloc(&b.ptr_, static_cast<size_t>(bytes));
  if (err != cudaSuccess) {
    b.ptr_ = nullptr;
    absl::Status s = cuda::CudaStatus(err, "cudaMalloc", __FILE__, __LINE__);
    return absl::Status(s.code(), absl::StrCat(s.message(), " (", bytes, " bytes)"));
  }
  b.bytes_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // nothing to report to from a destructor
}

// --- CudaKvPool ---------------------------------------------------------------------------

CudaKvPool::CudaKvPool(const KvGeometry& geometry, int32_t num_blocks)
    : geometry_(geometry), num_blocks_(num_blocks) {
  static std::atomic<uint64_t> next_id{1};
  id_ = next_id.fetch_add(1);
}

absl::StatusOr<int32_t> CudaKvPool::BlocksFor(const KvGeometry& g, int64_t budget_bytes) {
  if (g.num_layers <= 0 || g.num_kv_heads <= 0 || g.head_dim <= 0 || g.head_dim % 2 != 0 ||
      (g.block_size != 8 && g.block_size != 16 && g.block_size != 32)) {
    return absl::InvalidArgumentError("CudaKvPool: bad KV geometry");
  }
  const int64_t per_block = g.BytesPerBlock();
  const int64_t blocks = budget_bytes / per_block;
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("CudaKvPool: a budget of ", budget_bytes,
                                                   " bytes holds no block of ", per_block));
  }
  if (blocks > INT32_MAX) return absl::InvalidArgumentError("CudaKvPool: too many blocks");
  return static_cast<int32_t>(blocks);
}

absl::StatusOr<std::unique_ptr<CudaKvPool>> CudaKvPool::Create(const KvGeometry& g,
                                                               int64_t budget_bytes) {
  KVGRID_ASSIGN_OR_RETURN(const int32_t blocks, BlocksFor(g, budget_bytes));
  std::unique_ptr<CudaKvPool> pool(new CudaKvPool(g, blocks));
  const kernels::KvRowLayout kr = kernels::KvRowLayoutFor(g.k_dtype, g.head_dim);
  const kernels::KvRowLayout vr = kernels::KvRowLayoutFor(g.v_dtype, g.head_dim);
  const int64_t rows = int64_t{blocks} * g.num_kv_heads * g.block_size;
  const auto plane = [&](int64_t row_bytes, std::vector<DeviceBuffer>& out) -> absl::Status {
    DeviceBuffer b;
    if (row_bytes > 0) {
      KVGRID_ASSIGN_OR_RETURN(b, DeviceBuffer::Allocate(rows * row_bytes));
      KVGRID_CUDA_RETURN_IF_ERROR(cudaMemset(b.get(), 0, static_cast<size_t>(b.bytes())));
    }
    out.push_back(std::move(b));
    return absl::OkStatus();
  };
  for (int64_t layer = 0; layer < g.num_layers; ++layer) {
    KVGRID_RETURN_IF_ERROR(plane(kr.value_bytes, pool->k_));
    KVGRID_RETURN_IF_ERROR(plane(vr.value_bytes, pool->v_));
    KVGRID_RETURN_IF_ERROR(plane(kr.meta_bytes, pool->k_meta_));
    KVGRID_RETURN_IF_ERROR(plane(vr.meta_bytes, pool->v_meta_));
  }
  // cudaMemset on device memory returns before the device is done; any stream may use the
  // pool next.
  KVGRID_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return pool;
}

// --- CudaLlamaModel -----------------------------------------------------------------------

CudaLlamaModel::~CudaLlamaModel() {
  // On the model's device, which the members' buffers are freed on after this body (the
  // calling thread keeps it as its current device); nothing to report to from here.
  (void)cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // nothing to report to from here
  cublas_ = kernels::cuda::CublasHandle();  // before the stream it is bound to
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaLlamaModel::Init(const std::vector<double>& inv_freq) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError("CudaLlamaModel: no CUDA device is visible");
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device_));
  // A blocking stream: it waits for the uploads and memsets issued on the default stream
  // (weights, the ones vector), so none of them needs its own synchronization.
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamCreate(&stream_));
  KVGRID_ASSIGN_OR_RETURN(cublas_, cuda::CublasHandle::Create());
  KVGRID_ASSIGN_OR_RETURN(inv_freq_, UploadVector(inv_freq));
  rope_scale_ = cpu::RopeAttentionFactor(config_);
  KVGRID_ASSIGN_OR_RETURN(flags_, DeviceBuffer::Allocate(2 * sizeof(int32_t)));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemset(flags_.get(), 0, 2 * sizeof(int32_t)));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CudaLlamaModel>> CudaLlamaModel::FromWeights(
    const model::ModelConfig& c, const LlamaWeights& w, model::DType dense_dtype,
    DeviceCommunicator* comm) {
  KVGRID_RETURN_IF_ERROR(CheckDenseDType(dense_dtype));
  KVGRID_RETURN_IF_ERROR(CheckHeadDim(c));
  const TensorParallel tp{.rank = comm == nullptr ? 0 : comm->rank(),
                          .size = comm == nullptr ? 1 : comm->size()};
  KVGRID_RETURN_IF_ERROR(LlamaModel::CheckWeights(c, w, tp));
  const ShardDims d = ShardDimsOf(c, tp);
  if (!w.lm_head_q.empty()) {
    KVGRID_RETURN_IF_ERROR(CheckQuantized(w.lm_head_q, d.vocab_local, d.hidden, "lm_head"));
  }
  KVGRID_ASSIGN_OR_RETURN(std::vector<double> inv_freq, cpu::RopeInvFreq(c));
  std::unique_ptr<CudaLlamaModel> m(new CudaLlamaModel(c, dense_dtype, comm));
  m->dims_ = d;
  KVGRID_RETURN_IF_ERROR(m->Init(inv_freq));

  const auto dense = [&](const std::vector<float>& v) -> absl::StatusOr<DeviceBuffer> {
    if (dense_dtype == model::DType::kF32) return UploadVector(v);
    return UploadVector(To16(v, dense_dtype));
  };
  const auto linear = [&](const std::vector<float>& fp32, const cpu::QuantMatrix& q, int64_t out,
                          int64_t in) -> absl::StatusOr<Linear> {
    Linear l;
    l.out = out;
    l.in = in;
    if (!q.empty() && cpu::IsFloat16(q.dtype)) {
      // 16-bit floats held by the CPU model: the card's dense weights, in its dense dtype.
      KVGRID_RETURN_IF_ERROR(CheckQuantized(q, out, in, "layer"));
      if (!q.input_perm.empty()) {
        return absl::InvalidArgumentError("CudaLlamaModel: a 16-bit layer with an input_perm");
      }
      l.dtype = dense_dtype;
      KVGRID_ASSIGN_OR_RETURN(l.storage, dense(cpu::DequantizeMatrix(q)));
    } else if (!q.empty()) {
      KVGRID_RETURN_IF_ERROR(CheckQuantized(q, out, in, "layer"));
      l.quantized = true;
      l.format = q.dtype;
      // The card reads row-major blocks (the CPU model may hold them interleaved).
      cpu::QuantMatrix row_major;
      if (q.interleaved) row_major = cpu::RowMajor(q);
      KVGRID_ASSIGN_OR_RETURN(l.storage, UploadVector(q.interleaved ? row_major.data : q.data));
      if (!q.input_perm.empty()) {
        KVGRID_ASSIGN_OR_RETURN(l.input_perm, UploadVector(q.input_perm));
      }
    } else {
      l.dtype = dense_dtype;
      KVGRID_ASSIGN_OR_RETURN(l.storage, dense(fp32));
    }
    l.data = l.storage.get();
    return l;
  };
  const int64_t hidden = d.hidden, inter = d.inter, q_dim = d.q_dim, kv_dim = d.kv_dim;
  // A fused projection [out, hidden]: one Linear, or its differently quantized parts.
  const auto fused = [&](const std::vector<float>& fp32, const cpu::QuantMatrix& q,
                         const std::vector<cpu::QuantMatrix>& parts,
                         int64_t out) -> absl::StatusOr<Linear> {
    if (parts.empty()) return linear(fp32, q, out, hidden);
    Linear l;
    l.out = out;
    l.in = hidden;
    for (const cpu::QuantMatrix& part : parts) {
      KVGRID_ASSIGN_OR_RETURN(Linear p, linear({}, part, part.rows, hidden));
      l.parts.push_back(std::move(p));
    }
    return l;
  };
  if (!w.embed_q.empty() && cpu::IsFloat16(w.embed_q.dtype)) {  // a dense table on the card
    KVGRID_RETURN_IF_ERROR(CheckQuantized(w.embed_q, d.vocab_local, hidden, "embed_tokens"));
    KVGRID_ASSIGN_OR_RETURN(m->embed_, dense(cpu::DequantizeMatrix(w.embed_q)));
  } else if (!w.embed_q.empty()) {  // kept in its blocks; the lookup decodes the rows it reads
    KVGRID_RETURN_IF_ERROR(CheckQuantized(w.embed_q, d.vocab_local, hidden, "embed_tokens"));
    if (!w.embed_q.input_perm.empty()) {
      return absl::InvalidArgumentError("CudaLlamaModel: embed_tokens with an input_perm");
    }
    m->embed_format_ = w.embed_q.dtype;
    cpu::QuantMatrix row_major;
    if (w.embed_q.interleaved) row_major = cpu::RowMajor(w.embed_q);
    KVGRID_ASSIGN_OR_RETURN(m->embed_, UploadVector(w.embed_q.interleaved ? row_major.data
                                                                          : w.embed_q.data));
  } else {
    KVGRID_ASSIGN_OR_RETURN(m->embed_, dense(w.embed));
  }
  KVGRID_ASSIGN_OR_RETURN(m->final_norm_, UploadVector(w.final_norm));
  if (!m->leader() && !m->vocab_parallel()) {
    // A replicated head runs on rank 0 only (EnqueueStep): the others hold none.
    m->head_.out = d.vocab_local;
    m->head_.in = hidden;
  } else if (!w.lm_head_q.empty() || !w.lm_head.empty()) {
    KVGRID_ASSIGN_OR_RETURN(m->head_, linear(w.lm_head, w.lm_head_q, d.vocab_local, hidden));
  } else {
    m->TieHeadToEmbedding();
  }
  for (const LayerWeights& lw : w.layers) {
    Layer l;
    KVGRID_ASSIGN_OR_RETURN(l.input_norm, UploadVector(lw.input_norm));
    KVGRID_ASSIGN_OR_RETURN(l.post_norm, UploadVector(lw.post_norm));
    KVGRID_ASSIGN_OR_RETURN(l.qkv_bias, UploadVector(lw.qkv_bias));
    KVGRID_ASSIGN_OR_RETURN(l.o_bias, UploadVector(lw.o_bias));
    KVGRID_ASSIGN_OR_RETURN(l.q_norm, UploadVector(lw.q_norm));
    KVGRID_ASSIGN_OR_RETURN(l.k_norm, UploadVector(lw.k_norm));
    KVGRID_ASSIGN_OR_RETURN(l.qkv, fused(lw.qkv, lw.qkv_q, lw.qkv_parts, q_dim + 2 * kv_dim));
    KVGRID_ASSIGN_OR_RETURN(l.o, linear(lw.o, lw.o_q, hidden, q_dim));
    KVGRID_ASSIGN_OR_RETURN(l.gate_up,
                            fused(lw.gate_up, lw.gate_up_q, lw.gate_up_parts, 2 * inter));
    KVGRID_ASSIGN_OR_RETURN(l.down, linear(lw.down, lw.down_q, hidden, inter));
    m->layers_.push_back(std::move(l));
  }
  return m;
}

absl::StatusOr<std::unique_ptr<CudaLlamaModel>> CudaLlamaModel::Random(
    const model::ModelConfig& c, model::DType dense_dtype, uint64_t seed) {
  KVGRID_RETURN_IF_ERROR(CheckDenseDType(dense_dtype));
  KVGRID_RETURN_IF_ERROR(CheckHeadDim(c));
  KVGRID_ASSIGN_OR_RETURN(std::vector<double> inv_freq, cpu::RopeInvFreq(c));
  std::unique_ptr<CudaLlamaModel> m(new CudaLlamaModel(c, dense_dtype, nullptr));
  m->dims_ = ShardDimsOf(c);
  KVGRID_RETURN_IF_ERROR(m->Init(inv_freq));
  const int64_t hidden = c.hidden_size, hd = c.head_dim, inter = c.intermediate_size;
  const int64_t q_dim = c.num_attention_heads * hd, kv_dim = c.num_key_value_heads * hd;
  uint64_t stream_id = seed * 1000003;
  const auto random = [&](int64_t n, model::DType dtype,
                          float std_dev) -> absl::StatusOr<DeviceBuffer> {
    KVGRID_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(n * DTypeBytes(dtype)));
    // Uniform in [-a, a] has std a / sqrt(3).
    KVGRID_RETURN_IF_ERROR(cuda::LaunchFillRandom({.output = b.get(), .dtype = dtype,
                                                   .num_elements = n,
                                                   .amplitude = std_dev * std::sqrt(3.f),
                                                   .seed = ++stream_id},
                                                  m->stream_));
    return b;
  };
  const auto ones = [&](int64_t n) { return UploadVector(std::vector<float>(n, 1.f)); };
  const auto linear = [&](int64_t out, int64_t in) -> absl::StatusOr<Linear> {
    Linear l;
    l.out = out;
    l.in = in;
    l.dtype = dense_dtype;
    KVGRID_ASSIGN_OR_RETURN(l.storage,
                            random(out * in, dense_dtype, 1.f / std::sqrt(static_cast<float>(in))));
    l.data = l.storage.get();
    return l;
  };
  KVGRID_ASSIGN_OR_RETURN(m->embed_, random(c.vocab_size * hidden, dense_dtype, 1.f));
  KVGRID_ASSIGN_OR_RETURN(m->final_norm_, ones(hidden));
  if (c.tie_word_embeddings) {
    m->TieHeadToEmbedding();
  } else {
    KVGRID_ASSIGN_OR_RETURN(m->head_, linear(c.vocab_size, hidden));
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    Layer l;
    KVGRID_ASSIGN_OR_RETURN(l.input_norm, ones(hidden));
    KVGRID_ASSIGN_OR_RETURN(l.post_norm, ones(hidden));
    if (c.qk_norm) {
      KVGRID_ASSIGN_OR_RETURN(l.q_norm, ones(hd));
      KVGRID_ASSIGN_OR_RETURN(l.k_norm, ones(hd));
    }
    if (c.attention_bias) {
      KVGRID_ASSIGN_OR_RETURN(l.qkv_bias, random(q_dim + 2 * kv_dim, model::DType::kF32, 0.02f));
    }
    KVGRID_ASSIGN_OR_RETURN(l.qkv, linear(q_dim + 2 * kv_dim, hidden));
    KVGRID_ASSIGN_OR_RETURN(l.o, linear(hidden, q_dim));
    KVGRID_ASSIGN_OR_RETURN(l.gate_up, linear(2 * inter, hidden));
    KVGRID_ASSIGN_OR_RETURN(l.down, linear(hidden, inter));
    m->layers_.push_back(std::move(l));
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m->stream_));
  return m;
}

void CudaLlamaModel::TieHeadToEmbedding() {
  head_ = Linear();
  head_.out = dims_.vocab_local;
  head_.in = dims_.hidden;
  head_.dtype = dense_dtype_;
  head_.data = embed_.get();
  if (embed_format_ != cpu::WeightDType::kF32) {  // the embedding's own blocks
    head_.quantized = true;
    head_.format = embed_format_;
  }
}

int64_t CudaLlamaModel::WeightBytes() const {
  int64_t n = embed_.bytes() + final_norm_.bytes() + head_.storage.bytes();
  for (const Layer& l : layers_) {
    n += l.input_norm.bytes() + l.post_norm.bytes() + l.qkv_bias.bytes() + l.o_bias.bytes() +
         l.q_norm.bytes() + l.k_norm.bytes();
    for (const Linear* x : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      n += x->storage.bytes() + x->input_perm.bytes();
      for (const Linear& p : x->parts) n += p.storage.bytes() + p.input_perm.bytes();
    }
  }
  return n;
}

KvGeometry CudaLlamaModel::KvGeometryFor(int64_t block_size, kernels::KvDType k_dtype,
                                         kernels::KvDType v_dtype) const {
  KvGeometry g;
  g.num_layers = config_.num_hidden_layers;
  g.num_kv_heads = dims_.kv_heads;
  g.head_dim = config_.head_dim;
  g.block_size = block_size;
  g.k_dtype = k_dtype;
  g.v_dtype = v_dtype;
  return g;
}

absl::Status CudaLlamaModel::RunLinear(const Linear& l, const float* input, const float* bias,
                                       float* output, int64_t n, bool accumulate) {
  if (n == 0) return absl::OkStatus();
  if (!l.parts.empty()) {
    int64_t row = 0;  // the part's first output row: its columns of `output`
    for (const Linear& p : l.parts) {
      const cuda::QuantLinearParams params{.input = input,
                                           .weight = static_cast<const uint8_t*>(p.data),
                                           .input_perm = p.input_perm.as<const int32_t>(),
                                           .bias = bias ? bias + row : nullptr,
                                           .output = output + row,
                                           .format = FormatOf(p.format),
                                           .num_tokens = n,
                                           .in_features = p.in,
                                           .out_features = p.out,
                                           .accumulate = accumulate,
                                           .output_stride = l.out};
      KVGRID_RETURN_IF_ERROR(cuda::LaunchQuantLinear(params, stream_));
      row += p.out;
    }
    return absl::OkStatus();
  }
  if (l.quantized) {
    return cuda::LaunchQuantLinear({.input = input,
                                    .weight = static_cast<const uint8_t*>(l.data),
                                    .input_perm = l.input_perm.as<const int32_t>(),
                                    .bias = bias,
                                    .output = output,
                                    .format = FormatOf(l.format),
                                    .num_tokens = n,
                                    .in_features = l.in,
                                    .out_features = l.out,
                                    .accumulate = accumulate},
                                   stream_);
  }
  if (l.dtype != model::DType::kF32) {
    KVGRID_RETURN_IF_ERROR(cuda::LaunchCast(
        {.input = input, .output = cast_.get(), .dtype = l.dtype, .num_elements = n * l.in},
        stream_));
    return cuda::LaunchGemm({.input = cast_.get(),
                             .weight = l.data,
                             .bias = bias,
                             .output = output,
                             .dtype = l.dtype,
                             .num_tokens = n,
                             .in_features = l.in,
                             .out_features = l.out,
                             .accumulate = accumulate},
                            cublas_, stream_);
  }
  // fp32: row-major output[n, out] = input[n, in] x W[out, in]^T is, column-major,
  // output^T[out, n] = W^T... i.e. op(A) = W (A = W as a column-major [in, out], transposed).
  cublasHandle_t h = cublas_.get();
  KVGRID_RETURN_IF_ERROR(cublas_.Bind(stream_));
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  // Plain fp32 FMAs (no TF32), so logits follow the CPU reference.
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  const float one = 1.f;
  float beta = accumulate ? 1.f : 0.f;
  if (bias != nullptr) {
    // output (+)= bias broadcast over rows: a rank-1 product bias[out] x ones[n].
    KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(l.out),
                                              static_cast<int>(n), 1, &one, bias,
                                              static_cast<int>(l.out), ones_.as<float>(), 1, &beta,
                                              output, static_cast<int>(l.out)));
    beta = 1.f;
  }
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(l.out),
                                            static_cast<int>(n), static_cast<int>(l.in), &one,
                                            static_cast<const float*>(l.data),
                                            static_cast<int>(l.in), input, static_cast<int>(l.in),
                                            &beta, output, static_cast<int>(l.out)));
  KVGRID_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::Reserve(int64_t tokens, int64_t seqs, int64_t max_blocks,
                                     int64_t logit_rows) {
  const ShardDims& d = dims_;
  const int64_t hidden = d.hidden, inter = d.inter, q_dim = d.q_dim, kv_dim = d.kv_dim;
  if (tokens > cap_tokens_) {
    const int64_t t = std::max<int64_t>(tokens, 2 * cap_tokens_);
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(ids_, t * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(positions_, t * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(slots_, t * 8));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(x_, t * hidden * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(h_, t * hidden * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(qkv_, t * (q_dim + 2 * kv_dim) * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(q_, t * q_dim * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(k_, t * kv_dim * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(v_, t * kv_dim * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(attn_, t * q_dim * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(gate_up_, t * 2 * inter * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(act_, t * inter * 4));
    cap_tokens_ = t;
  }
  if (cp_size_ > 1) {
    const int64_t part = cap_tokens_ * (q_dim + d.heads) * 4;
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(cp_part_, part));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(cp_gathered_, cp_size_ * part));
  }
  if (seqs > cap_seqs_) {
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(query_start_, (seqs + 1) * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(seq_lens_, seqs * 4));
    cap_seqs_ = seqs;
  }
  KVGRID_RETURN_IF_ERROR(GrowStepBuffer(block_tables_, std::max<int64_t>(1, seqs * max_blocks) * 4));
  if (logit_rows > cap_rows_) {
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(rows_, logit_rows * hidden * 4));
    KVGRID_RETURN_IF_ERROR(GrowStepBuffer(logits_, logit_rows * d.vocab_local * 4));
    if (vocab_parallel()) {
      // [size, rows, vocab_local]: size * vocab_local = vocab.
      KVGRID_RETURN_IF_ERROR(GrowStepBuffer(gathered_, logit_rows * d.vocab * 4));
    }
    cap_rows_ = logit_rows;
  }
  // A GEMM's 16-bit input copy and the bias GEMM's ones serve token rows and logit rows alike.
  const int64_t rows = std::max(cap_tokens_, cap_rows_);
  KVGRID_RETURN_IF_ERROR(GrowStepBuffer(cast_, rows * std::max({hidden, q_dim, inter}) * 2));
  if (ones_.bytes() < rows * 4) {
    KVGRID_ASSIGN_OR_RETURN(ones_, UploadVector(std::vector<float>(rows, 1.f)));
    ++buffers_generation_;
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::Forward(const ForwardBatch& b, CudaKvPool& pool,
                                     std::vector<float>* logits) {
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  KVGRID_RETURN_IF_ERROR(b.ValidateSizes());
  const KvGeometry& g = pool.geometry();
  if (g.num_layers != config_.num_hidden_layers || g.num_kv_heads != dims_.kv_heads ||
      g.head_dim != config_.head_dim) {
    return absl::InvalidArgumentError("KV pool geometry does not match the model");
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // the engine's thread, not the loader's
  if (logits != nullptr) logits->clear();
  if (n == 0) return absl::OkStatus();
  KVGRID_RETURN_IF_ERROR(CheckBatch(b, g.block_size, int64_t{cp_size_} * pool.num_blocks(),
                                    config_.KvWindow()));
  if (cp_size_ > 1) {
    // The batch in this rank's ids; every rank checks the whole of it first (alike, so that
    // none is left alone in a collective).
    cp_batch_ = b;
    KVGRID_RETURN_IF_ERROR(LocalizeContextParallelBatch(
        b, {.cp_size = cp_size_, .blocks_per_rank = pool.num_blocks()},
        static_cast<int32_t>(g.block_size), cp_rank_, &cp_batch_.slots, &cp_batch_.block_tables));
    return ForwardLocal(cp_batch_, pool, logits);
  }
  return ForwardLocal(b, pool, logits);
}

absl::Status CudaLlamaModel::ForwardLocal(const ForwardBatch& b, CudaKvPool& pool,
                                          std::vector<float>* logits) {
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t num_seqs = static_cast<int64_t>(b.seq_lens.size());
  int32_t max_seq_len = 0, max_query_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    max_seq_len = std::max(max_seq_len, b.seq_lens[s]);
    max_query_len = std::max(max_query_len, b.query_start[s + 1] - b.query_start[s]);
  }
  const int64_t m = static_cast<int64_t>(b.logit_rows.size());
  // A plain decode step: one query token per sequence, logits for each, in order.
  bool plain_decode = decode_padding_ && max_query_len == 1 && n == num_seqs &&
                      n <= kMaxGraphBatch && m == n;
  for (int64_t i = 0; plain_decode && i < m; ++i) plain_decode = b.logit_rows[i] == i;
  if (plain_decode) return ForwardDecodeGraph(b, max_seq_len, pool, logits);

  const StepShape shape{.tokens = n,
                        .seqs = num_seqs,
                        .max_blocks = b.max_blocks_per_seq,
                        .max_seq_len = max_seq_len,
                        .max_query_len = max_query_len};
  KVGRID_RETURN_IF_ERROR(PrepareStep(shape, pool, m));
  KVGRID_RETURN_IF_ERROR(UploadInputs(b));
  KVGRID_RETURN_IF_ERROR(EnqueueStep(shape, pool, b.logit_rows));
  ++graph_stats_.eager_steps;
  return FinishStep(m, m, logits);
}

absl::Status CudaLlamaModel::UploadInputs(const ForwardBatch& b) {
  const auto upload = [&](DeviceBuffer& dst, const auto& v) -> absl::Status {
    if (v.empty()) return absl::OkStatus();
    KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.get(), v.data(), v.size() * sizeof(v[0]),
                                                cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  };
  KVGRID_RETURN_IF_ERROR(upload(ids_, b.token_ids));
  KVGRID_RETURN_IF_ERROR(upload(positions_, b.positions));
  KVGRID_RETURN_IF_ERROR(upload(slots_, b.slots));
  KVGRID_RETURN_IF_ERROR(upload(query_start_, b.query_start));
  KVGRID_RETURN_IF_ERROR(upload(seq_lens_, b.seq_lens));
  KVGRID_RETURN_IF_ERROR(upload(block_tables_, b.block_tables));
  return absl::OkStatus();
}

cuda::PagedAttentionParams CudaLlamaModel::AttentionParams(const StepShape& shape,
                                                           const CudaKvPool& pool) const {
  const KvGeometry& g = pool.geometry();
  const int64_t hd = config_.head_dim;
  return {.query = q_.as<float>(),
          .output = attn_.as<float>(),
          .k_dtype = g.k_dtype,
          .v_dtype = g.v_dtype,
          .block_tables = block_tables_.as<int32_t>(),
          .seq_lens = seq_lens_.as<int32_t>(),
          .query_start = query_start_.as<int32_t>(),
          .num_seqs = shape.seqs,
          .num_tokens = shape.tokens,
          .max_blocks_per_seq = shape.max_blocks,
          .num_blocks = pool.num_blocks(),
          .num_heads = dims_.heads,
          .num_kv_heads = dims_.kv_heads,
          .block_size = g.block_size,
          .head_dim = hd,
          .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))),
          .max_seq_len = shape.max_seq_len,
          .max_query_len = shape.max_query_len,
          .workspace = attn_workspace_.get(),
          .workspace_bytes = attn_workspace_.bytes()};
}

absl::Status CudaLlamaModel::PrepareStep(const StepShape& shape, const CudaKvPool& pool,
                                         int64_t logit_rows) {
  KVGRID_RETURN_IF_ERROR(Reserve(shape.tokens, shape.seqs, shape.max_blocks, logit_rows));
  const int64_t need = cuda::PagedAttentionWorkspaceBytes(AttentionParams(shape, pool));
  if (need <= attn_workspace_.bytes()) return absl::OkStatus();
  // Grown to a power of two: contexts grow token by token, and every new allocation drops the
  // decode graphs, so it should happen a few times in a process's life, not at every prefill.
  int64_t bytes = 4096;
  while (bytes < need) bytes *= 2;
  return GrowStepBuffer(attn_workspace_, bytes);
}

absl::Status CudaLlamaModel::GrowStepBuffer(DeviceBuffer& buffer, int64_t bytes) {
  if (buffer.bytes() >= bytes) return absl::OkStatus();
  // Contents are not kept. The new buffer is allocated before the old one is freed, so a
  // failure leaves `buffer` as it was (still valid at its old size); cudaFree waits for the
  // device, so a buffer an earlier step still reads is not pulled away.
  KVGRID_ASSIGN_OR_RETURN(DeviceBuffer bigger, DeviceBuffer::Allocate(std::max<int64_t>(bytes, 256)));
  buffer = std::move(bigger);
  if (steps_reserved_) ++graph_stats_.buffer_moves;
  ++buffers_generation_;
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::EnqueueStep(const StepShape& shape, CudaKvPool& pool,
                                         const std::vector<int32_t>& logit_rows) {
  const model::ModelConfig& c = config_;
  const ShardDims& d = dims_;
  const KvGeometry& g = pool.geometry();
  const int64_t n = shape.tokens;
  const int64_t m = static_cast<int64_t>(logit_rows.size());
  const int64_t hidden = d.hidden, hd = d.head_dim, inter = d.inter;
  const int64_t heads = d.heads, kv_heads = d.kv_heads;
  const int64_t q_dim = d.q_dim, kv_dim = d.kv_dim, qkv_dim = d.qkv_dim;
  // A row-parallel layer's partial products: rank 0 adds them to the residual stream (and its
  // bias), the others overwrite it with theirs, and the all-reduce sums the group's.
  const bool accumulate = leader();
  const auto all_reduce_x = [&]() -> absl::Status {
    if (comm_ == nullptr) return absl::OkStatus();
    return comm_->AllReduceSumOn(x_.as<float>(), n * hidden, stream_);
  };
  const float eps = static_cast<float>(c.rms_norm_eps);
  int32_t* flags = flags_.as<int32_t>();

  // Flags a step's kernels raise are this step's alone, whether or not the last one read them.
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags, 0, 2 * sizeof(int32_t), stream_));
  if (embed_format_ != cpu::WeightDType::kF32) {
    KVGRID_RETURN_IF_ERROR(
        cuda::LaunchQuantEmbedding({.table = embed_.as<const uint8_t>(),
                                    .ids = ids_.as<int32_t>(),
                                    .output = x_.as<float>(),
                                    .invalid_id_flag = flags,
                                    .format = FormatOf(embed_format_),
                                    .vocab = d.vocab,
                                    .vocab_begin = d.vocab_begin,
                                    .table_rows = d.vocab_local,
                                    .hidden = hidden,
                                    .num_tokens = n},
                                   stream_));
  } else {
    KVGRID_RETURN_IF_ERROR(cuda::LaunchEmbedding({.table = embed_.get(),
                                                  .ids = ids_.as<int32_t>(),
                                                  .output = x_.as<float>(),
                                                  .invalid_id_flag = flags,
                                                  .table_dtype = dense_dtype_,
                                                  .vocab = d.vocab,
                                                  .vocab_begin = d.vocab_begin,
                                                  .table_rows = d.vocab_local,
                                                  .hidden = hidden,
                                                  .num_tokens = n},
                                                 stream_));
  }
  if (vocab_parallel()) KVGRID_RETURN_IF_ERROR(all_reduce_x());
  cuda::PagedAttentionParams attention = AttentionParams(shape, pool);
  // Context parallelism: this rank's share and its lse side by side, gathered as one.
  const int64_t cp_part = n * (q_dim + heads);
  if (cp_size_ > 1) {
    attention.output = cp_part_.as<float>();
    attention.lse = cp_part_.as<float>() + n * q_dim;
  }

  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const Layer& l = layers_[layer];
    KVGRID_RETURN_IF_ERROR(cuda::LaunchRmsNorm({.input = x_.as<float>(),
                                                .weight = l.input_norm.as<float>(),
                                                .output = h_.as<float>(),
                                                .num_tokens = n,
                                                .hidden = hidden,
                                                .eps = eps},
                                               stream_));
    KVGRID_RETURN_IF_ERROR(RunLinear(l.qkv, h_.as<float>(), l.qkv_bias.as<float>(),
                                     qkv_.as<float>(), n, false));
    // q, k and v as separate [n, heads, head_dim] arrays, for RoPE and the KV write.
    const auto split = [&](DeviceBuffer& dst, int64_t offset, int64_t width) -> absl::Status {
      KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          dst.get(), width * sizeof(float), qkv_.as<float>() + offset, qkv_dim * sizeof(float),
          width * sizeof(float), n, cudaMemcpyDeviceToDevice, stream_));
      return absl::OkStatus();
    };
    KVGRID_RETURN_IF_ERROR(split(q_, 0, q_dim));
    KVGRID_RETURN_IF_ERROR(split(k_, q_dim, kv_dim));
    KVGRID_RETURN_IF_ERROR(split(v_, q_dim + kv_dim, kv_dim));
    if (c.qk_norm) {  // Qwen3: each head's q and k RMS-normalized, before RoPE
      KVGRID_RETURN_IF_ERROR(cuda::LaunchRmsNorm({.input = q_.as<float>(),
                                                  .weight = l.q_norm.as<float>(),
                                                  .output = q_.as<float>(),
                                                  .num_tokens = n * heads,
                                                  .hidden = hd,
                                                  .eps = eps},
                                                 stream_));
      KVGRID_RETURN_IF_ERROR(cuda::LaunchRmsNorm({.input = k_.as<float>(),
                                                  .weight = l.k_norm.as<float>(),
                                                  .output = k_.as<float>(),
                                                  .num_tokens = n * kv_heads,
                                                  .hidden = hd,
                                                  .eps = eps},
                                                 stream_));
    }
    KVGRID_RETURN_IF_ERROR(cuda::LaunchRope({.query = q_.as<float>(),
                                             .key = k_.as<float>(),
                                             .positions = positions_.as<int32_t>(),
                                             .inv_freq = inv_freq_.as<double>(),
                                             .scale = rope_scale_,
                                             .num_tokens = n,
                                             .num_heads = heads,
                                             .num_kv_heads = kv_heads,
                                             .head_dim = hd},
                                            stream_));
    KVGRID_RETURN_IF_ERROR(cuda::LaunchKvWrite({.key = k_.as<float>(),
                                                .value = v_.as<float>(),
                                                .slots = slots_.as<int64_t>(),
                                                .k_cache = pool.k(layer),
                                                .v_cache = pool.v(layer),
                                                .k_meta = pool.k_meta(layer),
                                                .v_meta = pool.v_meta(layer),
                                                .invalid_slot_flag = flags + 1,
                                                .k_dtype = g.k_dtype,
                                                .v_dtype = g.v_dtype,
                                                .num_tokens = n,
                                                .num_blocks = pool.num_blocks(),
                                                .num_kv_heads = kv_heads,
                                                .block_size = g.block_size,
                                                .head_dim = hd},
                                               stream_));
    attention.k_cache = pool.k(layer);
    attention.v_cache = pool.v(layer);
    attention.k_meta = pool.k_meta(layer);
    attention.v_meta = pool.v_meta(layer);
    attention.window = c.LayerWindow(layer);
    KVGRID_RETURN_IF_ERROR(cuda::LaunchPagedAttention(attention, stream_));
    if (cp_size_ > 1) {
      KVGRID_RETURN_IF_ERROR(cp_comm_->AllGatherOn(cp_part_.as<float>(),
                                                   cp_gathered_.as<float>(), cp_part, stream_));
      KVGRID_RETURN_IF_ERROR(
          cuda::LaunchMergeAttentionPartials({.outputs = cp_gathered_.as<float>(),
                                              .lses = cp_gathered_.as<float>() + n * q_dim,
                                              .out = attn_.as<float>(),
                                              .parts = cp_size_,
                                              .rows = n * heads,
                                              .head_dim = hd,
                                              .part_stride = cp_part},
                                             stream_));
    }
    // The residual adds are the GEMMs' accumulate.
    KVGRID_RETURN_IF_ERROR(RunLinear(l.o, attn_.as<float>(),
                                     leader() ? l.o_bias.as<float>() : nullptr, x_.as<float>(),
                                     n, accumulate));
    KVGRID_RETURN_IF_ERROR(all_reduce_x());
    KVGRID_RETURN_IF_ERROR(cuda::LaunchRmsNorm({.input = x_.as<float>(),
                                                .weight = l.post_norm.as<float>(),
                                                .output = h_.as<float>(),
                                                .num_tokens = n,
                                                .hidden = hidden,
                                                .eps = eps},
                                               stream_));
    KVGRID_RETURN_IF_ERROR(RunLinear(l.gate_up, h_.as<float>(), nullptr, gate_up_.as<float>(), n,
                                     false));
    KVGRID_RETURN_IF_ERROR(cuda::LaunchSiluAndMul({.gate_up = gate_up_.as<float>(),
                                                   .output = act_.as<float>(),
                                                   .num_tokens = n,
                                                   .intermediate = inter},
                                                  stream_));
    KVGRID_RETURN_IF_ERROR(
        RunLinear(l.down, act_.as<float>(), nullptr, x_.as<float>(), n, accumulate));
    KVGRID_RETURN_IF_ERROR(all_reduce_x());
  }

  // A replicated head is rank 0's alone: the others' logits would be dropped (and CP ranks
  // other than 0 hold the same rows).
  if (m > 0 && runs_head()) {
    // Only the requested rows go through the final norm and the vocabulary projection; runs of
    // consecutive rows (a decode step's are all one run) are one copy.
    for (int64_t i = 0; i < m;) {
      int64_t run = 1;
      while (i + run < m && logit_rows[i + run] == logit_rows[i] + run) ++run;
      KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
          rows_.as<float>() + i * hidden, x_.as<float>() + int64_t{logit_rows[i]} * hidden,
          run * hidden * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      i += run;
    }
    KVGRID_RETURN_IF_ERROR(cuda::LaunchRmsNorm({.input = rows_.as<float>(),
                                                .weight = final_norm_.as<float>(),
                                                .output = rows_.as<float>(),
                                                .num_tokens = m,
                                                .hidden = hidden,
                                                .eps = eps},
                                               stream_));
    KVGRID_RETURN_IF_ERROR(RunLinear(head_, rows_.as<float>(), nullptr, logits_.as<float>(), m,
                                     false));
    if (vocab_parallel()) {
      KVGRID_RETURN_IF_ERROR(
          comm_->AllGatherOn(logits_.as<float>(), gathered_.as<float>(), m * d.vocab_local,
                             stream_));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::FinishStep(int64_t rows, int64_t step_rows,
                                        std::vector<float>* logits) {
  if (logits == nullptr) return absl::OkStatus();
  logits->clear();
  const bool copy = leader() && cp_rank_ == 0 && rows > 0;
  if (copy) logits->resize(static_cast<size_t>(rows * dims_.vocab));
  int32_t host_flags[2] = {0, 0};
  // The step's collectives first, with the group's timeout: a copy into pageable memory
  // returns only once the stream before it is done, so a collective whose peer is gone
  // would hold the host inside cudaMemcpyAsync, where no timeout applies.
  if (comm_ != nullptr) KVGRID_RETURN_IF_ERROR(comm_->Synchronize(stream_));
  if (cp_comm_ != nullptr) KVGRID_RETURN_IF_ERROR(cp_comm_->Synchronize(stream_));
  if (copy && vocab_parallel()) {
    // gathered_ is [size, step_rows, vocab_local]: rank r's slice is columns
    // [r * vocab_local, (r + 1) * vocab_local) of every row.
    const int64_t local = dims_.vocab_local;
    for (int64_t r = 0; r < comm_->size(); ++r) {
      KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
          logits->data() + r * local, dims_.vocab * sizeof(float),
          gathered_.as<float>() + r * step_rows * local, local * sizeof(float),
          local * sizeof(float), rows, cudaMemcpyDeviceToHost, stream_));
    }
  } else if (copy) {
    KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(logits->data(), logits_.get(),
                                                logits->size() * sizeof(float),
                                                cudaMemcpyDeviceToHost, stream_));
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_flags, flags_.get(), sizeof(host_flags),
                                              cudaMemcpyDeviceToHost, stream_));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (host_flags[0] != 0 || host_flags[1] != 0) {
    // Unlike the CPU model, which refuses the batch before writing anything, the valid tokens'
    // K/V are already in the pool by now; the caller frees the sequence.
    logits->clear();
    return absl::InvalidArgumentError(host_flags[0] != 0
                                          ? "ForwardBatch: a token id is outside the vocabulary"
                                          : "ForwardBatch: a KV slot is outside the pool");
  }
  return absl::OkStatus();
}

namespace {

// Blocks per sequence a step of sequences up to `max_seq_len` tokens may carry: the power of two
// a graph's padded block tables have (PadDecodeBatch), at least one.
int64_t PaddedBlocks(int64_t max_seq_len, int64_t block_size) {
  const int64_t needed = std::max<int64_t>(1, (max_seq_len + block_size - 1) / block_size);
  int64_t blocks = 1;
  while (blocks < needed) blocks *= 2;
  return blocks;
}

}  // namespace

int64_t CudaLlamaModel::PaddedSeqs(int64_t max_seqs) {
  return std::max(max_seqs, DecodeGraphBatch(std::min(max_seqs, kMaxGraphBatch)));
}

int64_t CudaLlamaModel::AttentionWorkspaceBytes(int64_t max_seqs, int64_t max_seq_len,
                                                int64_t block_size) const {
  if (max_seqs <= 0 || max_seq_len <= 0 || block_size <= 0) return 0;
  // Eager steps carry the longest context as it is, graph replays its power-of-two bound.
  cuda::PagedAttentionParams bounds;
  bounds.num_seqs = PaddedSeqs(max_seqs);
  bounds.num_heads = dims_.heads;
  bounds.num_kv_heads = dims_.kv_heads;
  bounds.block_size = block_size;
  bounds.head_dim = config_.head_dim;
  bounds.max_seq_len = PaddedBlocks(max_seq_len, block_size) * block_size;
  return cuda::PagedAttentionMaxWorkspaceBytes(bounds);
}

absl::Status CudaLlamaModel::ReserveSteps(int64_t max_tokens, int64_t max_seqs,
                                          int64_t max_seq_len, int64_t block_size) {
  KVGRID_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const int64_t seqs = PaddedSeqs(max_seqs);
  KVGRID_RETURN_IF_ERROR(Reserve(std::max(max_tokens, seqs), seqs,
                                 PaddedBlocks(max_seq_len, block_size), seqs));
  KVGRID_RETURN_IF_ERROR(GrowStepBuffer(
      attn_workspace_, AttentionWorkspaceBytes(max_seqs, max_seq_len, block_size)));
  steps_reserved_ = true;
  return absl::OkStatus();
}

int64_t CudaLlamaModel::DecodeGraphBatch(int64_t n) {
  if (n <= 2) return n;
  if (n <= 4) return 4;
  return (n + 7) / 8 * 8;
}

void CudaLlamaModel::PadDecodeBatch(const ForwardBatch& b, int32_t max_seq_len,
                                    int64_t block_size, ForwardBatch* padded) {
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t batch = DecodeGraphBatch(n);
  const int64_t max_blocks = PaddedBlocks(max_seq_len, block_size);
  ForwardBatch& p = *padded;
  p.token_ids.assign(b.token_ids.begin(), b.token_ids.end());
  p.token_ids.resize(batch, 0);
  p.positions.assign(b.positions.begin(), b.positions.end());
  p.positions.resize(batch, 0);
  p.slots.assign(b.slots.begin(), b.slots.end());
  p.slots.resize(batch, -1);
  p.query_start.resize(batch + 1);
  for (int64_t i = 0; i <= batch; ++i) p.query_start[i] = static_cast<int32_t>(i);
  p.seq_lens.assign(b.seq_lens.begin(), b.seq_lens.end());
  p.seq_lens.resize(batch, 0);
  p.max_blocks_per_seq = max_blocks;
  p.block_tables.assign(batch * max_blocks, 0);
  const int64_t copy = std::min(max_blocks, b.max_blocks_per_seq);
  for (int64_t s = 0; s < n; ++s) {
    std::copy_n(b.block_tables.begin() + s * b.max_blocks_per_seq, copy,
                p.block_tables.begin() + s * max_blocks);
  }
  p.logit_rows.resize(batch);
  for (int64_t i = 0; i < batch; ++i) p.logit_rows[i] = static_cast<int32_t>(i);
}

void CudaLlamaModel::GraphExecDeleter::operator()(cudaGraphExec_t exec) const {
  (void)cudaGraphExecDestroy(exec);  // a failure leaves nothing to recover
}

void CudaLlamaModel::SetDecodeGraphs(bool enabled) {
  decode_padding_ = enabled;
  graphs_enabled_ = enabled;
  if (enabled) graph_stats_.disabled_by.clear();
  if (enabled && ((comm_ != nullptr && !comm_->capturable()) ||
                  (cp_comm_ != nullptr && !cp_comm_->capturable()))) {
    StopGraphs("the group's collectives cannot be captured (staged through host memory)");
  }
  if (!enabled) graphs_.clear();
}

absl::StatusOr<bool> CudaLlamaModel::AllRanksAgree(bool mine) {
  if (agree_.get() == nullptr) {
    KVGRID_ASSIGN_OR_RETURN(agree_, DeviceBuffer::Allocate(sizeof(float)));
  }
  const float vote = mine ? 0.f : 1.f;  // the sum counts the ranks that disagree
  float votes = 0.f;
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(agree_.get(), &vote, sizeof(vote),
                                              cudaMemcpyHostToDevice, stream_));
  // Over the TP ranks, then over the CP ranks of those sums: every rank of the group counts.
  for (DeviceCommunicator* c : {comm_, cp_comm_}) {
    if (c == nullptr) continue;
    KVGRID_RETURN_IF_ERROR(c->AllReduceSumOn(agree_.as<float>(), 1, stream_));
    // Waited for before the copy back, which would block without a timeout (see FinishStep).
    KVGRID_RETURN_IF_ERROR(c->Synchronize(stream_));
  }
  KVGRID_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&votes, agree_.get(), sizeof(votes),
                                              cudaMemcpyDeviceToHost, stream_));
  KVGRID_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return votes == 0.f;
}

void CudaLlamaModel::StopGraphs(const std::string& why) {
  graph_stats_.disabled_by = why;
  graphs_enabled_ = false;
  graphs_.clear();
  // Alone, padding without graphs is wasted work. In a group it stays: every rank must run
  // the same shapes, so that the collectives' sizes match whatever the others capture.
  decode_padding_ = in_group();
}

absl::Status CudaLlamaModel::SetContextParallel(int rank, int size, DeviceCommunicator* comm) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("context parallel: rank ", rank, " of ", size, " ranks"));
  }
  if ((size > 1) != (comm != nullptr) ||
      (comm != nullptr && (comm->rank() != rank || comm->size() != size))) {
    return absl::InvalidArgumentError(
        "context parallel: a group needs its device communicator, of the same rank and size");
  }
  cp_rank_ = rank;
  cp_size_ = size;
  cp_comm_ = comm;
  ++buffers_generation_;  // graphs captured before hold no context-parallel collectives
  return absl::OkStatus();
}

absl::Status CudaLlamaModel::ForwardDecodeGraph(const ForwardBatch& b, int32_t max_seq_len,
                                                CudaKvPool& pool, std::vector<float>* logits) {
  const int64_t n = static_cast<int64_t>(b.token_ids.size());
  const int64_t block_size = pool.geometry().block_size;
  ForwardBatch& p = padded_;
  PadDecodeBatch(b, max_seq_len, block_size, &p);
  const int64_t batch = static_cast<int64_t>(p.token_ids.size());
  const int64_t max_blocks = p.max_blocks_per_seq;

  const StepShape shape{.tokens = batch,
                        .seqs = batch,
                        .max_blocks = max_blocks,
                        .max_seq_len = static_cast<int32_t>(max_blocks * block_size),
                        .max_query_len = 1};
  KVGRID_RETURN_IF_ERROR(PrepareStep(shape, pool, batch));
  KVGRID_RETURN_IF_ERROR(UploadInputs(p));
  if (graphs_generation_ != buffers_generation_) {  // a buffer moved: the graphs are stale
    graphs_.clear();
    graphs_generation_ = buffers_generation_;
  }
  if (!graphs_enabled_) {  // a group's padded step, kernel by kernel
    KVGRID_RETURN_IF_ERROR(EnqueueStep(shape, pool, p.logit_rows));
    ++graph_stats_.eager_steps;
    return FinishStep(n, batch, logits);
  }
  // A graph holds the group's collectives as they were captured: after the communicator was
  // aborted and released they would run on freed state (a fault, or a stream that never ends).
  for (const DeviceCommunicator* c : {comm_, cp_comm_}) {
    if (c != nullptr && c->broken()) {
      return absl::UnavailableError("the group's collectives broke; no graph replays them");
    }
  }
  const GraphKey key{batch, max_blocks, pool.id()};
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    KVGRID_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second.get(), stream_));
    ++graph_stats_.replays;
    return FinishStep(n, batch, logits);
  }

  // First step of this shape: run it eagerly (this step's results), then capture it.
  KVGRID_RETURN_IF_ERROR(EnqueueStep(shape, pool, p.logit_rows));
  ++graph_stats_.eager_steps;
  // ThreadLocal: this thread's unsafe calls during the capture are refused; the engine makes
  // none, and no other thread uses the model's stream.
  std::string failure;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (const cudaError_t begun = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
      begun != cudaSuccess) {
    failure = absl::StrCat("cudaStreamBeginCapture: ", cudaGetErrorString(begun));
  } else {
    const absl::Status enqueued = EnqueueStep(shape, pool, p.logit_rows);
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);  // always ends the capture
    if (!enqueued.ok()) {
      failure = std::string(enqueued.message());
    } else if (ended != cudaSuccess || graph == nullptr) {
      failure = absl::StrCat("cudaStreamEndCapture: ", cudaGetErrorString(ended));
    } else if (const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
               made != cudaSuccess) {
      failure = absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(made));
    }
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  if (!failure.empty()) (void)cudaGetLastError();  // reported below, not to the next call
  if (in_group()) {
    // NCCL wants a collective captured on every rank or on none: the group keeps graphs only
    // if every rank captured this one (every rank captures at the same step).
    KVGRID_ASSIGN_OR_RETURN(const bool everyone, AllRanksAgree(failure.empty()));
    if (!everyone && failure.empty()) failure = "another rank of the group failed to capture";
  }
  if (!failure.empty()) {
    // The eager step stands; later steps stay eager (padded, in a group).
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    StopGraphs(failure);
    return FinishStep(n, batch, logits);
  }
  graphs_.emplace(key, GraphExec(exec));
  ++graph_stats_.captures;
  return FinishStep(n, batch, logits);
}

}  // namespace kvgrid::worker
