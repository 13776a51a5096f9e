#include "worker/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "worker/executor/cpu_executor.h"
#include "worker/kv/kv_planner.h"

namespace kvgrid::worker {

std::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
  }
  return "?";
}

namespace {

// --max-model-len, or the model's context window when it is not given.
int64_t MaxModelLen(const EngineOptions& options, const model::ModelConfig& config) {
  return options.max_model_len > 0 ? options.max_model_len : config.max_position_embeddings;
}

}  // namespace

CpuExecutor::PoolOptions CpuPoolOptions(const EngineOptions& options) {
  return {.block_size = options.block_size,
          .k_dtype = options.k_dtype,
          .v_dtype = options.v_dtype,
          .kv_cache_memory = options.kv_cache_memory,
          .swap_space = options.swap_space};
}

absl::Status Engine::ValidateOptions(const EngineOptions& options,
                                     const model::ModelConfig& config) {
  if (options.max_num_seqs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-num-seqs: must be >= 1, got ", options.max_num_seqs));
  }
  if (options.max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-num-batched-tokens: must be >= 1, got ", options.max_num_batched_tokens));
  }
  const int64_t model_len = config.max_position_embeddings;
  const int64_t max_model_len = MaxModelLen(options, config);
  if (max_model_len <= 1 || (model_len > 0 && max_model_len > model_len)) {
    return absl::InvalidArgumentError(absl::StrCat("--max-model-len: must be in [2, ", model_len,
                                                   "], got ", max_model_len));
  }
  if (!(options.block_size == 8 || options.block_size == 16 || options.block_size == 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--block-size: must be 8, 16 or 32, got ", options.block_size));
  }
  if (!(options.watermark >= 0.0 && options.watermark < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--watermark: must be in [0, 1), got ", options.watermark));
  }
  if (options.swap_space < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--swap-space: must be >= 0, got ", options.swap_space));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckGroup(const TensorParallel& tp, const ContextParallel& cp,
                        const EngineOptions& options) {
  const bool group = tp.size > 1 || cp.size > 1;
  if (group != (options.group != nullptr) || (group && (tp.rank != 0 || cp.rank != 0))) {
    return absl::InvalidArgumentError(
        "group: a tensor- or context-parallel model needs the group's communicator, on rank 0 "
        "only");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<LlamaModel> model,
                                                       const EngineOptions& options) {
  KVGRID_RETURN_IF_ERROR(ValidateOptions(options, model->config()));
  KVGRID_RETURN_IF_ERROR(
      CheckGroup(model->tensor_parallel(), model->context_parallel(), options));
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<CpuExecutor> executor,
                          CpuExecutor::Create(std::move(model), CpuPoolOptions(options)));
  return Make(std::move(executor), options);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(std::unique_ptr<Executor> executor,
                                                       const EngineOptions& options) {
  KVGRID_RETURN_IF_ERROR(ValidateOptions(options, executor->config()));
  KVGRID_RETURN_IF_ERROR(
      CheckGroup(executor->tensor_parallel(), executor->context_parallel(), options));
  return Make(std::move(executor), options);
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Make(std::unique_ptr<Executor> executor,
                                                     const EngineOptions& options) {
  const KvGeometry& g = executor->kv_geometry();
  if (options.block_size != g.block_size || options.k_dtype != g.k_dtype ||
      options.v_dtype != g.v_dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--block-size / --k-cache-dtype / --v-cache-dtype: ", options.block_size, " ",
        std::string(kernels::KvDTypeName(options.k_dtype)), " ",
        std::string(kernels::KvDTypeName(options.v_dtype)), " are not the KV pool's (",
        g.block_size, " ", std::string(kernels::KvDTypeName(g.k_dtype)), " ",
        std::string(kernels::KvDTypeName(g.v_dtype)), ")"));
  }
  const int64_t max_model_len = MaxModelLen(options, executor->config());
  GroupPools pools{.num_blocks = executor->num_blocks(),
                   .num_swap_blocks = executor->num_swap_blocks()};
  if (options.group != nullptr) {
    KVGRID_ASSIGN_OR_RETURN(pools, AgreeOnPools(*executor, *options.group));
  }
  const int64_t cp = executor->context_parallel().size;
  if (pools.num_blocks < 1 || int64_t{pools.num_blocks} * cp > INT32_MAX / 32 ||
      int64_t{pools.num_swap_blocks} * cp > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-memory / --swap-space: ", pools.num_blocks, " KV blocks and ",
        pools.num_swap_blocks, " swap blocks per rank over ", cp,
        " context-parallel ranks are outside what block ids can address (1 to ",
        INT32_MAX / 32 / cp, " blocks)"));
  }
  return std::unique_ptr<Engine>(
      new Engine(std::move(executor), options, max_model_len, pools));
}

Engine::Engine(std::unique_ptr<Executor> executor, const EngineOptions& options,
               int64_t max_model_len, GroupPools pools)
    : executor_(std::move(executor)),
      options_(options),
      blocks_(BlockManager::Options{
          .num_blocks = pools.num_blocks,
          .block_size = static_cast<int32_t>(options.block_size),
          .prefix_caching = options.enable_prefix_caching,
          .num_swap_slots = pools.num_swap_blocks,
          .cp_size = executor_->context_parallel().size}),
      max_model_len_(max_model_len),
      kv_window_(executor_->config().KvWindow()) {}

int64_t Engine::WindowedBlocks(int64_t total, int64_t chunk) const {
  return SequenceBlocks(total, blocks_.block_size(), kv_window_, chunk);
}

absl::Status Engine::AddRequest(GenerationRequest request) {
  if (request.id.empty()) return absl::InvalidArgumentError("request_id: must not be empty");
  if (live_.contains(request.id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id: '", request.id, "' is already in use"));
  }
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt: must not be empty");
  const int64_t vocab = executor_->config().vocab_size;
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    if (request.prompt[i] < 0 || request.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt[", i, "]: token id ",
                                                     request.prompt[i],
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
  }
  if ((!request.resume_tokens.empty() || request.index_offset != 0) && request.n != 1) {
    return absl::InvalidArgumentError("resume_token_ids: a resumed continuation needs n = 1");
  }
  if (request.index_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("index_offset: must be >= 0, got ", request.index_offset));
  }
  for (size_t i = 0; i < request.resume_tokens.size(); ++i) {
    if (request.resume_tokens[i] < 0 || request.resume_tokens[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("resume_token_ids[", i, "]: token id ",
                                                     request.resume_tokens[i],
                                                     " is outside the vocabulary [0, ", vocab,
                                                     ")"));
    }
  }
  const int64_t num_resumed = static_cast<int64_t>(request.resume_tokens.size());
  if (num_resumed > 0 && num_resumed >= request.stopping.max_new_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("resume_token_ids: ", num_resumed,
                     " tokens leave none of max_new_tokens ", request.stopping.max_new_tokens));
  }
  const int64_t prompt_len = static_cast<int64_t>(request.prompt.size());
  if (prompt_len + num_resumed >= max_model_len_) {
    if (num_resumed > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("resume_token_ids: prompt ", prompt_len, " + resumed ", num_resumed,
                       " tokens leave no room in the context window of ", max_model_len_,
                       " tokens"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: ", prompt_len, " tokens leave no room in the context window of ",
                     max_model_len_, " tokens"));
  }
  KVGRID_RETURN_IF_ERROR(request.sampling.Validate());
  for (const auto& [id, bias] : request.sampling.logit_bias) {
    if (id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias: token id ", id, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (request.stopping.max_new_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens: must be >= 1, got ",
                                                   request.stopping.max_new_tokens));
  }
  if (request.stopping.min_tokens < 0 ||
      request.stopping.min_tokens > request.stopping.max_new_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("min_tokens: must be in [0, max_new_tokens ",
                                                   request.stopping.max_new_tokens, "], got ",
                                                   request.stopping.min_tokens));
  }
  for (size_t i = 0; i < request.stopping.stop_strings.size(); ++i) {
    if (request.stopping.stop_strings[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "]: must not be empty"));
    }
  }
  if (!request.stopping.stop_strings.empty() && options_.tokenizer == nullptr) {
    return absl::InvalidArgumentError("stop: stop strings need a tokenizer on this worker");
  }
  if (request.n < 1 || request.n > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("n: must be in [1, ", options_.max_num_seqs,
                                                   "] (--max-num-seqs), got ", request.n));
  }
  // Written to avoid overflow: max_new_tokens may be anything up to INT64_MAX.
  const int64_t worst = request.stopping.max_new_tokens >= max_model_len_ - prompt_len
                            ? max_model_len_
                            : prompt_len + request.stopping.max_new_tokens;
  // With a KV window a sequence holds the window and one step's tokens at most.
  const int64_t worst_blocks = WindowedBlocks(worst, options_.max_num_batched_tokens);
  if (worst_blocks > blocks_.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt + max_new_tokens: the sequence may need ", worst, " tokens (", worst_blocks,
        " KV blocks", kv_window_ > 0 ? absl::StrCat(" with its window of ", kv_window_) : "",
        "), the KV cache holds ", CapacityTokens(), " tokens (", blocks_.num_blocks(),
        " blocks)"));
  }

  auto seq = std::make_unique<Sequence>();
  seq->seq_id = next_seq_id_++;
  seq->tokens = request.prompt;
  seq->index = request.index_offset;
  seq->rng.seed(request.sampling.seed
                    ? *request.sampling.seed + static_cast<uint64_t>(request.index_offset)
                    : std::random_device{}());
  seq->history = TokenHistory(request.sampling, request.prompt);
  seq->request = std::move(request);
  seq->arrival = std::chrono::steady_clock::now();
  if (options_.tokenizer) {
    // The text continues the prompt's, as vLLM reports it: "▁Paris" after a prompt is
    // " Paris". A prompt that decodes to nothing (empty, or special tokens only, which the
    // text skips) leaves nothing to continue, so a SentencePiece first space is dropped.
    const model::Tokenizer* tok = options_.tokenizer;
    const bool continues_text = std::any_of(seq->tokens.begin(), seq->tokens.end(),
                                            [tok](int32_t id) { return !tok->IsSpecial(id); });
    seq->detok.emplace(tok, /*skip_special_tokens=*/true, continues_text);
  }
  if (!seq->request.stopping.stop_strings.empty()) {
    seq->stops.emplace(seq->request.stopping.stop_strings,
                       seq->request.stopping.include_stop_str_in_output);
  }
  // Replay the resumed tokens through everything SampleNext updates, emitting nothing: the
  // random stream, the penalties' counts, the detokenizer and the stop strings.
  for (int32_t token : seq->request.resume_tokens) {
    if (!IsGreedy(seq->request.sampling)) seq->rng.discard(1);  // one draw per sampled token
    seq->tokens.push_back(token);
    seq->history.AddOutput(token);
    ++seq->num_generated;
    if (seq->detok) {
      const std::string delta = seq->detok->Push(token).value_or("");
      if (seq->stops) {
        seq->stops->Push(delta, seq->num_generated > seq->request.stopping.min_tokens);
      }
    }
  }
  live_[seq->request.id] = 1;
  const int64_t priority = seq->request.priority;
  auto pos = std::find_if(waiting_.begin(), waiting_.end(), [priority](const auto& w) {
    return w->request.priority > priority;
  });
  waiting_.insert(pos, std::move(seq));
  return absl::OkStatus();
}

void Engine::Abort(const std::string& request_id) {
  if (live_.erase(request_id) == 0) return;
  for (SeqList* list : {&waiting_, &running_, &swapped_}) {
    list->remove_if([&](const std::unique_ptr<Sequence>& s) {
      if (s->request.id != request_id) return false;
      blocks_.Free(s->seq_id);
      return true;
    });
  }
}

bool ChooseSwap(PreemptionMode mode, bool can_swap, double recompute_s, double swap_s) {
  if (!can_swap) return false;
  switch (mode) {
    case PreemptionMode::kSwap: return true;
    case PreemptionMode::kRecompute: return false;
    case PreemptionMode::kAuto: break;
  }
  if (recompute_s < 0 || swap_s < 0) return true;  // not measured yet: keep the work done
  return swap_s <= recompute_s;
}

absl::StatusOr<PreemptionMode> ParsePreemptionMode(std::string_view name) {
  if (name == "auto") return PreemptionMode::kAuto;
  if (name == "swap") return PreemptionMode::kSwap;
  if (name == "recompute") return PreemptionMode::kRecompute;
  return absl::InvalidArgumentError(absl::StrCat("--preemption-mode: unknown mode '",
                                                 std::string(name),
                                                 "' (accepted: auto, swap, recompute)"));
}

namespace {

// Moving average that starts at the first observation.
void Observe(double* average, double value) {
  constexpr double kWeight = 0.2;
  *average = *average < 0 ? value : (1 - kWeight) * *average + kWeight * value;
}

}  // namespace

absl::Status Engine::PreemptNewest() {
  std::unique_ptr<Sequence> victim = std::move(running_.back());
  running_.pop_back();
  // Recompute redoes the forward pass over every token it has computed; a swap copies the
  // blocks it holds alone out now and back in later.
  const double recompute_s =
      seconds_per_token_ < 0
          ? -1
          : seconds_per_token_ * static_cast<double>(victim->num_computed);
  const double swap_s =
      seconds_per_swap_byte_ < 0
          ? -1
          : seconds_per_swap_byte_ * 2.0 *
                static_cast<double>(blocks_.ExclusiveBlocks(victim->seq_id) *
                                    executor_->kv_geometry().BytesPerBlock());
  // A swap leaves the blocks the victim shares (n > 1 siblings, prefix hits) on the device;
  // one that would move nothing frees nothing, and the asker would preempt itself in turn.
  const bool can_swap = blocks_.layout().swap_slots_per_rank > 0 &&
                        blocks_.ExclusiveBlocks(victim->seq_id) > 0 &&
                        blocks_.CanSwapOut(victim->seq_id);
  if (ChooseSwap(options_.preemption_mode, can_swap, recompute_s, swap_s)) {
    // Its own list: Schedule preempts while collecting copy-on-write copies in copies_.
    std::vector<BlockCopy> out;
    KVGRID_RETURN_IF_ERROR(blocks_.SwapOut(victim->seq_id, &out));
    // Listed before the copy, so that if the copy fails, aborting the request still frees
    // the slots it holds.
    swapped_.push_front(std::move(victim));
    ++num_swap_outs_;
    // Copy now: the freed device blocks may be reallocated and written in this very step.
    KVGRID_RETURN_IF_ERROR(Copy(PlanKind::kCopyDeviceToSwap, out));
  } else {
    Recompute(std::move(victim));
    ++num_recomputes_;
  }
  return absl::OkStatus();
}

absl::Status Engine::SwapInReady() {
  while (!swapped_.empty() && static_cast<int64_t>(running_.size()) < options_.max_num_seqs) {
    Sequence* seq = swapped_.front().get();
    if (!blocks_.CanSwapIn(seq->seq_id)) break;
    copies_.clear();
    KVGRID_RETURN_IF_ERROR(blocks_.SwapIn(seq->seq_id, &copies_));
    KVGRID_RETURN_IF_ERROR(Copy(PlanKind::kCopySwapToDevice, copies_));
    copies_.clear();
    if (!blocks_.PrepareWrite(seq->seq_id, seq->num_computed,
                              static_cast<int64_t>(seq->tokens.size()), &copies_)
             .ok()) {
      // Back in, but no room for its next token: out again, and it waits for the next step.
      // Blocks it shared when it went out may be its alone by now (its siblings finished), so
      // going out again can need more slots than it gave back; then it is recomputed.
      if (blocks_.CanSwapOut(seq->seq_id)) {
        std::vector<BlockCopy> out;
        KVGRID_RETURN_IF_ERROR(blocks_.SwapOut(seq->seq_id, &out));
        KVGRID_RETURN_IF_ERROR(Copy(PlanKind::kCopyDeviceToSwap, out));
      } else {
        std::unique_ptr<Sequence> stuck = std::move(swapped_.front());
        swapped_.pop_front();
        Recompute(std::move(stuck));
      }
      break;
    }
    KVGRID_RETURN_IF_ERROR(Copy(PlanKind::kCopyDeviceToDevice, copies_));
    running_.push_back(std::move(swapped_.front()));
    swapped_.pop_front();
  }
  // Nothing running will ever free a block, and admissions wait for the swapped-out: if the
  // swapped-out cannot come back now (the blocks they need are held by each other's shared
  // blocks), they never will. Recompute them, in their order, so the engine moves on.
  // From the back, so that the one that would have come back first is admitted first.
  while (running_.empty() && !swapped_.empty()) {
    std::unique_ptr<Sequence> stuck = std::move(swapped_.back());
    swapped_.pop_back();
    Recompute(std::move(stuck));
  }
  return absl::OkStatus();
}

void Engine::Recompute(std::unique_ptr<Sequence> seq) {
  blocks_.Free(seq->seq_id);
  seq->num_computed = 0;
  waiting_.push_front(std::move(seq));
}

FinishReason Engine::CheckStop(const Sequence& seq, int32_t token) const {
  const StoppingParams& stop = seq.request.stopping;
  if (seq.num_generated <= stop.min_tokens - 1) {  // before min_tokens only length can stop
    if (static_cast<int64_t>(seq.tokens.size()) >= max_model_len_) return FinishReason::kLength;
    return FinishReason::kNone;
  }
  if (!stop.ignore_eos &&
      std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(), token) !=
          options_.eos_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(), token) !=
      stop.stop_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (seq.num_generated >= stop.max_new_tokens) return FinishReason::kLength;
  if (static_cast<int64_t>(seq.tokens.size()) >= max_model_len_) return FinishReason::kLength;
  return FinishReason::kNone;
}

TokenOutput Engine::SampleNext(Sequence& seq, std::span<float> row) {
  const StoppingParams& stop = seq.request.stopping;
  TokenOutput out;
  out.request_id = seq.request.id;
  out.index = seq.index;
  // Raw-logit log-softmax for logprobs, before the bias, penalties and masks change the row
  // (vLLM's default, raw_logprobs): what the model thinks, whatever the request steers.
  std::vector<float> raw;
  if (seq.request.sampling.logprobs >= 0) raw.assign(row.begin(), row.end());
  if (seq.num_generated < stop.min_tokens) {
    auto mask = [&row](int32_t id) {
      if (id >= 0 && id < static_cast<int32_t>(row.size())) {
        row[id] = -std::numeric_limits<float>::infinity();
      }
    };
    if (!stop.ignore_eos) for (int32_t id : options_.eos_token_ids) mask(id);
    for (int32_t id : stop.stop_token_ids) mask(id);
  }
  out.token_id = SampleToken(row, seq.request.sampling, seq.history, seq.rng);
  if (!raw.empty()) {
    // Ranked on the raw logits (NaN as -inf, as the sampler sees them): normalizing first
    // could round two close logits to one value and reorder them against the greedy pick.
    for (float& x : raw) {
      if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
    }
    const int64_t k = std::min<int64_t>(seq.request.sampling.logprobs, raw.size());
    std::vector<int32_t> ids(raw.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&raw](int32_t a, int32_t b) {
      return raw[a] > raw[b] || (raw[a] == raw[b] && a < b);
    });
    LogSoftmaxInPlace(raw);  // +inf logits included (a broken checkpoint or cache)
    out.logprob = raw[out.token_id];
    for (int64_t i = 0; i < k; ++i) out.top_logprobs.push_back({ids[i], raw[ids[i]]});
  }
  const auto now = std::chrono::steady_clock::now();
  if (seq.first_token == std::chrono::steady_clock::time_point{}) seq.first_token = now;
  seq.tokens.push_back(out.token_id);
  seq.history.AddOutput(out.token_id);
  ++seq.num_generated;
  out.finish = CheckStop(seq, out.token_id);
  if (seq.detok) {
    // Ids the tokenizer does not know (padded vocabularies) carry no text.
    std::string delta = seq.detok->Push(out.token_id).value_or("");
    if (out.finish != FinishReason::kNone) delta += seq.detok->Finish();
    // Stop strings, like stop ids, count only once min_tokens are out; the text before goes
    // through the matcher too, since a stop string may begin there.
    if (seq.stops) {
      StopStringMatcher::Result r =
          seq.stops->Push(delta, /*can_stop=*/seq.num_generated > stop.min_tokens);
      out.text = std::move(r.emit);
      if (r.stopped) out.finish = FinishReason::kStop;
      if (out.finish != FinishReason::kNone) out.text += seq.stops->Flush();
    } else {
      out.text = std::move(delta);
    }
  }
  if (out.finish != FinishReason::kNone) {
    auto seconds = [&seq](std::chrono::steady_clock::time_point t) {
      return std::chrono::duration<double>(t - seq.arrival).count();
    };
    out.usage.prompt_tokens = static_cast<int64_t>(seq.request.prompt.size());
    out.usage.completion_tokens = seq.num_generated;
    out.usage.cached_prompt_tokens = std::max<int64_t>(0, seq.cached_prompt_tokens);
    out.timings.queued_s = seconds(seq.first_scheduled);
    out.timings.first_token_s = seconds(seq.first_token);
    out.timings.finished_s = seconds(now);
  }
  return out;
}

absl::Status Engine::Schedule(bool decodes, int64_t* budget) {
  // Victims come from the back, so `it` stays valid unless it is the victim, and then it was
  // the last one.
  for (auto it = running_.begin(); it != running_.end() && *budget > 0;) {
    Sequence* seq = it->get();
    const int64_t remaining = static_cast<int64_t>(seq->tokens.size()) - seq->num_computed;
    if (seq->num_scheduled > 0 || (remaining == 1) != decodes) {
      ++it;
      continue;
    }
    const int64_t n = std::min(remaining, *budget);
    bool preempted_self = false;
    copies_.clear();
    for (absl::Status st = blocks_.PrepareWrite(seq->seq_id, seq->num_computed,
                                                seq->num_computed + n, &copies_);
         !st.ok(); st = blocks_.PrepareWrite(seq->seq_id, seq->num_computed,
                                             seq->num_computed + n, &copies_)) {
      // Only a dry pool is cured by preempting; anything else (a write into a released
      // position) is a bookkeeping error, not a reason to preempt everyone.
      if (!absl::IsResourceExhausted(st)) return st;
      preempted_self = running_.back().get() == seq;
      *budget += running_.back()->num_scheduled;  // a victim scheduled earlier gives back
      running_.back()->num_scheduled = 0;
      KVGRID_RETURN_IF_ERROR(PreemptNewest());
      if (preempted_self) break;
    }
    if (preempted_self) break;
    KVGRID_RETURN_IF_ERROR(Copy(PlanKind::kCopyDeviceToDevice, copies_));
    seq->num_scheduled = n;
    *budget -= n;
    ++it;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TokenOutput>> Engine::Step() {
  // 1. Running decodes first, each needing a writable slot for one token (copy-on-write when
  //    its last block is shared); when the pool is dry the newest running sequence is
  //    preempted, possibly the one asking. Then swapped-out sequences come back (and decode),
  //    then prompts still being prefilled get chunks of what is left of the token budget.
  int64_t budget = options_.max_num_batched_tokens;
  for (const auto& seq : running_) seq->num_scheduled = 0;
  KVGRID_RETURN_IF_ERROR(Schedule(/*decodes=*/true, &budget));
  KVGRID_RETURN_IF_ERROR(SwapInReady());
  KVGRID_RETURN_IF_ERROR(Schedule(/*decodes=*/true, &budget));
  KVGRID_RETURN_IF_ERROR(Schedule(/*decodes=*/false, &budget));

  // 2. Admit waiting sequences (FCFS, none while any is swapped out) while blocks for their
  //    whole prompt, the sequence cap and the budget allow, sharing whatever prefix of their
  //    tokens is already cached; a prompt longer than the budget is prefilled in chunks.
  while (budget > 0 && swapped_.empty() && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < options_.max_num_seqs) {
    Sequence* seq = waiting_.front().get();
    const int64_t len = static_cast<int64_t>(seq->tokens.size());
    // Keep the watermark free for the running sequences (counting no prefix hits), on every
    // context-parallel rank: a sequence's first blocks fill rank 0's pool first.
    const ContextParallelLayout& layout = blocks_.layout();
    const int64_t watermark_blocks = static_cast<int64_t>(
        options_.watermark * static_cast<double>(layout.blocks_per_rank));
    const int64_t need = WindowedBlocks(len, budget);
    bool below_watermark = false;
    for (int32_t r = 0; r < layout.cp_size && !running_.empty(); ++r) {
      below_watermark |= blocks_.num_free_blocks(r) - layout.PositionsOnRank(0, need, r) <
                         watermark_blocks;
    }
    if (below_watermark) break;
    // A windowed sequence takes the cached blocks its window needs and blocks for the first
    // chunk only; later chunks grow it in Schedule, and each step gives back what falls out
    // of the window.
    absl::StatusOr<int64_t> cached =
        kv_window_ > 0 ? blocks_.AllocateWindowed(seq->seq_id, seq->tokens, kv_window_, budget)
                       : blocks_.Allocate(seq->seq_id, seq->tokens, len);
    if (!cached.ok()) break;
    seq->num_computed = *cached;
    if (seq->cached_prompt_tokens < 0) {
      seq->cached_prompt_tokens = *cached;
      seq->first_scheduled = std::chrono::steady_clock::now();
    }
    seq->num_scheduled = std::min(len - *cached, budget);
    budget -= seq->num_scheduled;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  if (running_.empty()) {
    if (!waiting_.empty()) {
      // Unreachable while AddRequest refuses what cannot fit; never spin if it happens.
      const std::string id = waiting_.front()->request.id;
      Abort(id);
      return absl::InternalError(absl::StrCat("request '", id,
                                              "' cannot be admitted into an empty KV pool"));
    }
    return std::vector<TokenOutput>{};
  }

  // 3. Lay the batch out for the kernels: each scheduled sequence contributes its next
  //    num_scheduled tokens; only those that reach the end of their tokens need logits.
  ForwardBatch& b = batch_;
  b.token_ids.clear();
  b.positions.clear();
  b.slots.clear();
  b.query_start.assign(1, 0);
  b.seq_lens.clear();
  b.logit_rows.clear();
  b.max_blocks_per_seq = 1;
  int64_t num_scheduled_seqs = 0;
  for (const auto& seq : running_) {
    if (seq->num_scheduled == 0) continue;
    ++num_scheduled_seqs;
    b.max_blocks_per_seq = std::max<int64_t>(
        b.max_blocks_per_seq, static_cast<int64_t>(blocks_.BlockTable(seq->seq_id).size()));
  }
  b.block_tables.assign(num_scheduled_seqs * b.max_blocks_per_seq, 0);
  int64_t s = 0;
  for (const auto& seq : running_) {
    if (seq->num_scheduled == 0) continue;
    const int64_t end = seq->num_computed + seq->num_scheduled;
    for (int64_t pos = seq->num_computed; pos < end; ++pos) {
      b.token_ids.push_back(seq->tokens[pos]);
      b.positions.push_back(static_cast<int32_t>(pos));
      b.slots.push_back(blocks_.Slot(seq->seq_id, pos));
    }
    b.query_start.push_back(static_cast<int32_t>(b.token_ids.size()));
    b.seq_lens.push_back(static_cast<int32_t>(end));
    if (end == static_cast<int64_t>(seq->tokens.size())) {
      b.logit_rows.push_back(static_cast<int32_t>(b.token_ids.size()) - 1);
    }
    const std::vector<int32_t>& table = blocks_.BlockTable(seq->seq_id);
    std::copy(table.begin(), table.end(), b.block_tables.begin() + s * b.max_blocks_per_seq);
    ++s;
  }

  KVGRID_RETURN_IF_ERROR(RunForward());

  // 5. Sample, append, and retire finished sequences.
  const int64_t vocab = executor_->config().vocab_size;
  std::vector<TokenOutput> outputs;
  outputs.reserve(running_.size());
  SeqList forks;  // siblings of n > 1 requests, created from their prompt's logits
  int64_t row_index = 0;
  for (auto it = running_.begin(); it != running_.end();) {
    Sequence& seq = **it;
    if (seq.num_scheduled == 0) {
      ++it;
      continue;
    }
    seq.num_computed += seq.num_scheduled;
    seq.num_scheduled = 0;
    blocks_.CommitFullBlocks(seq.seq_id, seq.tokens, seq.num_computed);
    // The next query, at num_computed, reads keys from num_computed - window + 1 on.
    if (kv_window_ > 0) blocks_.ReleaseBefore(seq.seq_id, seq.num_computed - kv_window_ + 1);
    if (seq.num_computed < static_cast<int64_t>(seq.tokens.size())) {  // mid-prompt chunk
      ++it;
      continue;
    }
    std::span<float> row(logits_.data() + row_index++ * vocab, vocab);
    if (!seq.forked && seq.request.n > 1) {
      seq.forked = true;
      for (int64_t i = 1; i < seq.request.n; ++i) {
        auto child = std::make_unique<Sequence>();
        child->request = seq.request;
        child->seq_id = next_seq_id_++;
        child->tokens = seq.tokens;
        child->num_computed = seq.num_computed;
        child->index = i;
        child->forked = true;
        child->history = seq.history;  // the prompt's; each sibling counts its own output
        const std::optional<uint64_t> seed = seq.request.sampling.seed;
        child->rng.seed(seed ? *seed + static_cast<uint64_t>(i) : std::random_device{}());
        blocks_.Fork(seq.seq_id, child->seq_id);
        ++live_[seq.request.id];
        child->arrival = seq.arrival;
        child->first_scheduled = seq.first_scheduled;
        child->cached_prompt_tokens = seq.cached_prompt_tokens;
        child->detok = seq.detok;
        child->stops = seq.stops;
        // Each sibling samples its first token from the prompt's logits on its own stream.
        std::vector<float> own(row.begin(), row.end());
        outputs.push_back(SampleNext(*child, own));
        if (outputs.back().finish != FinishReason::kNone) {
          blocks_.Free(child->seq_id);
          if (--live_[child->request.id] == 0) live_.erase(child->request.id);
        } else {
          forks.push_back(std::move(child));
        }
      }
    }
    outputs.push_back(SampleNext(seq, row));
    if (outputs.back().finish != FinishReason::kNone) {
      blocks_.Free(seq.seq_id);
      if (--live_[seq.request.id] == 0) live_.erase(seq.request.id);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  running_.splice(running_.end(), forks);
  return outputs;
}

absl::Status Engine::Copy(PlanKind kind, const std::vector<BlockCopy>& copies) {
  if (copies.empty()) return absl::OkStatus();
  if (options_.group != nullptr) {
    std::string plan = EncodePlan(StepPlan{.kind = kind, .copies = copies});
    KVGRID_RETURN_IF_ERROR(BroadcastBytes(*options_.group, &plan, /*root=*/0));
  }
  const BlockCopyKind copy_kind = ToBlockCopyKind(kind);
  if (copy_kind == BlockCopyKind::kDeviceToDevice) return executor_->CopyBlocks(copy_kind, copies);
  const auto start = std::chrono::steady_clock::now();
  KVGRID_RETURN_IF_ERROR(executor_->CopyBlocks(copy_kind, copies));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Observe(&seconds_per_swap_byte_,
          seconds / static_cast<double>(static_cast<int64_t>(copies.size()) *
                                        executor_->kv_geometry().BytesPerBlock()));
  return absl::OkStatus();
}

absl::Status Engine::RunForward() {
  if (options_.group != nullptr) {
    std::string plan = EncodePlan(StepPlan{.kind = PlanKind::kForward, .batch = batch_});
    KVGRID_RETURN_IF_ERROR(BroadcastBytes(*options_.group, &plan, /*root=*/0));
  }
  const auto start = std::chrono::steady_clock::now();
  KVGRID_RETURN_IF_ERROR(executor_->Forward(batch_, &logits_));
  // A recompute is a prefill: measure on prefill-sized steps only (a step of a few decodes
  // costs far more per token).
  if (batch_.token_ids.size() >= 16) {
    Observe(&seconds_per_token_,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                static_cast<double>(batch_.token_ids.size()));
  }
  return absl::OkStatus();
}

absl::Status Engine::KeepGroupAlive() {
  if (options_.group == nullptr) return absl::OkStatus();
  std::string plan = EncodePlan(StepPlan{.kind = PlanKind::kKeepAlive});
  return BroadcastBytes(*options_.group, &plan, /*root=*/0);
}

absl::Status Engine::StopFollowers() {
  if (options_.group == nullptr) return absl::OkStatus();
  std::string plan = EncodePlan(StepPlan{.kind = PlanKind::kStop});
  return BroadcastBytes(*options_.group, &plan, /*root=*/0);
}

EngineStats Engine::Stats() const {
  const BlockManagerStats bm = blocks_.Stats();
  EngineStats st;
  st.blocks_total = bm.blocks_total;
  st.blocks_free = blocks_.num_free_blocks();
  if (blocks_.cp_size() > 1) {
    // Position i lives on rank i % C, so a new sequence can take C times the fewest blocks
    // any rank has free (the sum would promise what the fullest rank cannot give).
    int32_t fewest = blocks_.num_free_blocks(0);
    for (int32_t r = 1; r < blocks_.cp_size(); ++r) {
      fewest = std::min(fewest, blocks_.num_free_blocks(r));
    }
    st.blocks_free = fewest * blocks_.cp_size();
  }
  st.blocks_cached = bm.blocks_cached;
  st.blocks_used = bm.blocks_used;
  st.context_parallel_size = blocks_.cp_size();
  st.rank_blocks = blocks_.RankBlocks();
  st.bytes_per_token = executor_->kv_geometry().BytesPerToken();
  st.tokens_capacity = CapacityTokens();
  // Distinct slots written: a block shared by several sequences counts once, at its fullest.
  absl::flat_hash_map<int32_t, int64_t> fill;
  const int64_t bs = blocks_.block_size();
  for (const auto& seq : running_) {
    const std::vector<int32_t>& table = blocks_.BlockTable(seq->seq_id);
    for (size_t i = 0; i < table.size(); ++i) {
      if (table[i] == BlockManager::kHole) continue;
      const int64_t n = std::clamp<int64_t>(seq->num_computed - static_cast<int64_t>(i) * bs, 0, bs);
      int64_t& f = fill[table[i]];
      f = std::max(f, n);
    }
  }
  for (const auto& [block, n] : fill) st.tokens_stored += n;
  if (st.blocks_used > 0) {
    st.internal_waste =
        1.0 - static_cast<double>(st.tokens_stored) / static_cast<double>(st.blocks_used * bs);
  }
  st.usage = static_cast<double>(st.blocks_used) / st.blocks_total;
  st.num_running = static_cast<int64_t>(running_.size());
  st.num_waiting = static_cast<int64_t>(waiting_.size());
  st.num_swapped = static_cast<int64_t>(swapped_.size());
  st.num_swap_outs = num_swap_outs_;
  st.num_recomputes = num_recomputes_;
  st.num_preemptions = num_swap_outs_ + num_recomputes_;
  st.prefix_query_tokens = bm.prefix_query_tokens;
  st.prefix_hit_tokens = bm.prefix_hit_tokens;
  if (bm.prefix_query_tokens > 0) {
    st.prefix_hit_rate =
        static_cast<double>(bm.prefix_hit_tokens) / static_cast<double>(bm.prefix_query_tokens);
  }
  st.cow_copies = bm.cow_copies;
  st.swap_blocks_total = bm.swap_slots_total;
  st.swap_blocks_used = bm.swap_slots_used;
  st.kv_window = kv_window_;
  return st;
}

}  // namespace kvgrid::worker
