// A small HTTP server (civetweb) that serves a Registry at GET /metrics in the Prometheus text
// format, for Prometheus (or a ServiceMonitor) to scrape.
//
// Thread-safety: civetweb serves requests on its own threads; Render is thread-safe.
#ifndef KVGRID_METRICS_HTTP_ENDPOINT_H_
#define KVGRID_METRICS_HTTP_ENDPOINT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/metrics.h"

struct mg_context;

namespace kvgrid::metrics {

class HttpEndpoint {
 public:
  // Listens on `address` ("HOST:PORT"; port 0 picks a free one) and serves `registry`, which
  // must outlive the endpoint. Errors: UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(const std::string& address,
                                                             Registry* registry);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  // The port actually bound.
  [[nodiscard]] int port() const { return port_; }

 private:
  HttpEndpoint(mg_context* ctx, int port) : ctx_(ctx), port_(port) {}
  mg_context* ctx_;
  int port_;
};

}  // namespace kvgrid::metrics

#endif  // KVGRID_METRICS_HTTP_ENDPOINT_H_
