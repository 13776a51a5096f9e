#include "worker/service/worker_metrics.h"

#include "absl/time/time.h"

namespace kvgrid::worker {

void AddEngineMetrics(metrics::Registry* registry, const EngineLoop* loop,
                      const std::string& model_name) {
  const metrics::Labels m = {{"model_name", model_name}};
  metrics::Registry* r = registry;
  metrics::Gauge* running = r->GetGauge("kvgrid:num_requests_running", "Sequences running.", m);
  metrics::Gauge* waiting = r->GetGauge("kvgrid:num_requests_waiting", "Sequences waiting.", m);
  metrics::Gauge* swapped =
      r->GetGauge("kvgrid:num_requests_swapped", "Sequences swapped out to host memory.", m);
  metrics::Gauge* usage =
      r->GetGauge("kvgrid:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", m);
  metrics::Gauge* blocks_total =
      r->GetGauge("kvgrid:kv_cache_blocks_total", "KV blocks in the pool.", m);
  metrics::Gauge* blocks_free =
      r->GetGauge("kvgrid:kv_cache_blocks_free", "KV blocks allocatable now.", m);
  metrics::Gauge* waste = r->GetGauge("kvgrid:kv_cache_internal_waste",
                                      "Unused share of the slots in used blocks (0-1).", m);
  metrics::Counter* preemptions =
      r->GetCounter("kvgrid:num_preemptions_total", "Sequences preempted.", m);
  metrics::Counter* queries = r->GetCounter("kvgrid:prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache.", m);
  metrics::Counter* hits = r->GetCounter("kvgrid:prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache.", m);
  metrics::Gauge* busy = r->GetGauge(
      "kvgrid:engine_busy_seconds",
      "How long the engine's current step has run (0 while idle); past --stall-timeout-s the "
      "worker reports a stall.",
      m);
  r->AddCollector([=] {
    busy->Set(absl::ToDoubleSeconds(loop->BusyFor()));
    const EngineStats s = loop->Stats();
    running->Set(static_cast<double>(s.num_running));
    waiting->Set(static_cast<double>(s.num_waiting));
    swapped->Set(static_cast<double>(s.num_swapped));
    usage->Set(s.usage);
    blocks_total->Set(s.blocks_total);
    blocks_free->Set(s.blocks_free);
    waste->Set(s.internal_waste);
    preemptions->SetTotal(static_cast<double>(s.num_preemptions));
    queries->SetTotal(static_cast<double>(s.prefix_query_tokens));
    hits->SetTotal(static_cast<double>(s.prefix_hit_tokens));
  });
}

}  // namespace kvgrid::worker
