#include "metrics/http_endpoint.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "civetweb.h"

namespace kvgrid::metrics {
namespace {

int ServeMetrics(mg_connection* conn, void* data) {
  const mg_request_info* info = mg_get_request_info(conn);
  if (std::strcmp(info->request_method, "GET") != 0 &&
      std::strcmp(info->request_method, "HEAD") != 0) {
    mg_send_http_error(conn, 405, "%s", "only GET /metrics is served\n");
    return 405;
  }
  const std::string body = static_cast<Registry*>(data)->Render();
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  if (std::strcmp(info->request_method, "GET") == 0) mg_write(conn, body.data(), body.size());
  return 200;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpEndpoint>> HttpEndpoint::Start(const std::string& address,
                                                                  Registry* registry) {
  static const unsigned init = mg_init_library(0);
  (void)init;
  const char* options[] = {"listening_ports", address.c_str(), "num_threads", "2", nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };  // quiet
  mg_context* ctx = mg_start(&callbacks, nullptr, options);
  if (ctx == nullptr) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: cannot listen on ", address));
  }
  mg_set_request_handler(ctx, "/metrics$", ServeMetrics, registry);
  mg_server_port ports[1];
  std::memset(ports, 0, sizeof(ports));
  const int n = mg_get_server_ports(ctx, 1, ports);
  return std::unique_ptr<HttpEndpoint>(new HttpEndpoint(ctx, n > 0 ? ports[0].port : 0));
}

HttpEndpoint::~HttpEndpoint() { mg_stop(ctx_); }

}  // namespace kvgrid::metrics
