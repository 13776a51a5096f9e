#include "worker/service/convert.h"

#include <algorithm>
#include <limits>
#include <string>

#include "kernels/kv_dtype.h"

namespace kvgrid::worker {

SamplingParams SamplingFromProto(const v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_p()) s.top_p = p.top_p();
  s.top_k = p.top_k();
  s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_seed()) s.seed = p.seed();
  if (p.has_logprobs()) s.logprobs = p.logprobs();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  s.logit_bias.assign(p.logit_bias().begin(), p.logit_bias().end());
  // The map's order is unspecified; ids ascending keep what the engine sees reproducible.
  std::sort(s.logit_bias.begin(), s.logit_bias.end());
  return s;
}

StoppingParams StoppingFromProto(const v1::StoppingParams& p) {
  StoppingParams s;
  if (p.has_max_new_tokens()) s.max_new_tokens = p.max_new_tokens();
  s.min_tokens = p.min_tokens();
  s.ignore_eos = p.ignore_eos();
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.stop_strings.assign(p.stop().begin(), p.stop().end());
  s.include_stop_str_in_output = p.include_stop_str_in_output();
  return s;
}

void SamplingToProto(const SamplingParams& s, v1::SamplingParams* p) {
  p->set_temperature(static_cast<float>(s.temperature));
  p->set_top_p(static_cast<float>(s.top_p));
  p->set_top_k(static_cast<int32_t>(s.top_k));
  p->set_min_p(static_cast<float>(s.min_p));
  p->set_repetition_penalty(static_cast<float>(s.repetition_penalty));
  if (s.seed) p->set_seed(*s.seed);
  if (s.logprobs >= 0) p->set_logprobs(static_cast<int32_t>(s.logprobs));
  if (s.presence_penalty != 0.0) p->set_presence_penalty(static_cast<float>(s.presence_penalty));
  if (s.frequency_penalty != 0.0) {
    p->set_frequency_penalty(static_cast<float>(s.frequency_penalty));
  }
  for (const auto& [id, bias] : s.logit_bias) (*p->mutable_logit_bias())[id] = bias;
}

void StoppingToProto(const StoppingParams& s, v1::StoppingParams* p) {
  p->set_max_new_tokens(static_cast<int32_t>(std::min<int64_t>(s.max_new_tokens, INT32_MAX)));
  p->set_min_tokens(static_cast<int32_t>(s.min_tokens));
  p->set_ignore_eos(s.ignore_eos);
  for (int32_t id : s.stop_token_ids) p->add_stop_token_ids(id);
  for (const std::string& stop : s.stop_strings) p->add_stop(stop);
  p->set_include_stop_str_in_output(s.include_stop_str_in_output);
}

GenerationRequest RequestFromProto(const v1::WorkerGenerateRequest& p) {
  GenerationRequest r;
  r.id = p.request_id();
  r.prompt.assign(p.prompt_token_ids().begin(), p.prompt_token_ids().end());
  r.sampling = SamplingFromProto(p.sampling());
  r.stopping = StoppingFromProto(p.stopping());
  r.priority = p.priority();
  r.n = p.n() == 0 ? 1 : p.n();
  r.resume_tokens.assign(p.resume_token_ids().begin(), p.resume_token_ids().end());
  r.index_offset = p.index_offset();
  return r;
}

v1::FinishReason FinishReasonToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void AppendOutput(const TokenOutput& out, v1::GenerateResponse* msg) {
  msg->set_request_id(out.request_id);
  msg->set_index(static_cast<uint32_t>(out.index));
  msg->add_token_ids(out.token_id);
  msg->mutable_text()->append(out.text);
  if (out.logprob) {
    v1::TokenLogprob* lp = msg->add_logprobs();
    lp->set_token_id(out.token_id);
    lp->set_logprob(*out.logprob);
    for (const TokenLogprob& top : out.top_logprobs) {
      v1::TopLogprob* t = lp->add_top();
      t->set_token_id(top.token_id);
      t->set_logprob(top.logprob);
    }
  }
  if (out.finish != FinishReason::kNone) {
    msg->set_finish_reason(FinishReasonToProto(out.finish));
    msg->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(out.usage.prompt_tokens));
    msg->mutable_usage()->set_completion_tokens(static_cast<int32_t>(out.usage.completion_tokens));
    msg->mutable_usage()->set_cached_prompt_tokens(
        static_cast<int32_t>(out.usage.cached_prompt_tokens));
    msg->mutable_timings()->set_queued_s(out.timings.queued_s);
    msg->mutable_timings()->set_first_token_s(out.timings.first_token_s);
    msg->mutable_timings()->set_finished_s(out.timings.finished_s);
  }
}

v1::KvCapacity CapacityToProto(const EngineStats& stats, const EngineOptions& options,
                               int64_t max_model_len) {
  v1::KvCapacity c;
  c.set_block_size(static_cast<int32_t>(options.block_size));
  c.set_blocks_total(stats.blocks_total);
  c.set_bytes_per_token(stats.bytes_per_token);
  c.set_tokens_capacity(stats.tokens_capacity);
  c.set_k_dtype(std::string(kernels::KvDTypeName(options.k_dtype)));
  c.set_v_dtype(std::string(kernels::KvDTypeName(options.v_dtype)));
  c.set_max_model_len(static_cast<int32_t>(max_model_len));
  c.set_kv_window(static_cast<int32_t>(stats.kv_window));
  c.set_context_parallel_size(stats.context_parallel_size);
  c.set_max_num_batched_tokens(static_cast<int32_t>(
      std::min<int64_t>(options.max_num_batched_tokens, std::numeric_limits<int32_t>::max())));
  return c;
}

v1::KvUsage UsageToProto(const EngineStats& stats) {
  v1::KvUsage u;
  u.set_blocks_free(stats.blocks_free);
  u.set_blocks_used(stats.blocks_used);
  u.set_blocks_cached(stats.blocks_cached);
  if (stats.context_parallel_size > 1) {
    for (const RankBlockStats& r : stats.rank_blocks) {
      v1::KvRankUsage* rank = u.add_ranks();
      rank->set_blocks_total(r.blocks_total);
      rank->set_blocks_free(r.blocks_free + r.blocks_cached);
      rank->set_blocks_used(r.blocks_used);
      rank->set_blocks_cached(r.blocks_cached);
    }
  }
  u.set_usage(stats.usage);
  u.set_tokens_stored(stats.tokens_stored);
  u.set_prefix_hit_rate(stats.prefix_hit_rate);
  u.set_num_preemptions(stats.num_preemptions);
  u.set_num_running(static_cast<int32_t>(stats.num_running));
  u.set_num_waiting(static_cast<int32_t>(stats.num_waiting));
  u.set_num_swapped(static_cast<int32_t>(stats.num_swapped));
  return u;
}

}  // namespace kvgrid::worker
