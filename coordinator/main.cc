// kvgrid-coordinator: the public gRPC API of a kvgrid cluster. Workers register with it; it
// places each request on a worker, relays the token stream and fails over when a worker dies.
// Serves grpc.health.v1 (overall, "kvgrid.v1.Generation" and one entry per model) and server
// reflection. SIGTERM/SIGINT drain: health NOT_SERVING, new requests refused with
// UNAVAILABLE, running ones finish within --drain-timeout-s, then exit.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "auth/bearer_auth.h"
#include "auth/tls.h"
#include "coordinator/frontend.h"
#include "coordinator/http_server.h"
#include "coordinator/kserve_http.h"
#include "coordinator/kserve_service.h"
#include "coordinator/openai_api.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "coordinator/registry_service.h"
#include "coordinator/relay.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "metrics/http_endpoint.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "model/status_macros.h"
#include "tools/kvgrid/args.h"
#include "tools/kvgrid/process.h"

namespace {

using kvgrid::cli::Args;

constexpr char kHelp[] =
    "usage: kvgrid-coordinator --model DIR[,DIR...] [flags]\n"
    "\n"
    "  --model DIRS                model directories served (config.json, tokenizer.json;\n"
    "                              no weights needed) or .gguf files (metadata and the\n"
    "                              embedded tokenizer); a model's name is its directory's\n"
    "                              (or file's) name\n"
    "  --chat-template FILE        the chat template messages are rendered with, instead\n"
    "                              of the model's own: a .jinja file (the model's special\n"
    "                              tokens apply), a tokenizer_config.json or a .gguf; with\n"
    "                              several models NAME=FILE[,NAME=FILE...]\n"
    "  --listen HOST:PORT          public and worker API (default 127.0.0.1:50051)\n"
    "  --heartbeat-interval-ms N   asked of workers (default 500)\n"
    "  --heartbeat-timeout-ms N    a worker silent this long is taken out (default 3000)\n"
    "  --max-queue-depth N         requests a worker may queue beyond its max_num_seqs\n"
    "                              before the coordinator answers RESOURCE_EXHAUSTED (default 64)\n"
    "  --max-failovers N           worker failures one request survives (default 3)\n"
    "  --drain-timeout-s S         how long running requests may take on shutdown (default 30)\n"
    "  --http-listen HOST:PORT     also serve the OpenAI-compatible HTTP API there\n"
    "                              (/v1/completions, /v1/chat/completions, /v1/models,\n"
    "                              /health, /tokenize, /detokenize); TLS and API keys as\n"
    "                              on the API port\n"
    "  --http-threads N            threads of the HTTP server (default 2)\n"
    "  --http-idle-timeout-s S     reading a request, and a kept-alive connection's wait\n"
    "                              for the next (default 60)\n"
    "  --http-write-timeout-s S    a response write the client accepts nothing of for S\n"
    "                              seconds aborts its request (default 60)\n"
    "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "  --health-listen HOST:PORT   also serve grpc.health.v1 in plaintext there (probes)\n"
    "  --worker-listen HOST:PORT   serve the worker API (registration, heartbeats) there\n"
    "                              instead of on the API port; TLS with --worker-tls-cert\n"
    "  --tls-cert F --tls-key F    TLS on the API port (PEM); --tls-ca F also requires and\n"
    "                              verifies client certificates (mTLS)\n"
    "  --worker-tls-cert F --worker-tls-key F --worker-tls-ca F\n"
    "                              TLS between coordinator and workers (PEM): cert and key\n"
    "                              serve --worker-listen and are the client certificate the\n"
    "                              coordinator presents to workers; the CA verifies workers'\n"
    "                              certificates when dialling them and, with cert and key,\n"
    "                              requires client certificates on --worker-listen (mTLS)\n"
    "  --worker-tls-server-name N  the name checked in every worker's certificate (default:\n"
    "                              the host of the address the worker registers)\n"
    "  --tls-refresh-s S           certificate files are re-read this often: a replaced\n"
    "                              certificate serves new connections (default 60)\n"
    "  --api-keys K1,K2 | --api-key-file F\n"
    "                              clients must send 'authorization: Bearer <key>'\n"
    "  --cluster-token T | --cluster-token-file F\n"
    "                              shared secret of coordinator and workers; refused over\n"
    "                              plaintext links (no --worker-tls-*) unless\n"
    "  --allow-insecure-cluster    is given (a warning at startup)\n"
    "  --insecure-open-registration\n"
    "                              with --api-keys and no --cluster-token, let anyone who\n"
    "                              reaches the API port register a worker (refused otherwise\n"
    "                              when workers register on the API port)\n"
    "\n"
    "Every flag can also be given as an environment variable: --max-queue-depth as\n"
    "KVGRID_MAX_QUEUE_DEPTH (the command line wins).\n";

absl::Status Serve(Args& args) {
  const std::optional<std::string> models = args.GetString("model");
  const std::optional<std::string> chat_template = args.GetString("chat-template");
  const std::string listen = args.GetString("listen").value_or("127.0.0.1:50051");
  KVGRID_ASSIGN_OR_RETURN(auto interval_ms, args.GetInt("heartbeat-interval-ms"));
  KVGRID_ASSIGN_OR_RETURN(auto timeout_ms, args.GetInt("heartbeat-timeout-ms"));
  KVGRID_ASSIGN_OR_RETURN(auto max_queue, args.GetInt("max-queue-depth"));
  KVGRID_ASSIGN_OR_RETURN(auto max_failovers, args.GetInt("max-failovers"));
  KVGRID_ASSIGN_OR_RETURN(auto drain_timeout, args.GetDouble("drain-timeout-s"));
  const std::optional<std::string> metrics_listen = args.GetString("metrics-listen");
  const std::optional<std::string> http_listen = args.GetString("http-listen");
  KVGRID_ASSIGN_OR_RETURN(auto http_threads, args.GetInt("http-threads"));
  KVGRID_ASSIGN_OR_RETURN(auto http_idle_timeout, args.GetDouble("http-idle-timeout-s"));
  KVGRID_ASSIGN_OR_RETURN(auto http_write_timeout, args.GetDouble("http-write-timeout-s"));
  const std::optional<std::string> health_listen = args.GetString("health-listen");
  const std::optional<std::string> worker_listen = args.GetString("worker-listen");
  KVGRID_ASSIGN_OR_RETURN(auto tls_refresh, args.GetInt("tls-refresh-s"));
  const int refresh_s = kvgrid::auth::TlsRefreshSeconds(tls_refresh);
  const kvgrid::auth::TlsFiles tls{.cert = args.GetString("tls-cert"),
                                   .key = args.GetString("tls-key"),
                                   .ca = args.GetString("tls-ca"),
                                   .refresh_s = refresh_s};
  const kvgrid::auth::ClusterTls worker_tls{
      .files = {.cert = args.GetString("worker-tls-cert"),
                .key = args.GetString("worker-tls-key"),
                .ca = args.GetString("worker-tls-ca"),
                .flag_prefix = "worker-tls",
                .refresh_s = refresh_s},
      .server_name = args.GetString("worker-tls-server-name")};
  KVGRID_ASSIGN_OR_RETURN(const bool allow_insecure_cluster,
                          args.GetBool("allow-insecure-cluster", false));
  KVGRID_ASSIGN_OR_RETURN(const bool open_registration,
                          args.GetBool("insecure-open-registration", false));
  KVGRID_ASSIGN_OR_RETURN(const kvgrid::auth::BearerAuth api_keys,
                          kvgrid::auth::BearerAuth::FromFlags(args.GetString("api-key-file"),
                                                              args.GetString("api-keys"),
                                                              "api-key-file"));
  KVGRID_ASSIGN_OR_RETURN(
      const std::string cluster_token,
      kvgrid::auth::ResolveToken(args.GetString("cluster-token-file"),
                                 args.GetString("cluster-token"), "cluster-token-file"));
  KVGRID_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                          kvgrid::auth::ServerCredentials(tls));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  // The worker API's port: its own (--worker-listen, --worker-tls-*) or the public one.
  std::shared_ptr<grpc::ServerCredentials> worker_credentials;
  if (worker_listen) {
    KVGRID_ASSIGN_OR_RETURN(worker_credentials, kvgrid::auth::ServerCredentials(worker_tls.files));
  }
  KVGRID_ASSIGN_OR_RETURN(kvgrid::auth::ClusterChannels worker_channels,
                          kvgrid::auth::ClusterChannels::ForClient(worker_tls));
  const bool registration_tls = worker_listen ? worker_tls.serves_tls() : tls.cert.has_value();
  std::string plaintext_links;
  if (!registration_tls) {
    plaintext_links = worker_listen ? "the worker port (--worker-listen without --worker-tls-cert)"
                                    : "the API port workers register on (no --tls-cert)";
  }
  if (!worker_channels.tls()) {
    absl::StrAppend(&plaintext_links, plaintext_links.empty() ? "" : " and ",
                    "the calls to workers (no --worker-tls-ca)");
  }
  KVGRID_RETURN_IF_ERROR(kvgrid::auth::CheckTokenTransport(
      "kvgrid-coordinator", cluster_token, plaintext_links, allow_insecure_cluster));
  // Registration on the public port without a token: whoever reaches the port can add a
  // worker and be sent clients' prompts. With API keys the port is meant to be private, so
  // that is refused unless asked for.
  if (!worker_listen && cluster_token.empty()) {
    if (api_keys.enabled() && !open_registration) {
      return absl::InvalidArgumentError(
          "--api-keys: workers register on the API port, and without --cluster-token anyone "
          "who reaches it could register a worker and receive clients' requests; give "
          "--cluster-token (or --cluster-token-file), or --insecure-open-registration");
    }
    std::fprintf(stderr,
                 "kvgrid-coordinator: WARNING: workers register on the API port without a "
                 "cluster token: anyone who reaches port %s can add a worker (give "
                 "--cluster-token)\n",
                 listen.substr(listen.rfind(':') + 1).c_str());
  }
  if (!models) return absl::InvalidArgumentError("--model: required (a model directory)");
  std::vector<std::filesystem::path> dirs;
  for (absl::string_view d : absl::StrSplit(*models, ',', absl::SkipEmpty())) {
    dirs.emplace_back(std::string(d));
  }
  kvgrid::coordinator::RegistryOptions ro;
  ro.worker_channels = worker_channels;
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
  relay.cluster_token = cluster_token;
  const kvgrid::auth::BearerAuth cluster_auth =
      kvgrid::auth::BearerAuth::FromTokens({cluster_token});
  if (max_failovers) {
    if (*max_failovers < 0) return absl::InvalidArgumentError("--max-failovers: must be >= 0");
    relay.max_failovers = static_cast<int>(*max_failovers);
  }

  std::vector<std::string> chat_templates;
  if (chat_template) {
    for (absl::string_view t : absl::StrSplit(*chat_template, ',', absl::SkipEmpty())) {
      chat_templates.emplace_back(t);
    }
    if (chat_templates.empty()) return absl::InvalidArgumentError("--chat-template: empty");
  }
  KVGRID_ASSIGN_OR_RETURN(kvgrid::coordinator::ModelCatalog catalog,
                          kvgrid::coordinator::ModelCatalog::Load(dirs, chat_templates));
  kvgrid::coordinator::WorkerRegistry registry(ro);
  kvgrid::metrics::Registry metrics_registry;
  kvgrid::coordinator::CoordinatorMetrics metrics(&metrics_registry);
  kvgrid::coordinator::GenerationService generation(&catalog, &registry, &metrics, relay,
                                                    &api_keys);
  metrics_registry.AddCollector(
      [&] { metrics.CollectFrom(&registry, [&] { return generation.InFlight(); }); });
  std::unique_ptr<kvgrid::metrics::HttpEndpoint> metrics_endpoint;
  if (metrics_listen) {
    KVGRID_ASSIGN_OR_RETURN(metrics_endpoint, kvgrid::metrics::HttpEndpoint::Start(
                                                  *metrics_listen, &metrics_registry));
    std::fprintf(stderr, "kvgrid-coordinator: metrics on port %d (/metrics)\n",
                 metrics_endpoint->port());
  }

  // The OpenAI HTTP API and KServe v2 (gRPC, and HTTP beside OpenAI's routes): the same
  // service, registry, metrics and keys as the gRPC API.
  kvgrid::coordinator::OpenAiApi openai_api(&generation, &catalog, &registry, &api_keys);
  kvgrid::coordinator::KServeApi kserve_api(&generation, &catalog, &registry);
  kvgrid::coordinator::KServeService kserve_service(&kserve_api, &api_keys);
  kvgrid::coordinator::KServeHttp kserve_http(&kserve_api, &api_keys);
  std::unique_ptr<kvgrid::coordinator::HttpServer> http_server;
  if (http_listen) {
    kvgrid::coordinator::HttpServerOptions ho;
    ho.listen = *http_listen;
    if (http_threads) {
      if (*http_threads < 1 || *http_threads > 256) {
        return absl::InvalidArgumentError("--http-threads: must be in [1, 256]");
      }
      ho.threads = static_cast<int>(*http_threads);
    }
    if (http_idle_timeout) {
      if (!(*http_idle_timeout > 0)) {
        return absl::InvalidArgumentError("--http-idle-timeout-s: must be > 0");
      }
      ho.idle_timeout = std::chrono::milliseconds(static_cast<int64_t>(*http_idle_timeout * 1000));
    }
    if (http_write_timeout) {
      if (!(*http_write_timeout > 0) || *http_write_timeout > 86400) {
        return absl::InvalidArgumentError("--http-write-timeout-s: must be in (0, 86400]");
      }
      ho.write_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(*http_write_timeout * 1000));
    }
    ho.tls_cert = tls.cert;
    ho.tls_key = tls.key;
    KVGRID_ASSIGN_OR_RETURN(
        http_server, kvgrid::coordinator::HttpServer::Start(
                         ho, [&openai_api, &kserve_http](
                                 kvgrid::coordinator::HttpRequest request,
                                 std::shared_ptr<kvgrid::coordinator::HttpResponder> r) {
                           if (kvgrid::coordinator::KServeHttp::Serves(request.path)) {
                             kserve_http.Handle(std::move(request), std::move(r));
                           } else {
                             openai_api.Handle(std::move(request), std::move(r));
                           }
                         }));
    std::fprintf(stderr, "kvgrid-coordinator: OpenAI and KServe v2 HTTP APIs on port %d%s\n",
                 http_server->port(), tls.cert ? " (TLS)" : "");
  }

  std::atomic<bool> draining{false};
  // The health services of the API server and of the plaintext health server, if any.
  std::vector<grpc::HealthCheckServiceInterface*> healths;
  absl::Mutex health_mu;
  // What update_health last set, and on how many of `healths`.
  absl::flat_hash_map<std::string, bool> health_published;
  size_t health_published_to = 0;
  // Health: overall is the coordinator itself; the API and each model are SERVING while a
  // live worker serves them.
  auto update_health = [&] {
    absl::MutexLock lock(&health_mu);
    const bool up = !draining.load();
    bool any = false;
    std::vector<std::pair<std::string, bool>> statuses;
    for (const auto& m : catalog.models()) {
      const bool live = registry.NumLive(m->name) > 0;
      any = any || live;
      statuses.emplace_back(m->name, up && live);
    }
    statuses.emplace_back("kvgrid.v1.Generation", up && any);
    statuses.emplace_back("inference.GRPCInferenceService", up && any);
    statuses.emplace_back("", up);
    // gRPC's health service sends every Watch stream a message on each SetServingStatus,
    // changed or not, and this runs every 100 ms: set only what changed (everything when a
    // health service was added since the last call).
    const bool all = healths.size() != health_published_to;
    health_published_to = healths.size();
    for (const auto& [name, serving] : statuses) {
      auto [it, inserted] = health_published.try_emplace(name, serving);
      if (!all && !inserted && it->second == serving) continue;
      it->second = serving;
      for (grpc::HealthCheckServiceInterface* health : healths) {
        health->SetServingStatus(name, serving);
      }
    }
  };
  kvgrid::coordinator::RegistryService registry_service(&registry, &catalog, &cluster_auth,
                                                        update_health);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, credentials, &port);
  builder.RegisterService(&generation);
  builder.RegisterService(&kserve_service);
  // Workers register on the API port unless they have a port of their own.
  if (!worker_listen) builder.RegisterService(&registry_service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  // gRPC sets SO_REUSEPORT by default: a second coordinator on this port would then share it,
  // the kernel splitting connections between the two, instead of failing to listen.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", listen));
  }
  std::unique_ptr<grpc::Server> worker_server;
  if (worker_listen) {
    // Inside the cluster, guarded by the cluster token (and TLS with --worker-tls-cert):
    // registration, heartbeats, the groups' rendezvous.
    grpc::ServerBuilder wb;
    int worker_port = 0;
    wb.AddListeningPort(*worker_listen, worker_credentials, &worker_port);
    wb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    wb.RegisterService(&registry_service);
    worker_server = wb.BuildAndStart();
    if (!worker_server || worker_port == 0) {
      return absl::UnavailableError(absl::StrCat("--worker-listen: cannot listen on ",
                                                 *worker_listen));
    }
    std::fprintf(stderr, "kvgrid-coordinator: worker API on port %d%s\n", worker_port,
                 worker_tls.serves_tls() ? (worker_tls.files.ca ? " (mTLS)" : " (TLS)") : "");
  }
  std::unique_ptr<grpc::Server> health_server;
  int health_port = 0;
  if (health_listen) {
    // Plaintext, health only: for Kubernetes' gRPC probes when the API port uses TLS.
    grpc::ServerBuilder hb;
    hb.AddListeningPort(*health_listen, grpc::InsecureServerCredentials(), &health_port);
    hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_server = hb.BuildAndStart();
    if (!health_server || health_port == 0) {
      return absl::UnavailableError(absl::StrCat("--health-listen: cannot listen on ",
                                                 *health_listen));
    }
    std::fprintf(stderr, "kvgrid-coordinator: health on port %d\n", health_port);
  }
  {
    absl::MutexLock lock(&health_mu);
    healths.push_back(server->GetHealthCheckService());
    if (health_server) healths.push_back(health_server->GetHealthCheckService());
  }
  update_health();
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::fprintf(stderr, "kvgrid-coordinator: listening on %s:%d%s%s\n", host.c_str(), port,
               tls.cert ? " (TLS)" : "", api_keys.enabled() ? " (API keys required)" : "");

  // Liveness: workers that stop heartbeating leave placement and health.
  std::atomic<bool> stop{false};
  std::thread maintenance([&] {
    while (!stop.load()) {
      registry.ExpireStale();
      update_health();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  kvgrid::cli::WaitForShutdownSignal();

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
  // Calls still open past the drain timeout are cancelled by the shutdown: HTTP responses see
  // their client gone, which cancels their relays.
  if (http_server) http_server->Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  if (worker_server) worker_server->Shutdown(std::chrono::system_clock::now());
  // The shutdown cancelled the calls still open, and their relays cancelled their worker
  // streams, whose last callbacks still use the registry and metrics on this stack: wait for
  // them. Cancelling is local, so this takes moments; should it not, the process leaves
  // without tearing down what they use.
  const auto relays_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (kvgrid::coordinator::GenerateRelay::NumAlive() > 0 &&
         std::chrono::steady_clock::now() < relays_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (const int64_t left = kvgrid::coordinator::GenerateRelay::NumAlive(); left > 0) {
    std::fprintf(stderr, "kvgrid-coordinator: %lld worker streams still open; exiting\n",
                 static_cast<long long>(left));
    std::fflush(stderr);
    std::_Exit(0);
  }
  std::fprintf(stderr, "kvgrid-coordinator: stopped\n");
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  return kvgrid::cli::ServiceMain(argc, argv, "coordinator", kHelp, Serve);
}
