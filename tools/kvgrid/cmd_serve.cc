// kvgrid serve: a local cluster — one kvgrid-coordinator and N kvgrid-worker processes on
// loopback, started from the directory of this executable — that stays up until SIGINT or
// SIGTERM, then drains every process and exits.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "auth/bearer_auth.h"
#include "auth/throwaway_cluster.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "model/model_config.h"
#include "model/status_macros.h"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "tools/kvgrid/process.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid serve [--workers N [--tp T] | --groups 1,1,2] [--cp C|auto] [--model DIR]\n"
    "                    [--port P]\n"
    "                    [worker flags]\n"
    "\n"
    "Starts kvgrid-coordinator on 127.0.0.1:P and N kvgrid-worker processes registered with\n"
    "it, waits until every worker serves, and runs until interrupted (Ctrl-C / SIGTERM), then\n"
    "drains them all. Clients: kvgrid generate --addr 127.0.0.1:P, or any gRPC client.\n"
    "\n"
    "  --workers N                 worker groups (default 1)\n"
    "  --tp T                      ranks per group: tensor parallelism (default 1)\n"
    "  --groups SIZES              group sizes, e.g. 1,1,2 (instead of --workers and --tp)\n"
    "  --cp C|auto                 context parallelism: each group's C ranks split every\n"
    "                              sequence's KV blocks, so a group holds sequences C times as\n"
    "                              long (default auto); with --tp T a group has T x C ranks\n"
    "                              (at most 16 in a local cluster).\n"
    "                              auto: a group of more ranks than the model has KV heads\n"
    "                              splits the heads over that many and the blocks over the\n"
    "                              rest (--tp 4 --cp auto on 2 KV heads: 2 x 2), instead of\n"
    "                              replicating heads; each CP rank then holds its TP shard's\n"
    "                              weights (more weight memory per rank than --tp alone; --cp 1\n"
    "                              keeps replicated heads). A GGUF model needs --cp C\n"
    "  --model DIR                 model directory (default: $KVGRID_MODEL, else the embedded\n"
    "                              model)\n"
    "  --port P                    coordinator port on 127.0.0.1 (default 50051)\n"
    "  --http-port P               OpenAI-compatible HTTP API on 127.0.0.1 (default 8000;\n"
    "                              0: off)\n"
    "  --chat-template FILE        the chat template for chat requests instead of the model's\n"
    "                              (.jinja, tokenizer_config.json or .gguf), passed to the\n"
    "                              coordinator\n"
    "  --drain-timeout-s S         on shutdown, how long running requests may take (default 30)\n"
    "  --ready-timeout-s S         how long to wait for the workers (default 120)\n"
    "  coordinator flags, passed to it: --health-listen --metrics-listen --tls-cert --tls-key\n"
    "  --tls-refresh-s --api-keys --api-key-file (see kvgrid-coordinator --help)\n"
    "\n"
    "The links between the processes are private by default: kvgrid serve makes a throwaway\n"
    "CA, a certificate for 127.0.0.1 and a random cluster token in a private temporary\n"
    "directory (removed on exit); the workers register on a port of their own with mutual\n"
    "TLS. --worker-tls-cert --worker-tls-key --worker-tls-ca --worker-tls-server-name and\n"
    "--cluster-token | --cluster-token-file use yours instead.\n"
    "  worker flags, passed to each worker: --kv-cache-memory --kv-cache-dtype --k-cache-dtype\n"
    "  --v-cache-dtype --block-size --max-num-seqs --max-num-batched-tokens --max-model-len\n"
    "  --swap-space --preemption-mode --watermark --enable-prefix-caching --weight-dtype\n"
    "  --device --dtype --gpu-memory-utilization --cuda-graphs --stall-timeout-s\n"
    "  --collective-timeout-s --load-format (on cuda, worker process i of the cluster runs on\n"
    "  visible device i modulo their count)\n"
    "  --threads (default: the cores divided among the workers, so they do not oversubscribe\n"
    "  the machine)\n";

constexpr const char* kWorkerFlags[] = {
    "kv-cache-memory",        "kv-cache-dtype", "k-cache-dtype", "v-cache-dtype",
    "block-size",             "max-num-seqs",   "max-num-batched-tokens",
    "max-model-len",          "swap-space",     "enable-prefix-caching", "threads",
    "weight-dtype",           "preemption-mode", "watermark",
    "device",                 "dtype",          "gpu-memory-utilization", "cuda-graphs",
    "stall-timeout-s",        "collective-timeout-s", "load-format"};

constexpr const char* kCoordinatorFlags[] = {"health-listen", "metrics-listen", "tls-cert",
                                             "tls-key",       "api-keys",       "api-key-file"};
// Flags for the cluster links, passed to the coordinator and every worker.
constexpr const char* kClusterFlags[] = {"worker-tls-cert", "worker-tls-key", "worker-tls-ca",
                                         "worker-tls-server-name", "cluster-token",
                                         "cluster-token-file", "tls-refresh-s"};

// A port on 127.0.0.1 free now (0 when none could be bound).
int64_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int64_t port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

// Whether a TCP listener could bind 127.0.0.1:port now.
bool PortFree(int64_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// Workers in state SERVING, or -1 while the coordinator does not answer.
int ServingWorkers(v1::Generation::Stub& stub, const std::string& api_key) {
  grpc::ClientContext ctx;
  auth::AttachBearer(&ctx, api_key);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::ClusterStatusResponse resp;
  if (!stub.ClusterStatus(&ctx, v1::ClusterStatusRequest(), &resp).ok()) return -1;
  int n = 0;
  for (const v1::WorkerInfo& w : resp.workers()) n += w.state() == v1::WORKER_STATE_SERVING;
  return n;
}

absl::Status Serve(Args& args) {
  const std::filesystem::path dir = ResolveModelDir(args);
  KVGRID_ASSIGN_OR_RETURN(auto workers_flag, args.GetInt("workers"));
  KVGRID_ASSIGN_OR_RETURN(auto tp_flag, args.GetInt("tp"));
  const std::optional<std::string> cp_flag = args.GetString("cp");
  const std::optional<std::string> groups_flag = args.GetString("groups");
  KVGRID_ASSIGN_OR_RETURN(auto port_flag, args.GetInt("port"));
  KVGRID_ASSIGN_OR_RETURN(auto http_port_flag, args.GetInt("http-port"));
  const std::optional<std::string> drain = args.GetString("drain-timeout-s");
  const std::optional<std::string> chat_template = args.GetString("chat-template");
  KVGRID_ASSIGN_OR_RETURN(auto ready_timeout, args.GetDouble("ready-timeout-s"));
  std::vector<std::string> forwarded;
  for (const char* flag : kWorkerFlags) {
    if (auto v = args.GetString(flag)) {
      forwarded.push_back(absl::StrCat("--", flag));
      forwarded.push_back(*v);
    }
  }
  std::vector<std::string> coordinator_flags;
  for (const char* flag : kCoordinatorFlags) {
    if (auto v = args.GetString(flag)) coordinator_flags.insert(coordinator_flags.end(),
                                                                {absl::StrCat("--", flag), *v});
  }
  std::vector<std::string> cluster_flags;
  for (const char* flag : kClusterFlags) {
    if (auto v = args.GetString(flag)) cluster_flags.insert(cluster_flags.end(),
                                                            {absl::StrCat("--", flag), *v});
  }
  const bool own_tls = args.Has("worker-tls-cert") || args.Has("worker-tls-key") ||
                       args.Has("worker-tls-ca");
  const bool own_token = args.Has("cluster-token") || args.Has("cluster-token-file");
  const bool api_tls = args.Has("tls-cert");
  if (args.Has("tls-ca")) {
    // Its readiness poll would need a client certificate of the user's CA.
    return absl::InvalidArgumentError(
        "--tls-ca: client certificates on the API port are for kvgrid-coordinator started "
        "on its own; kvgrid serve takes --tls-cert and --tls-key");
  }
  KVGRID_ASSIGN_OR_RETURN(const std::string api_key,
                          auth::ResolveToken(args.GetString("api-key-file"),
                                             [&]() -> std::optional<std::string> {
                                               auto keys = args.GetString("api-keys");
                                               if (!keys) return std::nullopt;
                                               return std::string(
                                                   *absl::StrSplit(*keys, ',').begin());
                                             }(),
                                             "api-key-file"));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  // The cluster's links: a throwaway CA, certificate and token unless the user brought them.
  std::unique_ptr<auth::ThrowawayCluster> throwaway;
  if (!own_tls || !own_token) {
    KVGRID_ASSIGN_OR_RETURN(throwaway, auth::ThrowawayCluster::Create());
    if (!own_tls) {
      cluster_flags.insert(cluster_flags.end(),
                           {"--worker-tls-cert", throwaway->cert().string(), "--worker-tls-key",
                            throwaway->key().string(), "--worker-tls-ca",
                            throwaway->ca().string()});
    }
    if (!own_token) {
      cluster_flags.insert(cluster_flags.end(),
                           {"--cluster-token-file", throwaway->token_file().string()});
    }
    std::fprintf(stderr, "kvgrid serve: cluster links use %s (certificates in %s)\n",
                 own_tls ? "your certificates and a random token" : "mutual TLS",
                 throwaway->dir().c_str());
  }
  const int64_t worker_api_port = FreePort();
  if (worker_api_port == 0) return absl::UnavailableError("no free port for the worker API");
  const std::string worker_api = absl::StrCat("127.0.0.1:", worker_api_port);
  const bool on_cuda = args.GetString("device").value_or("cpu") == "cuda";
  const bool has_threads =
      std::find(forwarded.begin(), forwarded.end(), "--threads") != forwarded.end();
  // Group sizes: --groups lists them; else --workers groups of --tp ranks each.
  std::vector<int32_t> groups;
  if (groups_flag) {
    if (workers_flag || tp_flag) {
      return absl::InvalidArgumentError("--groups: give it instead of --workers and --tp");
    }
    for (absl::string_view part : absl::StrSplit(*groups_flag, ',', absl::SkipWhitespace())) {
      int32_t size = 0;
      if (!absl::SimpleAtoi(part, &size)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--groups: '", std::string(part), "' is not a group size"));
      }
      groups.push_back(size);
    }
  } else {
    groups.assign(static_cast<size_t>(std::clamp<int64_t>(workers_flag.value_or(1), 0, 65)),
                  static_cast<int32_t>(tp_flag.value_or(1)));
  }
  // Context parallelism: C ranks of each group's size split the blocks; with --cp auto, a
  // group larger than the model's KV heads splits the heads over num_kv_heads ranks and the
  // blocks over the rest (ranks that would hold replicated heads).
  std::vector<int32_t> cps(groups.size(), 1);
  // auto is the default: only groups larger than the model's KV heads change, and only when
  // their config says how many heads there are (a GGUF file needs --cp C).
  const bool groups_exceed_one = std::any_of(groups.begin(), groups.end(),
                                             [](int32_t g) { return g > 1; });
  if (cp_flag.value_or("auto") == "auto" && (cp_flag || groups_exceed_one)) {
    absl::StatusOr<model::ModelConfig> config =
        dir.extension() == ".gguf"
            ? absl::StatusOr<model::ModelConfig>(
                  absl::InvalidArgumentError("give --cp C for a GGUF model"))
            : model::LoadModelConfig(dir);
    if (!config.ok() && cp_flag) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cp auto: needs the model's config.json: ", std::string(config.status().message())));
    }
    const int32_t kv = config.ok() ? static_cast<int32_t>(config->num_key_value_heads) : 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (kv > 0 && groups[g] > kv && groups[g] % kv == 0) {
        cps[g] = groups[g] / kv;
        groups[g] = kv;
        std::fprintf(stderr, "kvgrid serve: --cp auto: group %zu is %d x %d (tp x cp) for %d KV "
                     "heads: each rank holds 1/%d of the weights and 1/%d of each sequence's "
                     "blocks (--cp 1: tensor parallelism with replicated heads)\n", g,
                     groups[g], cps[g], kv, groups[g], cps[g]);
      } else if (kv > 0 && groups[g] > kv) {
        std::fprintf(stderr, "kvgrid serve: --cp auto: group %zu's %d ranks are not a multiple "
                     "of %d KV heads; it stays tensor-parallel, with replicated heads\n", g,
                     groups[g], kv);
      }
    }
  } else if (cp_flag) {
    int32_t cp = 0;
    if (!absl::SimpleAtoi(*cp_flag, &cp) || cp < 1 || cp > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cp: must be auto or in [1, 16], got '", *cp_flag, "'"));
    }
    cps.assign(groups.size(), cp);
  }
  int64_t processes = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int32_t size = groups[g];
    if (size < 1 || size > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tp/--groups: a group has 1 to 16 ranks, got ", size));
    }
    if (size * cps[g] > 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cp: a group has at most 16 ranks, got ", size, " x ", cps[g]));
    }
    processes += size * cps[g];
  }
  const int64_t workers = static_cast<int64_t>(groups.size());
  if (workers < 1 || workers > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--workers: must be in [1, 64], got ", workers));
  }
  const int64_t port = port_flag.value_or(50051);
  if (port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port: must be in [1, 65535], got ", port));
  }
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  int64_t http_port = http_port_flag.value_or(8000);
  if (http_port < 0 || http_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-port: must be in [0, 65535], got ", http_port));
  }
  // The default port taken (another server, another cluster): the cluster comes up without
  // the HTTP API rather than not at all; an explicit --http-port must be free.
  if (!http_port_flag && !PortFree(http_port)) {
    std::fprintf(stderr,
                 "kvgrid serve: port %lld is taken; the OpenAI HTTP API is off (give "
                 "--http-port)\n",
                 static_cast<long long>(http_port));
    http_port = 0;
  }
  const std::string http_addr = absl::StrCat("127.0.0.1:", http_port);
  const std::filesystem::path bin = SelfDir();

  // SIGINT/SIGTERM are taken with sigwait; children get them unblocked (Spawn).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::vector<pid_t> children;
  auto stop_all = [&children](int sig) {
    for (pid_t pid : children) kill(pid, sig);
  };
  auto wait_all = [&children](std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    std::vector<pid_t> left = children;
    while (!left.empty()) {
      std::erase_if(left, [](pid_t pid) { return waitpid(pid, nullptr, WNOHANG) != 0; });
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t pid : left) kill(pid, SIGKILL);
        for (pid_t pid : left) waitpid(pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  };
  std::vector<std::string> coordinator = {(bin / "kvgrid-coordinator").string(), "--model",
                                          dir.string(), "--listen", addr,
                                          "--worker-listen", worker_api};
  coordinator.insert(coordinator.end(), coordinator_flags.begin(), coordinator_flags.end());
  coordinator.insert(coordinator.end(), cluster_flags.begin(), cluster_flags.end());
  if (drain) coordinator.insert(coordinator.end(), {"--drain-timeout-s", *drain});
  if (http_port > 0) coordinator.insert(coordinator.end(), {"--http-listen", http_addr});
  if (chat_template) coordinator.insert(coordinator.end(), {"--chat-template", *chat_template});
  KVGRID_ASSIGN_OR_RETURN(pid_t cpid, Spawn(coordinator));
  children.push_back(cpid);
  const int64_t cores = std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN));
  int64_t slot = 0;  // the worker process's place on this machine: its card on cuda
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t ranks = int64_t{groups[g]} * cps[g];
    for (int64_t rank = 0; rank < ranks; ++rank) {
      std::vector<std::string> worker = {(bin / "kvgrid-worker").string(), "--model",
                                         dir.string(), "--coordinator", worker_api,
                                         "--listen", "127.0.0.1:0"};
      worker.insert(worker.end(), cluster_flags.begin(), cluster_flags.end());
      if (ranks > 1) {
        worker.insert(worker.end(), {"--group", absl::StrCat("g", g, "-", getpid()), "--rank",
                                     absl::StrCat(rank)});
        if (groups[g] > 1) {
          worker.insert(worker.end(), {"--tensor-parallel-size", absl::StrCat(groups[g])});
        }
        if (cps[g] > 1) {
          worker.insert(worker.end(), {"--context-parallel-size", absl::StrCat(cps[g])});
        }
      }
      if (drain) worker.insert(worker.end(), {"--drain-timeout-s", *drain});
      worker.insert(worker.end(), forwarded.begin(), forwarded.end());
      if (on_cuda) worker.insert(worker.end(), {"--cuda-device-slot", absl::StrCat(slot)});
      ++slot;
      if (!has_threads) {
        worker.insert(worker.end(),
                      {"--threads", absl::StrCat(std::max<int64_t>(1, cores / processes))});
      }
      absl::StatusOr<pid_t> wpid = Spawn(worker);
      if (!wpid.ok()) {
        stop_all(SIGTERM);
        wait_all(std::chrono::seconds(10));
        return wpid.status();
      }
      children.push_back(*wpid);
    }
  }

  // Readiness is asked of our own child on loopback: with TLS on the API port its certificate
  // is the user's (any CA, any name), so this one poll does not verify it.
  std::shared_ptr<grpc::ChannelCredentials> poll_credentials = grpc::InsecureChannelCredentials();
  if (api_tls) {
    grpc::experimental::TlsChannelCredentialsOptions options;
    options.set_verify_server_certs(false);
    options.set_check_call_host(false);
    options.set_certificate_verifier(
        std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
    poll_credentials = grpc::experimental::TlsCredentials(options);
  }
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(addr, poll_credentials));
  const auto ready_deadline = std::chrono::steady_clock::now() +
                              std::chrono::duration<double>(ready_timeout.value_or(120.0));
  bool ready = false;
  absl::Status failure;
  int signal = 0;
  const timespec poll = {0, 100'000'000};
  for (;;) {
    // A child that exits on its own: the coordinator ends the cluster; a worker is reported.
    for (size_t i = 0; i < children.size(); ++i) {
      int wstatus = 0;
      if (children[i] > 0 && waitpid(children[i], &wstatus, WNOHANG) == children[i]) {
        const std::string what = i == 0 ? "kvgrid-coordinator" : absl::StrCat("worker process ", i);
        const std::string how = WIFEXITED(wstatus)
                                    ? absl::StrCat("exit code ", WEXITSTATUS(wstatus))
                                    : absl::StrCat("signal ", WTERMSIG(wstatus));
        std::fprintf(stderr, "kvgrid serve: %s (pid %d) exited (%s)\n", what.c_str(),
                     children[i], how.c_str());
        children[i] = -children[i];  // reaped
        if (i == 0) failure = absl::InternalError("the coordinator exited");
        // Before the cluster is up, a worker that exits (a bad flag, a pool that cannot be
        // allocated) means it never will be: fail now, not at the ready timeout.
        if (i > 0 && !ready) {
          failure = absl::InternalError(absl::StrCat(what, " exited (", how, ") before the "
                                                     "cluster was ready; its log is above"));
        }
      }
    }
    if (!failure.ok()) break;
    if (!ready) {
      if (ServingWorkers(*stub, api_key) >= workers) {
        ready = true;
        std::fprintf(stderr,
                     "kvgrid serve: ready: %lld worker group(s) serving %s; API on %s (Ctrl-C stops)\n",
                     static_cast<long long>(workers), kvgrid::model::ServedModelName(dir).c_str(),
                     addr.c_str());
        if (http_port > 0) {
          std::fprintf(stderr, "kvgrid serve: OpenAI HTTP API on http://%s/v1\n",
                       http_addr.c_str());
        }
        std::printf("%s\n", addr.c_str());
        std::fflush(stdout);
      } else if (std::chrono::steady_clock::now() > ready_deadline) {
        failure = absl::DeadlineExceededError("the workers did not all come up in time");
        break;
      }
    }
    siginfo_t info;
    signal = sigtimedwait(&signals, &info, &poll);
    if (signal > 0) break;
  }
  std::erase_if(children, [](pid_t pid) { return pid <= 0; });
  std::fprintf(stderr, "kvgrid serve: stopping\n");
  stop_all(SIGTERM);
  // Running requests get the drain timeout the children were given, and the coordinator a few
  // seconds more to close its streams, before anything is killed.
  double drain_s = 30.0;
  if (drain && (!absl::SimpleAtod(*drain, &drain_s) || !std::isfinite(drain_s))) drain_s = 30.0;
  const auto drain_limit = static_cast<int64_t>(std::ceil(std::clamp(drain_s, 0.0, 86400.0)));
  wait_all(std::chrono::seconds(drain_limit + 20));
  return failure;
}

}  // namespace

int ServeCommand(Args& args) { return RunSubcommand(args, "serve", kHelp, Serve); }

}  // namespace kvgrid::cli
