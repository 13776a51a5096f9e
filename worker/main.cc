// kvgrid-worker: one engine (one device) behind the Worker gRPC service, registered with a
// coordinator. Runs until SIGTERM or SIGINT, then drains: refuses new requests, finishes
// running ones within --drain-timeout-s, and exits.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "auth/bearer_auth.h"
#include "auth/tls.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/openmp_wait.h"
#include "metrics/http_endpoint.h"
#include "model/model_config.h"
#include "model/special_tokens.h"
#include "model/status_macros.h"
#include "tools/kvgrid/args.h"
#include "tools/kvgrid/process.h"
#include "tools/kvgrid/model_setup.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/gloo_worker_group.h"
#include "worker/engine/step_plan.h"
#include "worker/executor/cpu_executor.h"
#include "worker/executor/cuda_plugin.h"
#include "worker/service/convert.h"
#include "worker/service/engine_loop.h"
#include "worker/service/registrar.h"
#include "worker/service/stall_watchdog.h"
#include "worker/service/worker_metrics.h"
#include "worker/service/worker_service.h"

namespace {

using kvgrid::cli::Args;

constexpr char kHelp[] =
    "usage: kvgrid-worker [--model DIR] [--coordinator HOST:PORT] [flags]\n"
    "\n"
    "Serves one model on this machine's CPU through the Worker gRPC API and registers with a\n"
    "coordinator. SIGTERM/SIGINT drain: no new requests, running ones finish, then exit.\n"
    "Every flag can also be given as an environment variable: --max-num-seqs as\n"
    "KVGRID_MAX_NUM_SEQS (the command line wins).\n"
    "\n"
    "  --model DIR                 model directory (default: $KVGRID_MODEL, else the embedded\n"
    "                              model)\n"
    "  --model-name NAME           name clients use (default: the directory's name)\n"
    "  --load-format auto|dummy    auto (default): the checkpoint's weights; dummy: random\n"
    "                              weights in config.json's shape, no checkpoint read (for\n"
    "                              benchmarks; the same every run). cuda makes them on the\n"
    "                              card, one rank only, in the dense --dtype\n"
    "  --coordinator HOST:PORT[,HOST:PORT...]\n"
    "                              coordinators to register with, each independently (none:\n"
    "                              serve standalone); a group forms through the first\n"
    "  --listen HOST:PORT          where to serve (default 127.0.0.1:0, any free port)\n"
    "  --advertise HOST:PORT       address the coordinator should call (default: the\n"
    "                              listening address)\n"
    "  --group ID                  worker group (default: the worker alone)\n"
    "  --drain-timeout-s S         how long running requests may take to finish (default 30)\n"
    "  --metrics-listen HOST:PORT  serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "  --health-listen HOST:PORT   also serve grpc.health.v1 in plaintext there (probes, when\n"
    "                              this worker's port uses TLS; a follower rank, which has no\n"
    "                              API port, answers its probes only there)\n"
    "  --cluster-token T | --cluster-token-file F\n"
    "                              shared secret of coordinator and workers: sent to the\n"
    "                              coordinator, and required of every caller of this worker;\n"
    "                              refused over plaintext unless --allow-insecure-cluster\n"
    "  --worker-tls-cert F --worker-tls-key F --worker-tls-ca F\n"
    "                              TLS between coordinator and workers (PEM): cert and key\n"
    "                              serve this worker's port and are the client certificate it\n"
    "                              presents to the coordinator; the CA verifies the\n"
    "                              coordinator when dialling it and, with cert and key,\n"
    "                              requires client certificates on this port (mTLS). The\n"
    "                              certificate must name the host of --advertise (or the\n"
    "                              coordinator's --worker-tls-server-name)\n"
    "  --worker-tls-server-name N  the name checked in the coordinator's certificate\n"
    "                              (default: the host of --coordinator)\n"
    "  --tls-refresh-s S           certificate files are re-read this often (default 60)\n"
    "  --allow-insecure-cluster    send and accept the cluster token over plaintext (warns)\n"
    "  --tensor-parallel-size N --rank R\n"
    "                              one of N ranks sharing the model (Megatron sharding over\n"
    "                              Gloo on cpu, NCCL on cuda); rank 0 serves and registers the\n"
    "                              group, the others follow it. Needs --coordinator and --group\n"
    "  --context-parallel-size C --rank R\n"
    "                              one of C ranks holding the whole model that split each\n"
    "                              sequence's KV blocks (block i on rank i mod C), so the group\n"
    "                              holds sequences C times as long. With\n"
    "                              --tensor-parallel-size T the group has T x C ranks (rank =\n"
    "                              cp_rank * T + tp_rank): each C ranks of one tp_rank hold its\n"
    "                              shard. Needs --coordinator and --group\n"
    "  --collective-timeout-s S    a group collective failing after S s (>= 2) breaks the group\n"
    "                              (default 30)\n"
    "  --stall-timeout-s S         an engine step running longer than S s while requests wait\n"
    "                              (a stuck kernel, a frozen group peer) turns the worker\n"
    "                              NOT_SERVING and ends its requests with UNAVAILABLE, so the\n"
    "                              coordinator moves them elsewhere; SERVING again once steps\n"
    "                              finish (default 120; 0: never)\n"
    "  --max-queue-depth N         requests that may wait beyond --max-num-seqs; more are\n"
    "                              refused with RESOURCE_EXHAUSTED (default 64; the bound that\n"
    "                              holds when several coordinators share this worker)\n"
    "  --threads N                 CPU threads for the kernels (default: every core; give\n"
    "                              each worker its share when several share a machine)\n"
    "  --device cpu|cuda           where the model runs (default cpu); cuda needs a build with\n"
    "                              CUDA\n"
    "  --cuda-device N             cuda: the device to use (default: the slot, else the rank,\n"
    "                              modulo the visible devices)\n"
    "  --cuda-device-slot K        cuda: this worker's place among the machine's workers (set\n"
    "                              by kvgrid serve), so that they spread over its cards\n"
    "  --gpu-memory-utilization F  cuda: share of the card's memory this worker may fill; the\n"
    "                              KV pool gets what the weights and a step workspace leave\n"
    "                              (default 0.9; --kv-cache-memory sets the pool instead)\n"
    "  --dtype auto|fp16|bf16|fp32 cuda: the dense weights' type (auto: the checkpoint's\n"
    "                              torch_dtype, fp16 when it is not bf16)\n"
    "  --cuda-graphs BOOL          cuda: replay decode steps of up to 256 sequences from CUDA\n"
    "                              graphs (default true; false runs every step kernel by\n"
    "                              kernel, as vLLM's --enforce-eager)\n"
    "  --kv-cache-memory BYTES     KV pool (e.g. 256MiB; default 256MiB on cpu)\n"
    "  --weight-dtype DT           fp32 (default), fp16, bf16, q8_0 or q4_0: hold the layers'\n"
    "                              weights so from load (16-bit: the embedding and head too)\n"
    "  --kv-cache-dtype DT         fp32|fp16|bf16|int8|int4|fp8_e4m3|auto (--k-cache-dtype,\n"
    "                              --v-cache-dtype override one; default fp32 on cpu, auto on\n"
    "                              cuda)\n"
    "  --block-size N --max-num-seqs N --max-num-batched-tokens N --max-model-len N\n"
    "  --swap-space BYTES --preemption-mode auto|swap|recompute --watermark F\n"
    "  --enable-prefix-caching BOOL\n";

// What a worker on a GPU needs besides the engine's options.
struct CudaFlags {
  kvgrid::worker::CreateCudaExecutorFn create = nullptr;  // null: the CPU
  std::string dense_dtype = "auto";
  double gpu_memory_utilization = 0.9;
  bool kv_memory_given = false;
  bool graphs = true;
  int device = -1;
  int device_slot = -1;
  double collective_timeout_s = 30.0;
  bool dummy_weights = false;  // --load-format dummy: random weights made on the card
};

// This rank's executor for `model` (its share of the weights): on the CPU, or on its GPU
// through the CUDA plugin (worker/executor/cuda_plugin.h), where the weights go to the device
// and the host copy is dropped.
absl::StatusOr<std::unique_ptr<kvgrid::worker::Executor>> ExecutorFor(
    const CudaFlags& cuda, std::unique_ptr<kvgrid::worker::LlamaModel> model,
    const kvgrid::worker::EngineOptions& options) {
  KVGRID_RETURN_IF_ERROR(kvgrid::worker::Engine::ValidateOptions(options, model->config()));
  if (cuda.create == nullptr) {
    return kvgrid::worker::CpuExecutor::Create(std::move(model),
                                               kvgrid::worker::CpuPoolOptions(options));
  }
  KVGRID_ASSIGN_OR_RETURN(
      std::unique_ptr<kvgrid::worker::Executor> executor,
      cuda.create(std::move(model),
                  {.dense_dtype = cuda.dense_dtype,
                   .pool = {.block_size = options.block_size,
                            .k_dtype = options.k_dtype,
                            .v_dtype = options.v_dtype,
                            .kv_cache_memory = cuda.kv_memory_given ? options.kv_cache_memory : 0,
                            .gpu_memory_utilization = cuda.gpu_memory_utilization,
                            .max_num_batched_tokens = options.max_num_batched_tokens,
                            .max_num_seqs = options.max_num_seqs,
                            .max_model_len = options.max_model_len,
                            .swap_space = options.swap_space,
                            .cuda_graphs = cuda.graphs},
                   .device = cuda.device,
                   .device_slot = cuda.device_slot,
                   .collective_timeout_s = cuda.collective_timeout_s,
                   .random_weights = cuda.dummy_weights,
                   .random_weights_seed = kvgrid::cli::kDummyWeightSeed}));
  return executor;  // the plugin said where it runs, its blocks and its graphs
}

// A plaintext gRPC server on `listen` that answers grpc.health.v1 only (Kubernetes' gRPC
// probes speak no TLS); every other method is UNIMPLEMENTED through `unimplemented`, since a
// server needs one service of its own besides the default health service. The overall
// status starts SERVING. Errors: UNAVAILABLE naming the flag when it cannot listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(
    const std::string& listen, grpc::CallbackGenericService* unimplemented) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder hb;
  hb.RegisterCallbackGenericService(unimplemented);
  int health_port = 0;
  hb.AddListeningPort(listen, grpc::InsecureServerCredentials(), &health_port);
  hb.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = hb.BuildAndStart();
  if (!server || health_port == 0) {
    return absl::UnavailableError(absl::StrCat("--health-listen: cannot listen on ", listen));
  }
  std::fprintf(stderr, "kvgrid-worker: health on port %d\n", health_port);
  return server;
}

// A follower rank (> 0) of a tensor-parallel group: holds its shard and pools and runs what
// the leader's engine broadcasts, until the leader stops it or the group breaks. SIGTERM
// waits up to the drain timeout for the leader to stop the group. With `health_listen`, it
// answers gRPC health there (SERVING while it follows, NOT_SERVING once told to stop), so
// each rank of a group has a probe of its own.
absl::Status Follow(std::unique_ptr<kvgrid::worker::LlamaModel> model,
                    kvgrid::worker::EngineOptions options,
                    const kvgrid::cli::KvDTypeFlags& kv_dtypes, const CudaFlags& cuda,
                    kvgrid::worker::Communicator& comm, const std::string& group,
                    double drain_timeout, const std::optional<std::string>& health_listen) {
  kv_dtypes.ApplyTo(model->config(), &options);
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<kvgrid::worker::Executor> executor,
                          ExecutorFor(cuda, std::move(model), options));
  grpc::CallbackGenericService unimplemented;
  std::unique_ptr<grpc::Server> health_server;
  if (health_listen) {
    KVGRID_ASSIGN_OR_RETURN(health_server, StartHealthServer(*health_listen, &unimplemented));
  }
  std::fprintf(stderr, "kvgrid-worker: rank %d of group %s following (%lld KV blocks)\n",
               comm.rank(), group.c_str(), static_cast<long long>(executor->num_blocks()));
  std::atomic<bool> done{false};
  absl::Status status;
  std::thread follower([&] {
    kvgrid::kernels::cpu::UseConfiguredThreads();
    status = kvgrid::worker::RunFollower(*executor, comm);
    done.store(true);
  });
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  const timespec poll = {0, 100'000'000};
  std::optional<std::chrono::steady_clock::time_point> deadline;
  while (!done.load()) {
    siginfo_t info;
    if (sigtimedwait(&signals, &info, &poll) > 0 && !deadline) {
      if (health_server) health_server->GetHealthCheckService()->SetServingStatus(false);
      deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(drain_timeout));
    }
    if (deadline && std::chrono::steady_clock::now() > *deadline) {
      std::fprintf(stderr, "kvgrid-worker: the leader did not stop the group in time\n");
      std::_Exit(1);  // the follower thread is blocked in a collective
    }
  }
  follower.join();
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  std::fprintf(stderr, "kvgrid-worker: rank %d stopped (%s)\n", comm.rank(),
               status.ok() ? "the leader stopped the group" : std::string(status.message()).c_str());
  return status;
}

absl::Status Serve(Args& args) {
  const std::filesystem::path dir = kvgrid::cli::ResolveModelDir(args);
  const std::optional<std::string> model_name = args.GetString("model-name");
  const std::optional<std::string> coordinator = args.GetString("coordinator");
  std::vector<std::string> coordinators;
  if (coordinator) {
    coordinators = absl::StrSplit(*coordinator, ',', absl::SkipWhitespace());
    for (std::string& c : coordinators) c = std::string(absl::StripAsciiWhitespace(c));
    if (coordinators.empty()) {
      return absl::InvalidArgumentError("--coordinator: no address given");
    }
  }
  const std::string listen = args.GetString("listen").value_or("127.0.0.1:0");
  const std::optional<std::string> advertise = args.GetString("advertise");
  const std::string group = args.GetString("group").value_or("");
  const std::optional<std::string> metrics_listen = args.GetString("metrics-listen");
  const std::optional<std::string> health_listen = args.GetString("health-listen");
  KVGRID_ASSIGN_OR_RETURN(auto drain_timeout, args.GetDouble("drain-timeout-s"));
  KVGRID_ASSIGN_OR_RETURN(auto threads, args.GetInt("threads"));
  KVGRID_ASSIGN_OR_RETURN(auto tp_size, args.GetInt("tensor-parallel-size"));
  KVGRID_ASSIGN_OR_RETURN(auto cp_size, args.GetInt("context-parallel-size"));
  KVGRID_ASSIGN_OR_RETURN(auto rank, args.GetInt("rank"));
  KVGRID_ASSIGN_OR_RETURN(auto collective_timeout, args.GetDouble("collective-timeout-s"));
  KVGRID_ASSIGN_OR_RETURN(auto stall_timeout, args.GetDouble("stall-timeout-s"));
  KVGRID_ASSIGN_OR_RETURN(auto max_queue_depth, args.GetInt("max-queue-depth"));
  KVGRID_ASSIGN_OR_RETURN(
      const std::string cluster_token,
      kvgrid::auth::ResolveToken(args.GetString("cluster-token-file"),
                                 args.GetString("cluster-token"), "cluster-token-file"));
  KVGRID_ASSIGN_OR_RETURN(auto tls_refresh, args.GetInt("tls-refresh-s"));
  const kvgrid::auth::ClusterTls cluster_tls{
      .files = {.cert = args.GetString("worker-tls-cert"),
                .key = args.GetString("worker-tls-key"),
                .ca = args.GetString("worker-tls-ca"),
                .flag_prefix = "worker-tls",
                .refresh_s = kvgrid::auth::TlsRefreshSeconds(tls_refresh)},
      .server_name = args.GetString("worker-tls-server-name")};
  KVGRID_ASSIGN_OR_RETURN(const bool allow_insecure_cluster,
                          args.GetBool("allow-insecure-cluster", false));
  const std::string device = args.GetString("device").value_or("cpu");
  KVGRID_ASSIGN_OR_RETURN(auto gpu_memory_utilization, args.GetDouble("gpu-memory-utilization"));
  const std::string dense_dtype = args.GetString("dtype").value_or("auto");
  KVGRID_ASSIGN_OR_RETURN(const bool cuda_graphs, args.GetBool("cuda-graphs", true));
  KVGRID_ASSIGN_OR_RETURN(auto cuda_device, args.GetInt("cuda-device"));
  KVGRID_ASSIGN_OR_RETURN(auto cuda_device_slot, args.GetInt("cuda-device-slot"));
  const bool kv_memory_given = args.Has("kv-cache-memory");
  const bool kv_dtype_given =
      args.Has("kv-cache-dtype") || args.Has("k-cache-dtype") || args.Has("v-cache-dtype");
  KVGRID_ASSIGN_OR_RETURN(kvgrid::worker::EngineOptions options,
                          kvgrid::cli::EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(kvgrid::cli::KvDTypeFlags kv_dtypes,
                          kvgrid::cli::KvDTypesFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const kvgrid::kernels::cpu::WeightDType weight_dtype,
                          kvgrid::cli::WeightDTypeFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const kvgrid::cli::LoadFormat load_format,
                          kvgrid::cli::LoadFormatFromArgs(args, device == "cuda"));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  KVGRID_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> server_credentials,
                          kvgrid::auth::ServerCredentials(cluster_tls.files));
  KVGRID_ASSIGN_OR_RETURN(kvgrid::auth::ClusterChannels coordinator_channels,
                          kvgrid::auth::ClusterChannels::ForClient(cluster_tls));
  {
    std::string plaintext_links;
    if (!cluster_tls.serves_tls()) plaintext_links = "this worker's port (no --worker-tls-cert)";
    if (coordinator && !coordinator_channels.tls()) {
      absl::StrAppend(&plaintext_links, plaintext_links.empty() ? "" : " and ",
                      "the channel to the coordinator (no --worker-tls-ca)");
    }
    KVGRID_RETURN_IF_ERROR(kvgrid::auth::CheckTokenTransport(
        "kvgrid-worker", cluster_token, plaintext_links, allow_insecure_cluster));
  }

  if (device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: must be cpu or cuda, got '", device, "'"));
  }
  if (dense_dtype != "auto" && dense_dtype != "fp16" && dense_dtype != "bf16" &&
      dense_dtype != "fp32") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype: must be auto, fp16, bf16 or fp32, got '", dense_dtype, "'"));
  }
  if (gpu_memory_utilization &&
      !(*gpu_memory_utilization > 0.0 && *gpu_memory_utilization <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu-memory-utilization: must be in (0, 1], got ", *gpu_memory_utilization));
  }
  if (cuda_device && (*cuda_device < 0 || *cuda_device > 1024)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda-device: must be in [0, 1024], got ", *cuda_device));
  }
  if (cuda_device_slot && (*cuda_device_slot < 0 || *cuda_device_slot > 1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda-device-slot: must be in [0, 2^20], got ", *cuda_device_slot));
  }
  if (device == "cuda" && !kv_dtype_given) kv_dtypes.k = kv_dtypes.v = std::nullopt;  // auto
  // An idle group's leader sends a keep-alive every second (worker/service/engine_loop.cc): a
  // shorter timeout would break every idle group.
  if (collective_timeout && !(*collective_timeout >= 2.0 && *collective_timeout <= 86400.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--collective-timeout-s: must be in [2, 86400] (idle groups exchange a keep-alive "
        "every second), got ", *collective_timeout));
  }
  if (max_queue_depth && (*max_queue_depth < 0 || *max_queue_depth > 1'000'000)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-queue-depth: must be in [0, 1000000], got ", *max_queue_depth));
  }
  if (stall_timeout && !(*stall_timeout == 0.0 ||
                        (*stall_timeout >= 0.1 && *stall_timeout <= 86400.0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--stall-timeout-s: must be 0 (never) or in [0.1, 86400], got ", *stall_timeout));
  }
  const int tp = static_cast<int>(tp_size.value_or(1));
  const int cp = static_cast<int>(cp_size.value_or(1));
  const bool dummy_on_card = load_format == kvgrid::cli::LoadFormat::kDummyOnDevice;
  if (dummy_on_card && tp * cp > 1) {
    return absl::UnimplementedError(
        "--load-format dummy: --device cuda makes the random weights of a whole model on one "
        "card; a tensor- or context-parallel group needs a checkpoint");
  }
  CudaFlags cuda{.dense_dtype = dense_dtype,
                 .gpu_memory_utilization = gpu_memory_utilization.value_or(0.9),
                 .kv_memory_given = kv_memory_given,
                 .graphs = cuda_graphs,
                 .device = static_cast<int>(cuda_device.value_or(-1)),
                 .device_slot = static_cast<int>(cuda_device_slot.value_or(-1)),
                 .collective_timeout_s = collective_timeout.value_or(30.0),
                 .dummy_weights = dummy_on_card};
  // Before the model is loaded: a missing plugin is reported at once.
  if (device == "cuda") {
    KVGRID_ASSIGN_OR_RETURN(cuda.create, kvgrid::worker::LoadCudaPlugin());
  }
  const int my_rank = static_cast<int>(rank.value_or(0));
  if (tp < 1 || tp > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tensor-parallel-size: must be in [1, 64], got ", tp));
  }
  if (cp < 1 || cp > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--context-parallel-size: must be in [1, 64], got ", cp));
  }
  const int group_size = tp * cp;
  if (my_rank < 0 || my_rank >= group_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank: must be in [0, ", group_size, "), got ", my_rank));
  }
  if (group_size > 1 && (!coordinator || group.empty())) {
    return absl::InvalidArgumentError(absl::StrCat(
        tp > 1 ? "--tensor-parallel-size" : "--context-parallel-size",
        ": a group forms through --coordinator and needs a --group id"));
  }
  if (threads) {
    if (*threads < 1 || *threads > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--threads: must be in [1, 1024], got ", *threads));
    }
    kvgrid::kernels::cpu::SetNumThreads(static_cast<int>(*threads));
  }
  // A tensor- or context-parallel group forms first: its ranks find each other through the
  // coordinator's store, then each loads only its shard (the whole model under context
  // parallelism).
  std::unique_ptr<kvgrid::worker::GlooWorkerGroup> comms;
  if (group_size > 1) {
    const std::string host = advertise ? advertise->substr(0, advertise->rfind(':'))
                                       : listen.substr(0, listen.rfind(':'));
    const auto timeout = std::chrono::milliseconds(
        static_cast<int64_t>(1000 * collective_timeout.value_or(30.0)));
    kvgrid::worker::CoordinatorStore store(coordinators.front(), cluster_token, group,
                                           std::chrono::milliseconds(120'000),
                                           coordinator_channels);
    std::fprintf(stderr, "kvgrid-worker: rank %d of group %s (size %d) joining\n", my_rank,
                 group.c_str(), group_size);
    KVGRID_ASSIGN_OR_RETURN(comms, kvgrid::worker::GlooWorkerGroup::Connect(
                                       my_rank, tp, cp, store, host == "0.0.0.0" ? "" : host,
                                       timeout));
  }
  kvgrid::worker::Communicator* comm = comms ? &comms->group() : nullptr;
  const kvgrid::worker::TensorParallel shard =
      tp > 1 ? kvgrid::worker::TensorParallel{.rank = comms->tp_rank(), .size = tp,
                                              .comm = comms->tp()}
             : kvgrid::worker::TensorParallel{};
  KVGRID_ASSIGN_OR_RETURN(kvgrid::cli::LoadedModel loaded,
                          kvgrid::cli::LoadModelDir(dir, shard, weight_dtype, load_format));
  if (cp > 1) {
    KVGRID_RETURN_IF_ERROR(loaded.model->SetContextParallel(
        {.rank = comms->cp_rank(), .size = cp, .comm = comms->cp()}));
  }
  if (my_rank > 0) {
    return Follow(std::move(loaded.model), options, kv_dtypes, cuda, *comm, group,
                  drain_timeout.value_or(30.0), health_listen);
  }
  options.group = comm;
  kv_dtypes.ApplyTo(loaded.model->config(), &options);
  options.eos_token_ids =
      kvgrid::model::ResolveEosTokenIds(loaded.generation, loaded.model->config());
  options.tokenizer = loaded.tokenizer.get();
  const int32_t vocab = static_cast<int32_t>(loaded.model->config().vocab_size);
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<kvgrid::worker::Executor> executor,
                          ExecutorFor(cuda, std::move(loaded.model), options));
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<kvgrid::worker::Engine> engine,
                          kvgrid::worker::Engine::Create(std::move(executor), options));
  const kvgrid::v1::KvCapacity capacity =
      kvgrid::worker::CapacityToProto(engine->Stats(), options, engine->max_model_len());
  // A step that fails UNAVAILABLE cannot be retried here: a group whose collectives broke, or
  // a card whose CUDA context is lost (a sticky error). Shut down, so the coordinator's
  // failover moves the requests and an orchestrator restarts the worker or its group.
  std::atomic<bool> cannot_step{false};
  kvgrid::worker::EngineLoop loop(std::move(engine), [&](const absl::Status& status) {
    if (status.code() != absl::StatusCode::kUnavailable) return;
    std::fprintf(stderr, "kvgrid-worker: %s (%s); shutting down\n",
                 group_size > 1 ? "the group is broken" : "this worker cannot run steps",
                 std::string(status.message()).c_str());
    cannot_step.store(true);
    kill(getpid(), SIGTERM);
  });
  const kvgrid::auth::BearerAuth cluster_auth =
      kvgrid::auth::BearerAuth::FromTokens({cluster_token});
  kvgrid::worker::WorkerService service(&loop, &cluster_auth, capacity,
                                        static_cast<int32_t>(options.max_num_seqs),
                                        max_queue_depth.value_or(64));
  const std::string name = model_name.value_or(kvgrid::model::ServedModelName(dir));
  kvgrid::metrics::Registry metrics;
  kvgrid::worker::AddEngineMetrics(&metrics, &loop, name);
  std::unique_ptr<kvgrid::metrics::HttpEndpoint> metrics_endpoint;
  if (metrics_listen) {
    KVGRID_ASSIGN_OR_RETURN(metrics_endpoint,
                            kvgrid::metrics::HttpEndpoint::Start(*metrics_listen, &metrics));
    std::fprintf(stderr, "kvgrid-worker: metrics on port %d (/metrics)\n",
                 metrics_endpoint->port());
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, server_credentials, &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(64 << 20);
  // The coordinator pings its streams to this worker about every heartbeat timeout to notice a
  // frozen worker (coordinator/registry.cc); gRPC's default policy would answer pings that
  // frequent on a quiet connection with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // gRPC sets SO_REUSEPORT by default: a second process on a taken port would then share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot listen on ", listen));
  }
  std::unique_ptr<grpc::Server> health_server;
  grpc::CallbackGenericService unimplemented;
  if (health_listen) {
    KVGRID_ASSIGN_OR_RETURN(health_server, StartHealthServer(*health_listen, &unimplemented));
  }
  // A stall turns both health services NOT_SERVING (and back once steps finish, unless the
  // worker is draining by then).
  std::unique_ptr<kvgrid::worker::StallWatchdog> watchdog;
  if (const double t = stall_timeout.value_or(120.0); t > 0) {
    watchdog = std::make_unique<kvgrid::worker::StallWatchdog>(
        &loop, absl::Seconds(t), [&](bool stalled) {
          service.SetStalled(stalled);
          const bool serving = !stalled && !service.draining();
          server->GetHealthCheckService()->SetServingStatus(serving);
          if (health_server) health_server->GetHealthCheckService()->SetServingStatus(serving);
        });
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  const std::string address = advertise.value_or(absl::StrCat(host, ":", port));
  std::fprintf(stderr, "kvgrid-worker: listening on %s (model %s, %d KV blocks of %lld tokens)\n",
               address.c_str(), name.c_str(), capacity.blocks_total(),
               static_cast<long long>(options.block_size));

  std::unique_ptr<kvgrid::worker::Registrar> registrar;
  if (coordinator) {
    kvgrid::v1::RegisterWorkerRequest reg;
    reg.set_address(address);
    reg.set_device("cpu");
    reg.set_model(name);
    reg.set_group_id(group);
    reg.set_rank(0);
    reg.set_group_size(static_cast<uint32_t>(group_size));
    *reg.mutable_capacity() = capacity;
    reg.set_vocab_size(vocab);
    reg.set_max_num_seqs(static_cast<int32_t>(options.max_num_seqs));
    reg.set_pid(getpid());
    registrar = std::make_unique<kvgrid::worker::Registrar>(
        coordinators, cluster_token, reg, [&loop] { return kvgrid::worker::UsageToProto(loop.Stats()); },
        [&service] { return service.draining(); }, coordinator_channels,
        [&service] { return service.stalled(); });
  }

  kvgrid::cli::WaitForShutdownSignal();

  std::fprintf(stderr, "kvgrid-worker: draining (%d requests running)\n",
               static_cast<int>(loop.NumActive()));
  service.SetDraining(true);
  server->GetHealthCheckService()->SetServingStatus(false);
  if (health_server) health_server->GetHealthCheckService()->SetServingStatus(false);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(drain_timeout.value_or(30.0));
  while (loop.NumActive() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (registrar) registrar->Stop();
  watchdog.reset();
  loop.Stop();  // fails whatever did not finish in time with UNAVAILABLE
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (health_server) health_server->Shutdown(std::chrono::system_clock::now());
  std::fprintf(stderr, "kvgrid-worker: stopped\n");
  if (cannot_step.load()) {
    return absl::UnavailableError(group_size > 1 ? "the worker group broke"
                                                 : "the worker could not run steps");
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  kvgrid::kernels::cpu::ChooseOpenMpWaitPolicy(argv);  // may start the program again
  return kvgrid::cli::ServiceMain(argc, argv, "worker", kHelp, Serve);
}
