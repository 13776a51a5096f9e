// A worker's Prometheus metrics, read from its engine at each scrape and named as vLLM names
// its equivalents (with the `kvgrid:` prefix and a `model_name` label).
#ifndef KVGRID_WORKER_SERVICE_WORKER_METRICS_H_
#define KVGRID_WORKER_SERVICE_WORKER_METRICS_H_

#include <string>

#include "metrics/metrics.h"
#include "worker/service/engine_loop.h"

namespace kvgrid::worker {

// Adds a collector to `registry` that mirrors `loop`'s engine statistics. Both must outlive
// every later Render.
void AddEngineMetrics(metrics::Registry* registry, const EngineLoop* loop,
                      const std::string& model_name);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_WORKER_METRICS_H_
