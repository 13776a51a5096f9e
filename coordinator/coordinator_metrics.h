// The coordinator's Prometheus metrics, named as vLLM names its equivalents (with the
// `kvgrid:` prefix and a `model_name` label), so existing dashboards need only the prefix
// changed: request latencies as seen by clients, token and request counts, failovers, and the
// cluster's KV usage per worker from heartbeats.
//
// Thread-safety: as metrics::Registry.
#ifndef KVGRID_COORDINATOR_COORDINATOR_METRICS_H_
#define KVGRID_COORDINATOR_COORDINATOR_METRICS_H_

#include <string>

#include "absl/container/flat_hash_map.h"
#include "grpcpp/support/status_code_enum.h"
#include "metrics/metrics.h"

namespace kvgrid::coordinator {

class WorkerRegistry;

class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(metrics::Registry* registry);

  // Per-request observations, labelled by model and by the API the request came in on
  // (`api`: "grpc" or "http").
  void ObserveFirstToken(const std::string& model, const std::string& api, double seconds);
  void ObserveInterToken(const std::string& model, const std::string& api, double seconds);
  void ObserveFinished(const std::string& model, const std::string& api,
                       const std::string& finish_reason, double e2e_seconds,
                       double queue_seconds, int64_t prompt_tokens, int64_t generation_tokens);
  void CountError(const std::string& model, const std::string& api, grpc::StatusCode code);
  void CountFailover(const std::string& model);

  // Gauges read from the registry and the frontend at each scrape.
  void CollectFrom(const WorkerRegistry* registry, const std::function<int64_t()>& in_flight);

  [[nodiscard]] metrics::Registry* registry() const { return registry_; }

 private:
  metrics::Registry* registry_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_COORDINATOR_METRICS_H_
