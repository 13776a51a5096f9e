// Prometheus rendering: families with HELP/TYPE, labels escaped, histograms cumulative with
// +Inf, _sum and _count; collectors run before each render; the HTTP endpoint serves it.
#include "metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "gtest/gtest.h"
#include "metrics/http_endpoint.h"

namespace kvgrid::metrics {
namespace {

TEST(MetricsTest, RendersTheTextFormat) {
  Registry r;
  r.GetCounter("kvgrid:tokens_total", "Tokens.", {{"model_name", "m\"1"}})->Increment(3);
  r.GetCounter("kvgrid:tokens_total", "Tokens.", {{"model_name", "m\"1"}})->Increment();
  Histogram* h = r.GetHistogram("kvgrid:lat_seconds", "Latency.", {0.1, 1.0}, {{"model_name", "m"}});
  h->Observe(0.05);
  h->Observe(0.5);
  h->Observe(0.5);
  h->Observe(7.0);
  Gauge* g = r.GetGauge("kvgrid:usage", "Usage.");
  int collected = 0;
  r.AddCollector([&] { g->Set(++collected * 0.25); });
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE kvgrid:tokens_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvgrid:tokens_total{model_name=\"m\\\"1\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvgrid:lat_seconds_bucket{model_name=\"m\",le=\"0.10000000000000001\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvgrid:lat_seconds_bucket{model_name=\"m\",le=\"1\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvgrid:lat_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4\n"), std::string::npos);
  EXPECT_NE(text.find("kvgrid:lat_seconds_count{model_name=\"m\"} 4\n"), std::string::npos);
  EXPECT_NE(text.find("kvgrid:lat_seconds_sum{model_name=\"m\"} 8.05"), std::string::npos);
  EXPECT_NE(text.find("kvgrid:usage 0.25\n"), std::string::npos);
  EXPECT_NE(r.Render().find("kvgrid:usage 0.5\n"), std::string::npos);
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
  close(fd);
  return out;
}

TEST(MetricsTest, HttpEndpointServesMetrics) {
  Registry r;
  r.GetCounter("kvgrid:requests_total", "Requests.")->Increment(2);
  auto endpoint = HttpEndpoint::Start("127.0.0.1:0", &r);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  ASSERT_GT((*endpoint)->port(), 0);
  const std::string response = HttpGet((*endpoint)->port(), "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("text/plain; version=0.0.4"), std::string::npos) << response;
  EXPECT_NE(response.find("kvgrid:requests_total 2\n"), std::string::npos) << response;
  EXPECT_EQ(HttpGet((*endpoint)->port(), "/other").find("kvgrid:"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::metrics
