#include "coordinator/coordinator_metrics.h"

#include "absl/strings/str_cat.h"
#include "coordinator/registry.h"
#include "kvgrid/v1/generation.pb.h"

namespace kvgrid::coordinator {

CoordinatorMetrics::CoordinatorMetrics(metrics::Registry* registry) : registry_(registry) {}

void CoordinatorMetrics::ObserveFirstToken(const std::string& model, const std::string& api,
                                           double seconds) {
  registry_
      ->GetHistogram("kvgrid:time_to_first_token_seconds",
                     "Time from arrival at the coordinator to the first token.",
                     metrics::TtftBuckets(), {{"model_name", model}, {"api", api}})
      ->Observe(seconds);
}

void CoordinatorMetrics::ObserveInterToken(const std::string& model, const std::string& api,
                                           double seconds) {
  registry_
      ->GetHistogram("kvgrid:inter_token_latency_seconds",
                     "Time between consecutive tokens of a sequence, as relayed.",
                     metrics::InterTokenBuckets(), {{"model_name", model}, {"api", api}})
      ->Observe(seconds);
}

void CoordinatorMetrics::ObserveFinished(const std::string& model, const std::string& api,
                                         const std::string& finish_reason, double e2e_seconds,
                                         double queue_seconds, int64_t prompt_tokens,
                                         int64_t generation_tokens) {
  const metrics::Labels m = {{"model_name", model}, {"api", api}};
  registry_
      ->GetHistogram("kvgrid:e2e_request_latency_seconds",
                     "Time from arrival at the coordinator to the last token.",
                     metrics::RequestLatencyBuckets(), m)
      ->Observe(e2e_seconds);
  registry_
      ->GetHistogram("kvgrid:request_queue_time_seconds",
                     "Time from arrival until the worker first scheduled the request.",
                     metrics::RequestLatencyBuckets(), m)
      ->Observe(queue_seconds);
  registry_->GetCounter("kvgrid:prompt_tokens_total", "Prompt tokens of finished requests.", m)
      ->Increment(static_cast<double>(prompt_tokens));
  registry_
      ->GetCounter("kvgrid:generation_tokens_total", "Tokens generated for finished requests.", m)
      ->Increment(static_cast<double>(generation_tokens));
  registry_
      ->GetCounter("kvgrid:request_success_total", "Requests finished, by finish reason.",
                   {{"model_name", model}, {"api", api}, {"finished_reason", finish_reason}})
      ->Increment();
}

void CoordinatorMetrics::CountError(const std::string& model, const std::string& api,
                                    grpc::StatusCode code) {
  registry_
      ->GetCounter("kvgrid:request_errors_total", "Requests that ended with an error, by code.",
                   {{"model_name", model},
                    {"api", api},
                    {"code", absl::StrCat(static_cast<int>(code))}})
      ->Increment();
}

void CoordinatorMetrics::CountFailover(const std::string& model) {
  registry_
      ->GetCounter("kvgrid:request_failovers_total",
                   "Continuations resubmitted to another worker after one failed.",
                   {{"model_name", model}})
      ->Increment();
}

void CoordinatorMetrics::CollectFrom(const WorkerRegistry* registry,
                                     const std::function<int64_t()>& in_flight) {
  v1::ClusterStatusResponse status;
  registry->FillStatus(&status);
  metrics::Registry* r = registry_;
  r->GetGauge("kvgrid:num_requests_in_flight", "Generate calls open at the coordinator.")
      ->Set(static_cast<double>(in_flight()));
  absl::flat_hash_map<std::string, double> running, waiting, queue;
  int live = 0;
  for (const v1::WorkerInfo& w : status.workers()) {
    const metrics::Labels l = {{"model_name", w.model()}, {"worker_id", w.worker_id()}};
    const bool serving = w.state() == v1::WORKER_STATE_SERVING;
    live += serving;
    r->GetGauge("kvgrid:worker_up", "1 while the worker is live and placed on.", l)
        ->Set(serving ? 1 : 0);
    if (!serving) continue;
    r->GetGauge("kvgrid:kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (0-1).",
                l)
        ->Set(w.usage().usage());
    r->GetGauge("kvgrid:prefix_cache_hit_rate", "The worker's prefix-cache hit rate (tokens).", l)
        ->Set(w.usage().prefix_hit_rate());
    r->GetCounter("kvgrid:num_preemptions_total", "Sequences the worker preempted.", l)
        ->SetTotal(static_cast<double>(w.usage().num_preemptions()));
    running[w.model()] += w.usage().num_running();
    waiting[w.model()] += w.usage().num_waiting();
  }
  for (const v1::GroupInfo& g : status.groups()) queue[g.model()] += g.queue_depth();
  for (const auto& [model, v] : running) {
    r->GetGauge("kvgrid:num_requests_running", "Sequences running on the workers.",
                {{"model_name", model}})
        ->Set(v);
    r->GetGauge("kvgrid:num_requests_waiting", "Sequences waiting on the workers.",
                {{"model_name", model}})
        ->Set(waiting[model]);
    r->GetGauge("kvgrid:queue_depth",
                "Requests placed on workers and not yet running (the autoscaling signal).",
                {{"model_name", model}})
        ->Set(queue[model]);
  }
  r->GetGauge("kvgrid:workers_live", "Workers live and placed on.")->Set(live);
}

}  // namespace kvgrid::coordinator
