// The generation engine of one worker: owns the model, the KV pool and its block manager, and
// runs requests to completion step by step.
//
// Each Step() forms one batch within a token budget (--max-num-batched-tokens): running
// decodes first, then swapped-out sequences that fit again, then chunks of prompts still being
// prefilled, then waiting requests admitted (FCFS) while their blocks fit, the sequence cap and
// the budget allow — a prompt longer than what is left of the budget is prefilled in chunks
// over several steps, each chunk attending to the earlier ones in the cache. Admission looks
// the prompt up in the prefix cache: leading full blocks already computed (by any earlier
// sequence) are shared and only the rest is prefilled.
//
// When a decode finds no free block, the newest running sequence is preempted (possibly the
// one asking). It is swapped to the host swap space (--swap-space) when that has room for the
// blocks it holds alone — a copy, far cheaper than recomputing on a CPU, and the only choice
// that keeps its cache — otherwise its blocks are freed and it is recomputed later (prompt +
// generated tokens prefilled again, usually mostly from the prefix cache). Either way it
// continues its own random stream. Outputs equal an unpreempted, unbatched run up to
// floating-point differences between batch shapes (GEMV vs GEMM summation order), which only
// matter at near-ties of the logits.
//
// Sliding-window models whose every layer slides (model::ModelConfig::KvWindow() > 0) keep a
// sequence's KV bounded by the window: after each step the blocks wholly before the window of
// its next query go back to the pool (BlockManager::ReleaseBefore), and admission reserves
// only the first prefill chunk. A sequence then never holds more than
// WindowedBlocks(chunk) blocks, which admission, the watermark and AddRequest's "can it ever
// fit" check use instead of prompt + max_new_tokens. Models where only some layers slide
// (Qwen2 with max_window_layers > 0) free nothing: one block id indexes every layer.
//
// Thread-safety: none; one thread drives an engine.
#ifndef KVGRID_WORKER_ENGINE_ENGINE_H_
#define KVGRID_WORKER_ENGINE_ENGINE_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kv_dtype.h"
#include "model/tokenizer.h"
#include "worker/comm/communicator.h"
#include "worker/engine/step_plan.h"
#include "worker/engine/stop_strings.h"
#include "worker/executor/cpu_executor.h"
#include "worker/executor/executor.h"
#include "worker/executor/llama_model.h"
#include "worker/executor/sampler.h"
#include "worker/executor/token_history.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {

struct StoppingParams {
  int64_t max_new_tokens = 16;        // >= 1
  int64_t min_tokens = 0;             // EOS and stop ids are masked until this many tokens
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;  // in addition to the model's EOS ids
  // End the sequence when its text contains one of these (needs EngineOptions::tokenizer).
  // Streamed text holds back any possible start of a stop string, so it never shows part of
  // one; the stop string itself is left out unless include_stop_str_in_output.
  std::vector<std::string> stop_strings;
  bool include_stop_str_in_output = false;
};

// How a preempted sequence gives its KV blocks back.
enum class PreemptionMode {
  // By cost: swap when copying its blocks to the swap space and back is estimated to take
  // less time than recomputing its KV, from the engine's own measurements (seconds per token
  // of forward pass, seconds per byte of swap copy); swap until both have been measured.
  kAuto,
  kSwap,       // swap whenever the swap space has room, else recompute
  kRecompute,  // always free the blocks and recompute later
};

// Whether to swap a preempted sequence out rather than recompute it. `recompute_s` and
// `swap_s` (copy out and back in) are estimates in seconds, negative while unknown.
bool ChooseSwap(PreemptionMode mode, bool can_swap, double recompute_s, double swap_s);

// Parses "auto", "swap" or "recompute". Errors: INVALID_ARGUMENT naming --preemption-mode.
absl::StatusOr<PreemptionMode> ParsePreemptionMode(std::string_view name);

struct GenerationRequest {
  std::string id;                     // unique among live requests
  std::vector<int32_t> prompt;        // token ids, non-empty
  SamplingParams sampling;
  StoppingParams stopping;
  // Lower values are admitted first; equal priorities are first come, first served.
  int64_t priority = 0;
  // Parallel sampling: n continuations of one prompt. The prompt is prefilled once and its
  // blocks are shared by all n (copy-on-write); continuation i draws from its own random
  // stream, seeded with seed + i when a seed is given.
  int64_t n = 1;
  // Failover: tokens this continuation already generated on another worker (and streamed to
  // the client). Their KV is computed like the prompt's; they count against max_new_tokens and
  // min_tokens, prime the detokenizer and stop strings (their text is not emitted again) and
  // advance the seeded random stream, so the continuation goes on as if never interrupted.
  // Needs n == 1.
  std::vector<int32_t> resume_tokens;
  // Which continuation of the original request this is: outputs carry it as their index, and
  // a seeded stream starts at seed + index_offset. Needs n == 1 when non-zero.
  int64_t index_offset = 0;
};

enum class FinishReason : uint8_t {
  kNone,    // still running
  kStop,    // EOS or a stop token
  kLength,  // max_new_tokens or the model's context length
};
std::string_view FinishReasonName(FinishReason reason);

struct TokenLogprob {
  int32_t token_id = -1;
  float logprob = 0.f;  // log-softmax of the model's raw logits
};

// Filled on a continuation's last output (finish != kNone).
struct RequestUsage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prompt tokens found in the prefix cache at admission
};
struct RequestTimings {
  double queued_s = 0;       // arrival -> first scheduled
  double first_token_s = 0;  // arrival -> first token
  double finished_s = 0;     // arrival -> last token
};

struct TokenOutput {
  std::string request_id;
  int32_t token_id = -1;
  FinishReason finish = FinishReason::kNone;
  int64_t index = 0;  // which of the request's n continuations
  std::string text;   // new text (with a tokenizer): complete UTF-8, stop strings withheld
  // With sampling.logprobs >= 0: the chosen token's logprob, and the top-k alternatives.
  std::optional<float> logprob;
  std::vector<TokenLogprob> top_logprobs;
  RequestUsage usage;
  RequestTimings timings;
};

struct EngineOptions {
  int64_t block_size = 16;
  kernels::KvDType k_dtype = kernels::KvDType::kF32;
  kernels::KvDType v_dtype = kernels::KvDType::kF32;
  int64_t kv_cache_memory = 256ll << 20;   // bytes for the KV pool
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 8192;   // tokens computed per step (decodes + prefill)
  // Share of the pool kept free when admitting while other sequences run, so running
  // decodes do not immediately preempt each other.
  double watermark = 0.01;
  int64_t max_model_len = 0;               // 0 = the model's max_position_embeddings
  bool enable_prefix_caching = true;
  // Detokenizes outputs into TokenOutput::text and enables stop strings. Not owned; must
  // outlive the engine. May be null (ids only).
  const model::Tokenizer* tokenizer = nullptr;
  int64_t swap_space = 0;                  // bytes of host memory for swapped-out blocks
  PreemptionMode preemption_mode = PreemptionMode::kAuto;
  std::vector<int32_t> eos_token_ids = {};
  // Tensor- or context-parallel leader (rank 0 of a group of size > 1): every block copy and
  // forward pass is first broadcast as a StepPlan, which the other ranks run in RunFollower.
  // Not owned; the whole group's communicator (every TP and CP rank; the model's own
  // TensorParallel and ContextParallel communicators are its sub-groups). Null for a single
  // worker. Under context parallelism the block manager keeps every rank's pool (each the
  // size of this rank's) and the plans carry group-wide ids. Engine creation agrees on the
  // pools with the followers first (AgreeOnPools).
  Communicator* group = nullptr;
};

struct EngineStats {
  int32_t blocks_total = 0;
  // Allocatable now: free plus evictable cached. In a context-parallel group, what one new
  // sequence can take: cp_size times the fewest any rank has (rank_blocks has each rank's).
  int32_t blocks_free = 0;
  int32_t blocks_cached = 0;      // evictable prefix-cache blocks (counted in blocks_free)
  int32_t blocks_used = 0;        // held by live sequences
  int64_t bytes_per_token = 0;
  int64_t tokens_capacity = 0;
  int64_t tokens_stored = 0;      // distinct token slots written in used blocks
  double internal_waste = 0;      // 1 - tokens_stored / (blocks_used * block_size)
  double usage = 0;               // blocks_used / blocks_total
  int64_t num_running = 0;
  int64_t num_waiting = 0;
  int64_t num_swapped = 0;
  int64_t num_preemptions = 0;    // swaps + recomputes
  int64_t num_swap_outs = 0;
  int64_t num_recomputes = 0;
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  double prefix_hit_rate = 0;     // hit / query tokens
  int64_t cow_copies = 0;
  int32_t swap_blocks_total = 0;
  int32_t swap_blocks_used = 0;
  int64_t kv_window = 0;          // Engine::kv_window(): the window bounding each sequence
  int32_t context_parallel_size = 1;
  // Each context-parallel rank's pool (one entry without context parallelism).
  std::vector<RankBlockStats> rank_blocks;
};

// The CPU executor's pool and swap space as `options` size them.
CpuExecutor::PoolOptions CpuPoolOptions(const EngineOptions& options);

class Engine {
 public:
  // Runs on a CpuExecutor whose pool and swap space `options` size (kv_cache_memory,
  // swap_space, block_size, k_dtype, v_dtype). Errors: INVALID_ARGUMENT for bad options
  // (naming the option).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<LlamaModel> model,
                                                        const EngineOptions& options);
  // Runs on `executor`, whose pool and swap space are used as they are (options' pool and
  // swap sizes are ignored; block_size, k_dtype and v_dtype must be the pool's). Errors:
  // INVALID_ARGUMENT for bad options (naming the option).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::unique_ptr<Executor> executor,
                                                        const EngineOptions& options);
  // The checks Create makes on `options` alone, to run before a model or pool is put on a
  // device. Errors: INVALID_ARGUMENT naming the option.
  static absl::Status ValidateOptions(const EngineOptions& options,
                                      const model::ModelConfig& config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Errors: INVALID_ARGUMENT naming the field for an empty or duplicate id,
  // n outside [1, max_num_seqs], an empty prompt, a token (prompt, resumed or logit_bias)
  // outside the vocabulary, a prompt that leaves no room in the context window (with both
  // lengths), bad sampling or stopping parameters, or a sequence that could never fit the KV
  // pool even alone (with blocks needed and available).
  absl::Status AddRequest(GenerationRequest request);

  // Drops a request (all its continuations) wherever it is and frees its blocks. Unknown or
  // finished ids are fine.
  void Abort(const std::string& request_id);

  [[nodiscard]] bool HasWork() const {
    return !waiting_.empty() || !running_.empty() || !swapped_.empty();
  }

  // Runs one batch; returns one output per sequence that produced a token. Errors from the
  // forward pass are returned as they are; the step's sequences keep their tokens and blocks
  // (admissions and preemptions made by this step stand) and are retried by the next Step.
  absl::StatusOr<std::vector<TokenOutput>> Step();

  [[nodiscard]] EngineStats Stats() const;

  // Tensor-parallel leader: tells the other ranks to leave RunFollower. Call once, from the
  // thread that drives the engine, when it will not step again. No-op without a group.
  absl::Status StopFollowers();
  // Tensor-parallel leader, while idle: tells the other ranks it is alive, well within their
  // collective timeout. No-op without a group.
  absl::Status KeepGroupAlive();
  [[nodiscard]] bool has_group() const { return options_.group != nullptr; }
  [[nodiscard]] int64_t max_model_len() const { return max_model_len_; }
  // The window that bounds each sequence's KV (0: none; see the file comment).
  [[nodiscard]] int64_t kv_window() const { return kv_window_; }
  [[nodiscard]] const BlockManager& block_manager() const { return blocks_; }

 private:
  struct Sequence {
    GenerationRequest request;
    SequenceId seq_id = 0;
    std::vector<int32_t> tokens;     // prompt + generated
    int64_t num_computed = 0;        // tokens whose K/V are in the cache
    int64_t num_generated = 0;
    int64_t num_scheduled = 0;       // tokens this step computes (0: not in this step)
    int64_t cached_prompt_tokens = -1;  // prefix-cache hit at first admission (-1: not yet)
    std::chrono::steady_clock::time_point arrival, first_scheduled, first_token;
    std::optional<model::IncrementalDetokenizer> detok;  // with a tokenizer
    std::optional<StopStringMatcher> stops;             // with stop strings
    int64_t index = 0;               // continuation index in [0, request.n)
    bool forked = false;             // the n - 1 siblings exist (set on the first sample)
    std::mt19937_64 rng;
    TokenHistory history;            // tokens as the penalties see them, one AddOutput a token
  };
  using SeqList = std::list<std::unique_ptr<Sequence>>;

  Engine(std::unique_ptr<Executor> executor, const EngineOptions& options,
         int64_t max_model_len, GroupPools pools);
  // Create's last part, once the options are validated: checks the pool against them.
  static absl::StatusOr<std::unique_ptr<Engine>> Make(std::unique_ptr<Executor> executor,
                                                      const EngineOptions& options);

  // Preempts the newest running sequence (`running_` must not be empty): swaps it out when the
  // swap space has room, the swap would free a device block, and ChooseSwap agrees; else frees
  // its blocks and requeues it for recompute.
  absl::Status PreemptNewest();
  // Brings swapped-out sequences back, most recently preempted first, while their blocks fit.
  // When none is running afterwards, the swapped-out can never come back (only they hold
  // blocks), so they are all requeued for recompute.
  absl::Status SwapInReady();
  // Frees `seq`'s blocks (and swap slots) and puts it at the front of the waiting queue, to be
  // computed again from its tokens. Counts nothing: a swapped-out sequence turned into a
  // recompute was one preemption, already counted.
  void Recompute(std::unique_ptr<Sequence> seq);
  // Gives running sequences not yet scheduled this step — decodes (one token left) or
  // prefills — writable slots for up to `*budget` tokens, oldest first, preempting when the
  // pool is dry; sets their num_scheduled and takes it from `*budget`.
  absl::Status Schedule(bool decodes, int64_t* budget);
  FinishReason CheckStop(const Sequence& seq, int32_t token) const;
  // Blocks a sequence of `total` tokens (prompt + generated, at most) can hold at once when
  // each step computes at most `chunk` of its tokens: kv_planner.h's SequenceBlocks for this
  // pool's block size and the model's KV window.
  [[nodiscard]] int64_t WindowedBlocks(int64_t total, int64_t chunk) const;
  // What one sequence can hold: every rank's pool under context parallelism.
  [[nodiscard]] int64_t CapacityTokens() const {
    return static_cast<int64_t>(blocks_.num_blocks()) * blocks_.block_size();
  }
  // Block copies and forward passes, announced to the group first when there is one.
  absl::Status Copy(PlanKind kind, const std::vector<BlockCopy>& copies);
  absl::Status RunForward();
  // Samples `seq`'s next token from `row` (which it modifies), appends it, and returns the
  // output with logprobs, and usage and timings when the sequence finishes.
  TokenOutput SampleNext(Sequence& seq, std::span<float> row);

  std::unique_ptr<Executor> executor_;  // the model, its KV pool and swap space
  EngineOptions options_;
  BlockManager blocks_;
  int64_t max_model_len_;
  int64_t kv_window_ = 0;  // the model's KvWindow()
  SeqList waiting_;
  SeqList running_;  // admission order: front is oldest
  SeqList swapped_;  // front: the most recently preempted, the first to come back
  absl::flat_hash_map<std::string, int64_t> live_;  // request id -> live sequences
  SequenceId next_seq_id_ = 1;
  int64_t num_swap_outs_ = 0;
  int64_t num_recomputes_ = 0;
  // Measured costs for PreemptionMode::kAuto (moving averages; negative until measured).
  double seconds_per_token_ = -1;      // forward pass time per token computed
  double seconds_per_swap_byte_ = -1;  // swap copy time per byte moved
  std::vector<BlockCopy> copies_;
  ForwardBatch batch_;
  std::vector<float> logits_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_ENGINE_ENGINE_H_
