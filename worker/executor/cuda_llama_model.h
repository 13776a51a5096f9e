// The Llama-family decoder on one GPU, composed from kernels/cuda: the same forward pass as
// LlamaModel (CPU) — fused q/k/v and gate/up, Qwen3's per-head q/k RMSNorm (the rms_norm
// kernel over [tokens * heads, head_dim] rows), RoPE with every scaling the CPU takes (the
// same frequency table and YaRN attention factor), paged KV written in the pool's dtypes,
// paged attention, SiLU-gated MLP, logits for the rows asked for — with device weights and a
// device KV pool laid out as KvPool's.
//
// Weights: fp32 (cuBLAS SGEMM without TF32, so logits track the CPU reference to fp32 noise;
// for tests), fp16/bf16 (activations cast to the weights' type, fp32 accumulate; what a
// deployment runs), or the CPU's quantized blocks (Q8_0/Q4_0/Q4_1/Q4_Z and every GGUF block
// type, uploaded as they are and dequantized inside kernels/cuda/quant_linear). A GGUF layer
// whose q/k/v or gate/up differ in type keeps each part in its own blocks (Linear::parts, each
// run into its columns of the fused output); a GGUF embedding in blocks stays in them (the
// lookup decodes only the rows it reads, and a tied head multiplies the same blocks).
// Activations stay fp32 between ops.
//
// Tensor parallelism: with a DeviceCommunicator of size T the model holds rank r's share of the
// weights, sharded as LlamaModel shards them (ShardDimsOf): its q heads and KV heads, its
// gate/up columns and o/down input slices, its rows of the embedding and the head when the
// vocabulary divides evenly. o_proj and down_proj write partial sums that are all-reduced in
// the residual stream (rank 0 adds the residual and the bias, the others only their partial
// product), the vocabulary-parallel lookup is all-reduced and the head's logits gathered; the
// collectives are enqueued on the model's stream. Every rank runs the same Forward; rank 0
// gets the logits.
//
// Context parallelism (SetContextParallel): with a second DeviceCommunicator of size C the
// model is one of C ranks that hold the same weights and KV heads and split every sequence's
// blocks (worker/kv/context_parallel_layout.h). Batches carry the group's block ids; each rank
// checks the whole batch, maps it to its own pool's ids (-1 elsewhere), writes and attends
// over its own blocks, and after each layer's attention one all-gather of [output | lse] on
// the stream and LaunchMergeAttentionPartials give every rank the exact attention over all
// blocks. Only CP rank 0 runs the head.
//
// Decode steps can be replayed from CUDA graphs (SetDecodeGraphs): a step whose every sequence
// has one query token is padded to a batch bucket (1, 2, 4, 8, then multiples of 8 up to
// kMaxGraphBatch) and a power-of-two bound on the blocks per sequence; padding rows write no KV
// (slot -1) and see no context. The first step of each (bucket, bound, pool) runs eagerly on the
// padded inputs, which warms every kernel and cuBLAS call, and is then captured; later steps of
// that shape launch the graph, the same kernels with the same arguments, so a replay gives the
// eager padded step's results bit for bit. A capture that fails turns graphs off for the model
// and is reported in decode_graph_stats(); the step still completes eagerly.
//
// Not thread-safe: one engine thread drives a model and its pool; every call enqueues on the
// model's stream and Forward synchronizes once, when the logits come back.
#ifndef KVGRID_WORKER_EXECUTOR_CUDA_LLAMA_MODEL_H_
#define KVGRID_WORKER_EXECUTOR_CUDA_LLAMA_MODEL_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cublas_handle.h"
#include "kernels/cuda/paged_attention.cuh"
#include "model/dtype.h"
#include "model/model_config.h"
#include "worker/comm/device_communicator.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

// Device memory owned by one object (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  // Errors: RESOURCE_EXHAUSTED naming cudaMalloc and the size when the device is full.
  static absl::StatusOr<DeviceBuffer> Allocate(int64_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  [[nodiscard]] void* get() const { return ptr_; }
  [[nodiscard]] int64_t bytes() const { return bytes_; }
  template <typename T>
  [[nodiscard]] T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// One GPU's KV arenas, laid out as KvPool's (kernels/kv_dtype.h), zero-filled.
class CudaKvPool {
 public:
  // As many blocks as `budget_bytes` holds. Errors: INVALID_ARGUMENT for a bad geometry or a
  // budget below one block; RESOURCE_EXHAUSTED when the device cannot hold it.
  static absl::StatusOr<std::unique_ptr<CudaKvPool>> Create(const KvGeometry& geometry,
                                                            int64_t budget_bytes);
  // The blocks `budget_bytes` holds, as Create counts them. Errors: INVALID_ARGUMENT for a
  // geometry the pool and the kernels do not take (block size 8, 16 or 32, an even head_dim,
  // positive counts), or a budget below one block or above 2^31 blocks.
  static absl::StatusOr<int32_t> BlocksFor(const KvGeometry& geometry, int64_t budget_bytes);

  [[nodiscard]] const KvGeometry& geometry() const { return geometry_; }
  [[nodiscard]] int32_t num_blocks() const { return num_blocks_; }
  // Unique among the pools of this process (graphs captured on one pool name it).
  [[nodiscard]] uint64_t id() const { return id_; }
  [[nodiscard]] int64_t bytes() const { return num_blocks_ * geometry_.BytesPerBlock(); }
  // Device pointers of `layer`'s planes; the meta planes are null for float dtypes.
  [[nodiscard]] void* k(int64_t layer) const { return k_[layer].get(); }
  [[nodiscard]] void* v(int64_t layer) const { return v_[layer].get(); }
  [[nodiscard]] void* k_meta(int64_t layer) const { return k_meta_[layer].get(); }
  [[nodiscard]] void* v_meta(int64_t layer) const { return v_meta_[layer].get(); }

 private:
  CudaKvPool(const KvGeometry& geometry, int32_t num_blocks);

  KvGeometry geometry_;
  int32_t num_blocks_;
  uint64_t id_;
  std::vector<DeviceBuffer> k_, v_, k_meta_, v_meta_;  // one per layer
};

class CudaLlamaModel {
 public:
  // Uploads `weights` (fp32 on the host, or quantized where LlamaWeights holds QuantMatrix
  // blocks) to the current CUDA device, converting dense matrices to `dense_dtype` (kF32, kF16
  // or kBF16). Without `comm` the weights are the whole model's; with it (not owned; it must
  // outlive the model) they are rank comm->rank()'s share of comm->size() (LlamaModel::Load or
  // ShardWeights with the same rank and size).
  // Errors: INVALID_ARGUMENT for sizes that disagree with `config` or a bad dtype or split;
  // RESOURCE_EXHAUSTED when the device is full; INTERNAL naming a failed CUDA/cuBLAS call
  // (FAILED_PRECONDITION when no device is visible).
  static absl::StatusOr<std::unique_ptr<CudaLlamaModel>> FromWeights(
      const model::ModelConfig& config, const LlamaWeights& weights, model::DType dense_dtype,
      DeviceCommunicator* comm = nullptr);

  // Deterministic random dense weights made on the device (std ~ 1/sqrt(fan_in), norms 1), for
  // benchmarks of shapes too large to build on the host; the whole model (no tensor
  // parallelism). Errors: as FromWeights.
  // (Both: UNIMPLEMENTED for a head_dim other than 64 or 128, the attention kernels' sizes.)
  static absl::StatusOr<std::unique_ptr<CudaLlamaModel>> Random(const model::ModelConfig& config,
                                                                model::DType dense_dtype,
                                                                uint64_t seed);

  ~CudaLlamaModel();
  CudaLlamaModel(const CudaLlamaModel&) = delete;
  CudaLlamaModel& operator=(const CudaLlamaModel&) = delete;

  [[nodiscard]] const model::ModelConfig& config() const { return config_; }
  // This rank's dimensions (the whole model's without a communicator).
  [[nodiscard]] const ShardDims& dims() const { return dims_; }
  // The CUDA device the model lives on; every call makes it the calling thread's current one.
  [[nodiscard]] int device() const { return device_; }
  [[nodiscard]] int64_t WeightBytes() const;
  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  // The KV geometry this model writes: this rank's KV heads (dtypes and block size the
  // caller's).
  [[nodiscard]] KvGeometry KvGeometryFor(int64_t block_size, kernels::KvDType k_dtype,
                                         kernels::KvDType v_dtype) const;

  // Runs `batch` (the CPU ForwardBatch, uploaded here), writes the new K/V into `pool` and,
  // when `logits` is not null, fills it with [batch.logit_rows.size(), vocab] floats (copied back;
  // the call then waits for the device). With `logits` null nothing is waited for: benchmarks
  // time steps with events on stream().
  // Errors: INVALID_ARGUMENT for malformed batches: sizes, query_start, context lengths and
  // block tables are checked on the host first, as LlamaModel::Forward does; a token id outside
  // the vocabulary or a slot outside the pool is found by the kernels and reported once the
  // step is waited for (by then the batch's valid rows are written: free the sequences);
  // INTERNAL naming a failed CUDA/cuBLAS call; UNAVAILABLE when a group collective fails (the
  // group is then broken). Ranks other than 0 of a group get no logits (`logits` is cleared).
  absl::Status Forward(const ForwardBatch& batch, CudaKvPool& pool, std::vector<float>* logits);

  // Makes this model rank `rank` of a context-parallel group of `size` (1: none) whose
  // collectives go through `comm` (not owned; it must outlive the model; null for size 1).
  // Call before the first Forward and before SetDecodeGraphs; every rank of the group calls it.
  // Errors: INVALID_ARGUMENT for a size below 1, a rank outside [0, size), or a communicator
  // missing or of another rank or size.
  absl::Status SetContextParallel(int rank, int size, DeviceCommunicator* comm);
  [[nodiscard]] int cp_rank() const { return cp_rank_; }
  [[nodiscard]] int cp_size() const { return cp_size_; }

  // Allocates, now, the step buffers for steps of up to `max_tokens` tokens and `max_seqs`
  // sequences (decode graphs' padded batches included) of up to `max_seq_len` tokens each in
  // blocks of `block_size` (the block tables, padded as graphs pad them), and the attention
  // kernels' split-K partials for the largest such step (AttentionWorkspaceBytes): serving then
  // neither fails for memory mid-request nor drops graphs as sequences grow.
  // Errors: RESOURCE_EXHAUSTED naming cudaMalloc; as CudaStatus for cudaSetDevice.
  absl::Status ReserveSteps(int64_t max_tokens, int64_t max_seqs, int64_t max_seq_len,
                            int64_t block_size);
  // Bytes of the split-K partials the decode attention of the largest step ReserveSteps plans
  // for needs: the most over every batch of up to `max_seqs` sequences (padded) and every
  // context up to `max_seq_len` (cuda::PagedAttentionMaxWorkspaceBytes). Not in
  // StepWorkspaceBytes: it grows with both (Llama-3-8B, 256 sequences of 128K tokens: about
  // 1 GiB), so the pool's budget takes it from this.
  [[nodiscard]] int64_t AttentionWorkspaceBytes(int64_t max_seqs, int64_t max_seq_len,
                                                int64_t block_size) const;

  // Decode steps of at most this many sequences can run from graphs.
  static constexpr int64_t kMaxGraphBatch = 256;
  // The batch bucket of a decode step of n sequences: 1, 2, 4, 8, then multiples of 8.
  static int64_t DecodeGraphBatch(int64_t n);
  // `b` (a plain decode step whose longest context is max_seq_len) padded as a graph runs it:
  // DecodeGraphBatch(n) rows, the padding rows decoding token 0 at position 0 into no slot (-1,
  // which the KV write skips) with no context (their attention output is zeros); block tables
  // max_blocks_per_seq = the power of two >= the blocks max_seq_len needs; logits for every row.
  static void PadDecodeBatch(const ForwardBatch& b, int32_t max_seq_len, int64_t block_size,
                             ForwardBatch* padded);
  // Turns decode graphs on or off (off at construction). Turning them off frees the graphs.
  // They stay off in a group whose collectives cannot be captured (decode_graph_stats() says
  // why). In a group, decode steps are padded whenever graphs were turned on, captured or not,
  // so that every rank's collectives have the same sizes; every rank must make the same call.
  // Not for use with another thread in Forward.
  void SetDecodeGraphs(bool enabled);
  struct DecodeGraphStats {
    int64_t captures = 0;      // graphs captured (each after one eager padded step)
    int64_t replays = 0;       // decode steps launched from a graph
    int64_t eager_steps = 0;   // steps run kernel by kernel (prefill, large or first decodes,
                               // and a group's padded decodes when it has no graphs)
    std::string disabled_by;   // why a capture failed and graphs were turned off, else empty
    int64_t buffer_moves = 0;  // step buffers grown after ReserveSteps (each drops the graphs)
  };
  [[nodiscard]] const DecodeGraphStats& decode_graph_stats() const { return graph_stats_; }

  // A linear layer on the device: dense [out, in] in `dtype`, or quantized blocks.
  struct Linear {
    DeviceBuffer storage;     // the weights, unless they are another buffer's (a tied head)
    const void* data = nullptr;  // storage.get(), or the buffer it shares
    DeviceBuffer input_perm;  // int32 [in] or empty (quantized only)
    bool quantized = false;
    kernels::cpu::WeightDType format = kernels::cpu::WeightDType::kF32;  // when quantized
    model::DType dtype = model::DType::kF32;                            // when dense
    int64_t out = 0, in = 0;
    // A fused projection whose parts are quantized differently (LayerWeights::qkv_parts): each
    // part a quantized Linear of the next rows of `out`, run into its columns of the output;
    // this Linear then holds no weights of its own.
    std::vector<Linear> parts;
  };
  struct Layer {
    DeviceBuffer input_norm, post_norm, qkv_bias, o_bias;  // fp32
    DeviceBuffer q_norm, k_norm;  // fp32 [head_dim] (Qwen3), else empty
    Linear qkv, o, gate_up, down;
  };

 private:
  CudaLlamaModel(const model::ModelConfig& config, model::DType dense_dtype,
                 DeviceCommunicator* comm)
      : config_(config), dense_dtype_(dense_dtype), comm_(comm) {}
  absl::Status Init(const std::vector<double>& inv_freq);
  // Rank 0 of the group, or the model alone: adds the residual and biases, returns logits.
  [[nodiscard]] bool leader() const { return comm_ == nullptr || comm_->rank() == 0; }
  // Whether this rank runs the head and returns logits: TP rank 0 (or a vocabulary-parallel
  // head's ranks) of CP rank 0.
  [[nodiscard]] bool runs_head() const { return cp_rank_ == 0 && (leader() || vocab_parallel()); }
  // Part of a group of several ranks (TP, CP or both): every rank runs the same shapes.
  [[nodiscard]] bool in_group() const { return comm_ != nullptr || cp_comm_ != nullptr; }
  // The head's logits are split by vocabulary over the group (gathered after the head).
  [[nodiscard]] bool vocab_parallel() const { return dims_.vocab_local < dims_.vocab; }
  // The head reads the embedding table (tie_word_embeddings): no copy.
  void TieHeadToEmbedding();
  // output [n, l.out] (+)= input [n, l.in] x W^T (+ bias): fp32 SGEMM, cast + 16-bit GEMM, or
  // the quantized kernel.
  absl::Status RunLinear(const Linear& l, const float* input, const float* bias, float* output,
                         int64_t n, bool accumulate);
  // Sequences a step of at most `max_seqs` may carry once a decode is padded to its graph's
  // batch bucket.
  static int64_t PaddedSeqs(int64_t max_seqs);
  // Workspaces sized for `tokens` tokens, `seqs` sequences and `logit_rows` rows (grown,
  // never shrunk).
  absl::Status Reserve(int64_t tokens, int64_t seqs, int64_t max_blocks, int64_t logit_rows);
  // Grows a step buffer; a new allocation invalidates the captured graphs (they hold the old
  // addresses), so it bumps buffers_generation_.
  absl::Status GrowStepBuffer(DeviceBuffer& buffer, int64_t bytes);

  // A step's sizes, as the kernels are launched with them.
  struct StepShape {
    int64_t tokens = 0, seqs = 0, max_blocks = 0;
    int32_t max_seq_len = 0, max_query_len = 0;
  };
  // The attention launch of a step (the layer's arenas left for the caller to set).
  kernels::cuda::PagedAttentionParams AttentionParams(const StepShape& shape,
                                                      const CudaKvPool& pool) const;
  // Sizes every step buffer and the attention workspace for `shape`.
  absl::Status PrepareStep(const StepShape& shape, const CudaKvPool& pool, int64_t logit_rows);
  // Uploads the step inputs (host arrays laid out as ForwardBatch's).
  absl::Status UploadInputs(const ForwardBatch& b);
  // Enqueues a whole step on stream_ over the uploaded inputs: flags reset, layers, and the
  // final norm and head for `logit_rows` (rows of the step's tokens). Capturable: no host
  // synchronization and no allocation once Reserve and the attention workspace are sized.
  absl::Status EnqueueStep(const StepShape& shape, CudaKvPool& pool,
                           const std::vector<int32_t>& logit_rows);
  // Copies the first `rows` of the step's `step_rows` rows of logits back (when `logits` is not
  // null; rank 0 only), waits for the step and checks the flags.
  absl::Status FinishStep(int64_t rows, int64_t step_rows, std::vector<float>* logits);
  // Forward's step once the batch is in this rank's block ids (checked as Forward says).
  absl::Status ForwardLocal(const ForwardBatch& batch, CudaKvPool& pool,
                            std::vector<float>* logits);
  // The decode-graph path of Forward (see the class comment).
  absl::Status ForwardDecodeGraph(const ForwardBatch& b, int32_t max_seq_len, CudaKvPool& pool,
                                  std::vector<float>* logits);

  model::ModelConfig config_;
  model::DType dense_dtype_;
  DeviceCommunicator* comm_;  // not owned; null alone
  DeviceCommunicator* cp_comm_ = nullptr;  // not owned; null without context parallelism
  int cp_rank_ = 0, cp_size_ = 1;
  ForwardBatch cp_batch_;  // the step's batch in this CP rank's block ids, reused
  ShardDims dims_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  kernels::cuda::CublasHandle cublas_;
  DeviceBuffer embed_;                 // [vocab_local, hidden] of dense_dtype_, or in the
                                       // blocks of embed_format_
  // The embedding's blocks (a GGUF token_embd kept as stored: LlamaWeights::embed_q), or kF32
  // for a dense table; a tied head then multiplies the same blocks.
  kernels::cpu::WeightDType embed_format_ = kernels::cpu::WeightDType::kF32;
  DeviceBuffer final_norm_;            // [hidden] fp32
  Linear head_;  // lm_head [vocab_local, hidden], or the tied embedding; no data on a
                 // follower whose head is replicated (rank 0 runs it alone)
  std::vector<Layer> layers_;
  DeviceBuffer inv_freq_;              // [head_dim / 2] double
  double rope_scale_ = 1.0;            // cpu::RopeAttentionFactor(config_)
  DeviceBuffer flags_;                 // [2] int32: invalid token id, invalid slot
  // Per-step inputs and workspaces.
  DeviceBuffer ids_, positions_, slots_, query_start_, seq_lens_, block_tables_;
  DeviceBuffer x_, h_, qkv_, q_, k_, v_, attn_, gate_up_, act_, rows_, logits_, cast_, ones_;
  DeviceBuffer gathered_;  // vocabulary-parallel logits: [size, rows, vocab_local]
  // Context parallelism: this rank's attention share [tokens, q_dim] then its lse
  // [tokens, heads], and every CP rank's, gathered: [cp_size, tokens * (q_dim + heads)].
  DeviceBuffer cp_part_, cp_gathered_;
  DeviceBuffer attn_workspace_;
  int64_t cap_tokens_ = 0, cap_seqs_ = 0, cap_rows_ = 0;

  // Decode graphs by (batch bucket, blocks bound, pool id); valid while buffers_generation_
  // matches the one they were captured at.
  struct GraphKey {
    int64_t batch = 0, max_blocks = 0;
    uint64_t pool = 0;
    bool operator<(const GraphKey& o) const {
      return std::tie(batch, max_blocks, pool) < std::tie(o.batch, o.max_blocks, o.pool);
    }
  };
  struct GraphExecDeleter {
    void operator()(cudaGraphExec_t exec) const;
  };
  using GraphExec = std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, GraphExecDeleter>;
  // Graphs off (after a failed capture, or never on), with the reason in graph_stats_.
  void StopGraphs(const std::string& why);
  // In a group: whether every rank's `mine` is true (all-reduces on the stream over the TP
  // and the CP ranks, waited for).
  absl::StatusOr<bool> AllRanksAgree(bool mine);
  DeviceBuffer agree_;  // [1] float, AllRanksAgree's vote
  bool graphs_enabled_ = false;
  bool decode_padding_ = false;  // plain decode steps take ForwardDecodeGraph
  uint64_t buffers_generation_ = 0, graphs_generation_ = 0;
  bool steps_reserved_ = false;  // ReserveSteps ran: later growth counts as a buffer move
  std::map<GraphKey, GraphExec> graphs_;
  DecodeGraphStats graph_stats_;
  ForwardBatch padded_;  // the padded decode batch, reused
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_CUDA_LLAMA_MODEL_H_
