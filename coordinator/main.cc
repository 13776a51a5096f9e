// kvgrid-coordinator: the public gRPC API of a kvgrid cluster. Workers register with it; it
// places each request on a worker, relays the token stream and fails over when a worker dies.
// Serves grpc.health.v1 (overall, "kvgrid.v1.Generation" and one entry per model) and server
// reflection. SIGTERM/SIGINT drain: health NOT_SERVING, new requests refused with
// UNAVAILABLE, running ones finish within --drain-timeout-s, then exit.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "coordinator/frontend.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "coordinator/registry_service.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "metrics/http_endpoint.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "model/status_macros.h"
#include "tools/kvgrid/args.h"

namespace {

using kvgrid::cli::Args;

constexpr char kHelp[] =
    "usage: kvgrid-coordinator --model DIR[,DIR...] [flags]\n"
    "\n"
    "  --model DIRS                model directories served (config.json, tokenizer.json;\n"
    "                              no weights needed); a model's name is its directory's\n"
    "  --listen HOST:PORT          public and worker API (default 127.0.0.1:50051)\n"
    "  --heartbeat-interval-ms N   asked of workers (default 500)\n"
    "  --heartbeat-timeout-ms N    a worker silent this long is taken out (default 3000)\n"
    "  --max-queue-depth N         requests a worker may queue beyond its max_num_seqs\n"
    "                              before the coordinator answers RESOURCE_EXHAUSTED (default 64)\n"
    "  --max-failovers N           worker failures one request survives (default 3)\n"
    "  --drain-timeout-s S         how long running requests may take on shutdown (default 30)\n"
    "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics\n";

absl::Status Serve(Args& args) {
  const std::optional<std::string> models = args.GetString("model");
  const std::string listen = args.GetString("listen").value_or("127.0.0.1:50051");
  KVGRID_ASSIGN_OR_RETURN(auto interval_ms, args.GetInt("heartbeat-interval-ms"));
  KVGRID_ASSIGN_OR_RETURN(auto timeout_ms, args.GetInt("heartbeat-timeout-ms"));
  KVGRID_ASSIGN_OR_RETURN(auto max_queue, args.GetInt("max-queue-depth"));
  KVGRID_ASSIGN_OR_RETURN(auto max_failovers, args.GetInt("max-failovers"));
  KVGRID_ASSIGN_OR_RETURN(auto drain_timeout, args.GetDouble("drain-timeout-s"));
  const std::optional<std::string> metrics_listen = args.GetString("metrics-listen");
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (!models) return absl::InvalidArgumentError("--model: required (a model directory)");
  std::vector<std::filesystem::path> dirs;
  for (absl::string_view d : absl::StrSplit(*models, ',', absl::SkipEmpty())) {
    dirs.emplace_back(std::string(d));
  }
  kvgrid::coordinator::RegistryOptions ro;
  if (interval_ms) {
    if (*interval_ms < 10) return absl::InvalidArgumentError("--heartbeat-interval-ms: must be >= 10");
    ro.heartbeat_interval = absl::Milliseconds(*interval_ms);
  }
  if (timeout_ms) {
    if (*timeout_ms < 10) return absl::InvalidArgumentError("--heartbeat-timeout-ms: must be >= 10");
    ro.heartbeat_timeout = absl::Milliseconds(*timeout_ms);
  }
  if (max_queue) {
    if (*max_queue < 0) return absl::InvalidArgumentError("--max-queue-depth: must be >= 0");
    ro.max_queue_depth = *max_queue;
  }
  kvgrid::coordinator::RelayOptions relay;
  if (max_failovers) {
    if (*max_failovers < 0) return absl::InvalidArgumentError("--max-failovers: must be >= 0");
    relay.max_failovers = static_cast<int>(*max_failovers);
  }

  KVGRID_ASSIGN_OR_RETURN(kvgrid::coordinator::ModelCatalog catalog,
                          kvgrid::coordinator::ModelCatalog::Load(dirs));
  kvgrid::coordinator::WorkerRegistry registry(ro);
  kvgrid::metrics::Registry metrics_registry;
  kvgrid::coordinator::CoordinatorMetrics metrics(&metrics_registry);
  kvgrid::coordinator::GenerationService generation(&catalog, &registry, &metrics, relay);
  metrics_registry.AddCollector(
      [&] { metrics.CollectFrom(&registry, [&] { return generation.InFlight(); }); });
  std::unique_ptr<kvgrid::metrics::HttpEndpoint> metrics_endpoint;
  if (metrics_listen) {
    KVGRID_ASSIGN_OR_RETURN(metrics_endpoint, kvgrid::metrics::HttpEndpoint::Start(
                                                  *metrics_listen, &metrics_registry));
    std::fprintf(stderr, "kvgrid-coordinator: metrics on port %d (/metrics)\n",
                 metrics_endpoint->port());
  }

  std::atomic<bool> draining{false};
  grpc::Server* server_ptr = nullptr;
  // Health: overall is the coordinator itself; the API and each model are SERVING while a
  // live worker serves them.
  auto update_health = [&] {
    if (server_ptr == nullptr) return;
    grpc::HealthCheckServiceInterface* health = server_ptr->GetHealthCheckService();
    const bool up = !draining.load();
    bool any = false;
    for (const auto& m : catalog.models()) {
      const bool live = registry.NumLive(m->name) > 0;
      any = any || live;
      health->SetServingStatus(m->name, up && live);
    }
    health->SetServingStatus("kvgrid.v1.Generation", up && any);
    health->SetServingStatus("", up);
  };
  kvgrid::coordinator::RegistryService registry_service(&registry, &catalog, update_health);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&generation);
  builder.RegisterService(&registry_service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", listen));
  }
  server_ptr = server.get();
  update_health();
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::fprintf(stderr, "kvgrid-coordinator: listening on %s:%d\n", host.c_str(), port);

  // Liveness: workers that stop heartbeating leave placement and health.
  std::atomic<bool> stop{false};
  std::thread maintenance([&] {
    while (!stop.load()) {
      registry.ExpireStale();
      update_health();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  int signal = 0;
  sigwait(&signals, &signal);

  std::fprintf(stderr, "kvgrid-coordinator: draining (%lld requests in flight)\n",
               static_cast<long long>(generation.InFlight()));
  draining.store(true);
  generation.SetDraining(true);
  update_health();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(drain_timeout.value_or(30.0));
  while (generation.InFlight() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop.store(true);
  maintenance.join();
  // Calls still open past the drain timeout are cancelled by the shutdown.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  std::fprintf(stderr, "kvgrid-coordinator: stopped\n");
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Block the signals before any thread starts; Serve waits for them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto args = Args::Parse(argc, argv, 1);
  if (!args.ok()) {
    std::fprintf(stderr, "kvgrid-coordinator: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  return kvgrid::cli::RunSubcommand(*args, "coordinator", kHelp, Serve);
}
