// serve_bench: serving latency percentiles, throughput and relay cost of a kvgrid cluster,
// measured as a client of the public kvgrid.v1.Generation API (in the manner of vLLM's
// `vllm bench serve`).
//
// Cluster: --addr HOST:PORT benchmarks a running coordinator; without it the bench starts its
// own on loopback — kvgrid-coordinator and --workers kvgrid-worker processes from the
// directory of this executable — waits until ClusterStatus shows every worker SERVING, and
// stops them with SIGTERM at the end.
//
// Load run: --num-prompts requests, sent with Poisson arrivals at --request-rate (inf: all at
// once) and at most --max-concurrency in flight (a closed loop when the rate is inf). The
// concurrency bound defaults to a worker's --max-num-seqs: the coordinator answers
// RESOURCE_EXHAUSTED once a worker has max_num_seqs + --max-queue-depth requests, so an
// unbounded burst (--max-concurrency 0) of more than that fails the excess, where vLLM would
// queue it. Prompts are random token ids in the vocabulary; decoding is greedy with
// ignore_eos, so every request produces exactly its output length. Lengths:
//   random  input and output lengths uniform in [len * (1 - range), len * (1 + range)]
//   chat    a chat-like mix: input lengths lognormal with median 100 tokens (sigma 0.9, so
//           p90 ~ 316), output lengths lognormal with median 60 (sigma 0.7, p90 ~ 147,
//           capped at 256), input capped so that input + output fit the model's context
// Every figure is measured at the client from the send of the request:
//   TTFT  arrival of the first token
//   TPOT  per request, (e2e - TTFT) / (output tokens - 1), where e2e is the arrival of the
//         last token; requests with one output token have none
//   ITL   gaps between token arrivals, pooled over requests; a response carrying k > 1
//         coalesced tokens counts as one gap followed by k - 1 zero gaps
//
// Relay cost (after the load run unless --skip-relay-cost; alone with --relay-cost):
//   latency   one stream at a time, --relay-requests rounds of (16-token prompt, 32 output
//             tokens), each round sent three ways, interleaved: through the coordinator;
//             straight to a worker's kvgrid.v1.Worker/Generate (its address from
//             ClusterStatus); and to an Engine + EngineLoop inside this process (the model
//             from --model), timed from Submit to the sink's outputs. The differences of the
//             medians are the coordinator hop (coordinator - worker) and the whole service path
//             (coordinator - in-process). Each request follows --relay-pause-ms of quiet: the
//             OpenMP threads of the process that served the previous one spin for several ms
//             after its last step and would otherwise slow whichever process runs next.
//   capacity  --relay-streams concurrent streams of --relay-tokens tokens, --relay-rounds
//             times, through the coordinator; the coordinator process's CPU time
//             (utime + stime from /proc/<pid>/stat) over the run gives the tokens one
//             coordinator core relays per second. With --addr, pass --coordinator-pid for it.
//
//   build/bin/serve_bench [--json] [--addr HOST:PORT] [--dataset chat|random] [--help] [...]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/gemm.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "kvgrid/v1/worker.grpc.pb.h"
#include "model/special_tokens.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/args.h"
#include "tools/kvgrid/model_setup.h"
#include "tools/kvgrid/process.h"
#include "worker/engine/engine.h"
#include "worker/service/engine_loop.h"


namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = kvgrid::v1;

constexpr char kHelp[] =
    "usage: serve_bench [--addr HOST:PORT | --workers N] [load flags] [relay-cost flags] "
    "[--json]\n"
    "\n"
    "Cluster (default: a local one started from this executable's directory):\n"
    "  --addr HOST:PORT            benchmark a running coordinator instead\n"
    "  --model DIR                 model of the local cluster and of the in-process engine\n"
    "                              (default: the embedded models/kjv-tiny)\n"
    "  --served-model NAME         model name in requests (default: the cluster's only one)\n"
    "  --workers N                 local worker processes (default 1)\n"
    "  --max-num-seqs N            passed to each local worker (default 64)\n"
    "  --kv-cache-memory BYTES     passed to each local worker (default 256MiB)\n"
    "  --threads N                 kernel threads of each local worker and of the in-process\n"
    "                              engine (default: the cores divided among the workers)\n"
    "  --coordinator-pid PID       with --addr: the coordinator's pid, for its CPU time\n"
    "\n"
    "Load run:\n"
    "  --num-prompts N             requests (default 500)\n"
    "  --request-rate R            Poisson arrivals per second, or inf (default inf)\n"
    "  --max-concurrency C         requests in flight at most, 0 = unbounded (default 64)\n"
    "  --dataset chat|random       length distribution (default chat)\n"
    "  --input-len N --output-len N --range-ratio F   random dataset (default 256, 128, 0)\n"
    "  --seed S                    lengths, prompts and arrivals (default 0)\n"
    "  --request-timeout-s S       deadline per request (default 300)\n"
    "\n"
    "Relay cost:\n"
    "  --relay-cost                run only the relay-cost measurements\n"
    "  --skip-relay-cost           run only the load run\n"
    "  --relay-requests N          sequential rounds for the latency comparison (default 100)\n"
    "  --relay-pause-ms MS         idle time before each of those requests (default 10)\n"
    "  --relay-streams N --relay-tokens N --relay-rounds N   capacity run (default 64, 256, 3)\n"
    "\n"
    "  --json                      print one JSON object\n";

// ---------------------------------------------------------------------------------------
// Child processes of the local cluster. The signal handler stops them when the bench is
// interrupted, so no coordinator or worker outlives it.

constexpr int kMaxChildren = 65;
std::atomic<pid_t> g_children[kMaxChildren];

void StopChildrenAndExit(int sig) {
  for (auto& c : g_children) {
    const pid_t pid = c.load();
    if (pid > 0) kill(pid, SIGTERM);
  }
  _exit(128 + sig);
}

// A port on 127.0.0.1 that was free a moment ago. Errors: INTERNAL with errno's text.
absl::StatusOr<int> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("bind 127.0.0.1:0: ", std::strerror(err)));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

// CPU time (user + system) a process has used so far, from /proc/<pid>/stat.
// Errors: NOT_FOUND when the process is gone or unreadable.
absl::StatusOr<double> ProcessCpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!in || !std::getline(in, line)) {
    return absl::NotFoundError(absl::StrCat("/proc/", pid, "/stat: cannot read"));
  }
  // The command name (field 2) is in parentheses and may contain spaces; count from after it.
  const size_t close_paren = line.rfind(')');
  if (close_paren == std::string::npos) {
    return absl::NotFoundError(absl::StrCat("/proc/", pid, "/stat: unexpected format"));
  }
  std::istringstream fields(line.substr(close_paren + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  // After ")": field 3 (state) is index 0; utime is field 14, stime field 15.
  for (int i = 0; i <= 12 && fields >> field; ++i) {
    if (i == 11) utime = std::stoull(field);
    if (i == 12) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The coordinator and workers of a local cluster on loopback; the destructor stops them.
class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(
      const std::filesystem::path& model_dir, int workers,
      const std::vector<std::string>& worker_flags) {
    auto cluster = std::unique_ptr<LocalCluster>(new LocalCluster());
    KVGRID_ASSIGN_OR_RETURN(const int port, FreePort());
    cluster->addr_ = absl::StrCat("127.0.0.1:", port);
    const std::filesystem::path bin = kvgrid::cli::SelfDir();
    KVGRID_ASSIGN_OR_RETURN(const pid_t cpid,
                            kvgrid::cli::Spawn({(bin / "kvgrid-coordinator").string(), "--model",
                                   model_dir.string(), "--listen", cluster->addr_}));
    cluster->Track(cpid);
    for (int i = 0; i < workers; ++i) {
      std::vector<std::string> argv = {(bin / "kvgrid-worker").string(),
                                       "--model",
                                       model_dir.string(),
                                       "--coordinator",
                                       cluster->addr_,
                                       "--listen",
                                       "127.0.0.1:0"};
      argv.insert(argv.end(), worker_flags.begin(), worker_flags.end());
      KVGRID_ASSIGN_OR_RETURN(const pid_t wpid, kvgrid::cli::Spawn(argv));
      cluster->Track(wpid);
    }
    KVGRID_RETURN_IF_ERROR(cluster->WaitServing(workers, std::chrono::seconds(120)));
    return cluster;
  }

  ~LocalCluster() {
    for (pid_t pid : pids_) kill(pid, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    std::vector<pid_t> left = pids_;
    while (!left.empty()) {
      std::erase_if(left, [](pid_t pid) { return waitpid(pid, nullptr, WNOHANG) != 0; });
      if (Clock::now() > deadline) {
        for (pid_t pid : left) kill(pid, SIGKILL);
        for (pid_t pid : left) waitpid(pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (auto& c : g_children) c.store(0);
  }

  const std::string& addr() const { return addr_; }
  pid_t coordinator_pid() const { return pids_.front(); }
  std::vector<pid_t> worker_pids() const { return {pids_.begin() + 1, pids_.end()}; }

 private:
  LocalCluster() = default;

  void Track(pid_t pid) {
    pids_.push_back(pid);
    for (auto& c : g_children) {
      pid_t zero = 0;
      if (c.compare_exchange_strong(zero, pid)) break;
    }
  }

  // Errors: DEADLINE_EXCEEDED when the workers are not all SERVING in time; INTERNAL when a
  // child exits first.
  absl::Status WaitServing(int workers, std::chrono::seconds limit) {
    auto stub =
        v1::Generation::NewStub(grpc::CreateChannel(addr_, grpc::InsecureChannelCredentials()));
    const auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      for (pid_t pid : pids_) {
        if (waitpid(pid, nullptr, WNOHANG) == pid) {
          std::erase(pids_, pid);
          return absl::InternalError(absl::StrCat("local cluster: process ", pid, " exited"));
        }
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      v1::ClusterStatusResponse resp;
      if (stub->ClusterStatus(&ctx, v1::ClusterStatusRequest(), &resp).ok()) {
        int serving = 0;
        for (const v1::WorkerInfo& w : resp.workers()) {
          serving += w.state() == v1::WORKER_STATE_SERVING;
        }
        if (serving >= workers) return absl::OkStatus();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "local cluster: ", workers, " worker(s) not serving after ", limit.count(), " s"));
  }

  std::string addr_;
  std::vector<pid_t> pids_;  // the coordinator first
};

// ---------------------------------------------------------------------------------------
// Streams and their timings.

struct Chunk {
  Clock::time_point at;
  int32_t tokens;
};

// One request as the client saw it. Written by the call's callbacks only, read once the
// tracker counted it done.
struct Record {
  int32_t prompt_len = 0;
  int32_t output_len = 0;  // asked for
  Clock::time_point start;
  std::vector<Chunk> chunks;  // responses that carried tokens
  int64_t messages = 0;       // every response
  bool ok = false;
  std::string error;

  int64_t Tokens() const {
    int64_t n = 0;
    for (const Chunk& c : chunks) n += c.tokens;
    return n;
  }
};

// Counts calls in flight; waiters block until a slot frees or everything is done.
class Tracker {
 public:
  void Launched() {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
    peak_ = std::max(peak_, in_flight_);
  }
  void Done() {
    std::lock_guard<std::mutex> lock(mu_);
    --in_flight_;
    cv_.notify_all();
  }
  // Blocks while `limit` or more calls are in flight.
  void WaitBelow(int64_t limit) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_ < limit; });
  }
  void WaitIdle() { WaitBelow(1); }
  int64_t peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t in_flight_ = 0;
  int64_t peak_ = 0;
};

// One server-streaming Generate call (public API or a worker's), recording when each response
// arrives. Deletes itself when the call is over.
class StreamCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  StreamCall(Record* record, Tracker* tracker, double timeout_s)
      : record_(record), tracker_(tracker) {
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::duration<double>(timeout_s)));
  }

  void Start(v1::Generation::Stub* stub, v1::GenerateRequest request) {
    public_request_ = std::move(request);
    tracker_->Launched();
    record_->start = Clock::now();
    stub->async()->Generate(&ctx_, &public_request_, this);
    Begin();
  }
  void Start(v1::Worker::Stub* stub, v1::WorkerGenerateRequest request) {
    worker_request_ = std::move(request);
    tracker_->Launched();
    record_->start = Clock::now();
    stub->async()->Generate(&ctx_, &worker_request_, this);
    Begin();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    const Clock::time_point now = Clock::now();
    ++record_->messages;
    if (msg_.token_ids_size() > 0) record_->chunks.push_back({now, msg_.token_ids_size()});
    StartRead(&msg_);
  }
  void OnDone(const grpc::Status& status) override {
    record_->ok = status.ok();
    if (!status.ok()) {
      record_->error =
          absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                       ": ", status.error_message());
    }
    Tracker* tracker = tracker_;
    delete this;
    tracker->Done();
  }

 private:
  void Begin() {
    StartRead(&msg_);
    StartCall();
  }

  Record* record_;
  Tracker* tracker_;
  grpc::ClientContext ctx_;
  v1::GenerateRequest public_request_;
  v1::WorkerGenerateRequest worker_request_;
  v1::GenerateResponse msg_;
};

// An in-process request's outputs, timed on the engine loop's thread as the sink receives
// them (one token per output: nothing is coalesced in process).
class TimingSink final : public kvgrid::worker::OutputSink {
 public:
  TimingSink(Record* record, Tracker* tracker) : record_(record), tracker_(tracker) {}
  void OnOutput(kvgrid::worker::TokenOutput output) override {
    ++record_->messages;
    record_->chunks.push_back({Clock::now(), 1});
    if (output.finish != kvgrid::worker::FinishReason::kNone) {
      record_->ok = true;
      tracker_->Done();
    }
  }
  void OnError(absl::Status status) override {
    record_->error = std::string(status.message());
    tracker_->Done();
  }

 private:
  Record* record_;
  Tracker* tracker_;
};

// ---------------------------------------------------------------------------------------
// Statistics.

struct Dist {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
  int64_t count = 0;
};

// Percentiles with linear interpolation between closest ranks (numpy's default).
double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Dist Describe(std::vector<double> values) {
  Dist d;
  d.count = static_cast<int64_t>(values.size());
  if (values.empty()) return d;
  std::sort(values.begin(), values.end());
  double sum = 0;
  for (double v : values) sum += v;
  d.mean = sum / static_cast<double>(values.size());
  d.p50 = Percentile(values, 50);
  d.p90 = Percentile(values, 90);
  d.p99 = Percentile(values, 99);
  return d;
}

nlohmann::json DistJson(const Dist& d) {
  return {{"mean", d.mean}, {"p50", d.p50}, {"p90", d.p90}, {"p99", d.p99}};
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Per-request TTFT, TPOT, e2e and the pooled ITL, in ms, over the completed records.
struct Latencies {
  std::vector<double> ttft, tpot, itl, e2e;
};

Latencies Collect(const std::vector<Record>& records) {
  Latencies l;
  for (const Record& r : records) {
    if (!r.ok || r.chunks.empty()) continue;
    const double ttft = Ms(r.chunks.front().at - r.start);
    const double e2e = Ms(r.chunks.back().at - r.start);
    l.ttft.push_back(ttft);
    l.e2e.push_back(e2e);
    const int64_t tokens = r.Tokens();
    if (tokens > 1) l.tpot.push_back((e2e - ttft) / static_cast<double>(tokens - 1));
    for (int32_t k = 1; k < r.chunks.front().tokens; ++k) l.itl.push_back(0);
    for (size_t i = 1; i < r.chunks.size(); ++i) {
      l.itl.push_back(Ms(r.chunks[i].at - r.chunks[i - 1].at));
      for (int32_t k = 1; k < r.chunks[i].tokens; ++k) l.itl.push_back(0);
    }
  }
  return l;
}

// ---------------------------------------------------------------------------------------
// Options and workload.

struct Options {
  std::optional<std::string> addr;
  std::filesystem::path model_dir;
  std::string served_model;
  int workers = 1;
  int64_t max_num_seqs = 64;  // local workers and the in-process engine
  std::string kv_cache_memory = "256MiB";
  int64_t threads = 0;  // 0: the cores divided among the workers
  std::optional<pid_t> coordinator_pid;
  int64_t num_prompts = 500;
  double request_rate = std::numeric_limits<double>::infinity();
  int64_t max_concurrency = 64;
  std::string dataset = "chat";
  int64_t input_len = 256, output_len = 128;
  double range_ratio = 0;
  uint64_t seed = 0;
  double request_timeout_s = 300;
  bool load = true, relay = true;
  int64_t relay_requests = 100;
  double relay_pause_ms = 10;
  int64_t relay_streams = 64, relay_tokens = 256, relay_rounds = 3;
  bool json = false;
};

absl::StatusOr<Options> ParseOptions(kvgrid::cli::Args& args) {
  Options o;
  o.addr = args.GetString("addr");
  o.model_dir = args.GetString("model").value_or(
      (std::filesystem::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny").string());
  o.served_model = args.GetString("served-model").value_or("");
  KVGRID_ASSIGN_OR_RETURN(auto workers, args.GetInt("workers"));
  KVGRID_ASSIGN_OR_RETURN(auto max_num_seqs, args.GetInt("max-num-seqs"));
  o.kv_cache_memory = args.GetString("kv-cache-memory").value_or(o.kv_cache_memory);
  KVGRID_ASSIGN_OR_RETURN(auto threads, args.GetInt("threads"));
  KVGRID_ASSIGN_OR_RETURN(auto cpid, args.GetInt("coordinator-pid"));
  KVGRID_ASSIGN_OR_RETURN(auto num_prompts, args.GetInt("num-prompts"));
  const std::optional<std::string> rate = args.GetString("request-rate");
  KVGRID_ASSIGN_OR_RETURN(auto max_concurrency, args.GetInt("max-concurrency"));
  o.dataset = args.GetString("dataset").value_or("chat");
  KVGRID_ASSIGN_OR_RETURN(auto input_len, args.GetInt("input-len"));
  KVGRID_ASSIGN_OR_RETURN(auto output_len, args.GetInt("output-len"));
  KVGRID_ASSIGN_OR_RETURN(auto range_ratio, args.GetDouble("range-ratio"));
  KVGRID_ASSIGN_OR_RETURN(auto seed, args.GetInt("seed"));
  KVGRID_ASSIGN_OR_RETURN(auto timeout, args.GetDouble("request-timeout-s"));
  KVGRID_ASSIGN_OR_RETURN(const bool relay_only, args.GetBool("relay-cost", false));
  KVGRID_ASSIGN_OR_RETURN(const bool skip_relay, args.GetBool("skip-relay-cost", false));
  KVGRID_ASSIGN_OR_RETURN(auto relay_requests, args.GetInt("relay-requests"));
  KVGRID_ASSIGN_OR_RETURN(auto relay_pause, args.GetDouble("relay-pause-ms"));
  KVGRID_ASSIGN_OR_RETURN(auto relay_streams, args.GetInt("relay-streams"));
  KVGRID_ASSIGN_OR_RETURN(auto relay_tokens, args.GetInt("relay-tokens"));
  KVGRID_ASSIGN_OR_RETURN(auto relay_rounds, args.GetInt("relay-rounds"));
  KVGRID_ASSIGN_OR_RETURN(o.json, args.GetBool("json", false));
  KVGRID_RETURN_IF_ERROR(args.Finish());

  auto positive = [](const char* flag, int64_t v) -> absl::Status {
    if (v < 1) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": must be >= 1"));
    return absl::OkStatus();
  };
  if (workers) {
    if (*workers < 1 || *workers >= kMaxChildren) {
      return absl::InvalidArgumentError(
          absl::StrCat("--workers: must be in [1, ", kMaxChildren - 1, "]"));
    }
    o.workers = static_cast<int>(*workers);
  }
  if (max_num_seqs) {
    KVGRID_RETURN_IF_ERROR(positive("max-num-seqs", *max_num_seqs));
    o.max_num_seqs = *max_num_seqs;
  }
  KVGRID_RETURN_IF_ERROR(kvgrid::cli::ParseBytes(o.kv_cache_memory, "kv-cache-memory").status());
  if (threads) {
    KVGRID_RETURN_IF_ERROR(positive("threads", *threads));
    o.threads = *threads;
  } else {
    o.threads = std::max<int64_t>(1, sysconf(_SC_NPROCESSORS_ONLN) / o.workers);
  }
  if (cpid) o.coordinator_pid = static_cast<pid_t>(*cpid);
  if (num_prompts) {
    KVGRID_RETURN_IF_ERROR(positive("num-prompts", *num_prompts));
    o.num_prompts = *num_prompts;
  }
  if (rate && *rate != "inf") {
    char* end = nullptr;
    o.request_rate = std::strtod(rate->c_str(), &end);
    if (end == rate->c_str() || *end != '\0' || !(o.request_rate > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--request-rate: want a number > 0 or inf, got '", *rate, "'"));
    }
  }
  if (max_concurrency) {
    if (*max_concurrency < 0) {
      return absl::InvalidArgumentError("--max-concurrency: must be >= 0 (0: unbounded)");
    }
    o.max_concurrency = *max_concurrency;
  }
  if (o.dataset != "chat" && o.dataset != "random") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset: want chat or random, got '", o.dataset, "'"));
  }
  if (input_len) {
    KVGRID_RETURN_IF_ERROR(positive("input-len", *input_len));
    o.input_len = *input_len;
  }
  if (output_len) {
    KVGRID_RETURN_IF_ERROR(positive("output-len", *output_len));
    o.output_len = *output_len;
  }
  if (range_ratio) {
    if (*range_ratio < 0 || *range_ratio >= 1) {
      return absl::InvalidArgumentError("--range-ratio: must be in [0, 1)");
    }
    o.range_ratio = *range_ratio;
  }
  if (seed) o.seed = static_cast<uint64_t>(*seed);
  if (timeout) {
    if (!(*timeout > 0)) return absl::InvalidArgumentError("--request-timeout-s: must be > 0");
    o.request_timeout_s = *timeout;
  }
  if (relay_only && skip_relay) {
    return absl::InvalidArgumentError("--relay-cost and --skip-relay-cost exclude each other");
  }
  o.load = !relay_only;
  o.relay = !skip_relay;
  if (relay_requests) {
    KVGRID_RETURN_IF_ERROR(positive("relay-requests", *relay_requests));
    o.relay_requests = *relay_requests;
  }
  if (relay_pause) {
    if (!(*relay_pause >= 0)) return absl::InvalidArgumentError("--relay-pause-ms: must be >= 0");
    o.relay_pause_ms = *relay_pause;
  }
  if (relay_streams) {
    KVGRID_RETURN_IF_ERROR(positive("relay-streams", *relay_streams));
    o.relay_streams = *relay_streams;
  }
  if (relay_tokens) {
    KVGRID_RETURN_IF_ERROR(positive("relay-tokens", *relay_tokens));
    o.relay_tokens = *relay_tokens;
  }
  if (relay_rounds) {
    KVGRID_RETURN_IF_ERROR(positive("relay-rounds", *relay_rounds));
    o.relay_rounds = *relay_rounds;
  }
  return o;
}

struct RequestSpec {
  std::vector<int32_t> prompt;
  int32_t output_len = 0;
};

std::vector<int32_t> RandomPrompt(int64_t len, int32_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(len));
  for (int32_t& id : ids) id = token(rng);
  return ids;
}

// Errors: INVALID_ARGUMENT when the random dataset's longest request exceeds the context.
absl::StatusOr<std::vector<RequestSpec>> MakeWorkload(const Options& o, int32_t vocab,
                                                      int32_t max_model_len, std::mt19937_64& rng) {
  std::vector<RequestSpec> specs(static_cast<size_t>(o.num_prompts));
  if (o.dataset == "random") {
    const auto lo = [&](int64_t len) {
      return std::max<int64_t>(1, static_cast<int64_t>(len * (1 - o.range_ratio)));
    };
    const auto hi = [&](int64_t len) { return static_cast<int64_t>(len * (1 + o.range_ratio)); };
    if (hi(o.input_len) + hi(o.output_len) > max_model_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--input-len/--output-len/--range-ratio: up to ", hi(o.input_len), " + ",
          hi(o.output_len), " tokens do not fit the model's context of ", max_model_len));
    }
    std::uniform_int_distribution<int64_t> in(lo(o.input_len), hi(o.input_len));
    std::uniform_int_distribution<int64_t> out(lo(o.output_len), hi(o.output_len));
    for (RequestSpec& s : specs) {
      const int64_t n_in = in(rng);
      s.output_len = static_cast<int32_t>(out(rng));
      s.prompt = RandomPrompt(n_in, vocab, rng);
    }
  } else {
    std::lognormal_distribution<double> in(std::log(100.0), 0.9);
    std::lognormal_distribution<double> out(std::log(60.0), 0.7);
    const int64_t max_out = std::min<int64_t>(256, max_model_len / 2);
    for (RequestSpec& s : specs) {
      const int64_t n_out = std::clamp<int64_t>(std::llround(out(rng)), 1, max_out);
      const int64_t n_in = std::clamp<int64_t>(std::llround(in(rng)), 1, max_model_len - n_out);
      s.output_len = static_cast<int32_t>(n_out);
      s.prompt = RandomPrompt(n_in, vocab, rng);
    }
  }
  return specs;
}

// Greedy, EOS ignored, so the output has exactly `output_len` tokens.
void FillParams(int32_t output_len, v1::SamplingParams* sampling, v1::StoppingParams* stopping) {
  sampling->set_temperature(0.f);
  sampling->set_top_p(1.f);
  stopping->set_max_new_tokens(output_len);
  stopping->set_ignore_eos(true);
}

v1::GenerateRequest PublicRequest(const Options& o, const RequestSpec& spec) {
  v1::GenerateRequest req;
  req.set_model(o.served_model);
  req.mutable_prompt_token_ids()->Assign(spec.prompt.begin(), spec.prompt.end());
  FillParams(spec.output_len, req.mutable_sampling(), req.mutable_stopping());
  return req;
}

// ---------------------------------------------------------------------------------------
// The load run.

struct LoadResult {
  int64_t completed = 0, failed = 0, length_mismatches = 0;
  int64_t input_tokens = 0, output_tokens = 0, messages = 0;
  double duration_s = 0;
  int64_t peak_concurrency = 0;
  Dist ttft, tpot, itl, e2e;
  std::map<std::string, int64_t> errors;  // message -> count
  std::optional<double> coordinator_cpu_s;
};

LoadResult RunLoad(const Options& o, v1::Generation::Stub* stub,
                   const std::vector<RequestSpec>& specs, std::mt19937_64& rng,
                   std::optional<pid_t> coordinator_pid) {
  // Arrival offsets: exponential inter-arrival times at the request rate (Poisson process).
  std::vector<double> arrival_s(specs.size(), 0.0);
  if (std::isfinite(o.request_rate)) {
    std::exponential_distribution<double> gap(o.request_rate);
    double t = 0;
    for (double& a : arrival_s) {
      a = t;
      t += gap(rng);
    }
  }
  std::vector<Record> records(specs.size());
  Tracker tracker;
  const int64_t limit =
      o.max_concurrency > 0 ? o.max_concurrency : std::numeric_limits<int64_t>::max();
  std::optional<double> cpu0;
  if (coordinator_pid) {
    if (auto c = ProcessCpuSeconds(*coordinator_pid); c.ok()) cpu0 = *c;
  }
  const Clock::time_point t0 = Clock::now();
  for (size_t i = 0; i < specs.size(); ++i) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(arrival_s[i])));
    tracker.WaitBelow(limit);
    records[i].prompt_len = static_cast<int32_t>(specs[i].prompt.size());
    records[i].output_len = specs[i].output_len;
    auto* call = new StreamCall(&records[i], &tracker, o.request_timeout_s);
    call->Start(stub, PublicRequest(o, specs[i]));
  }
  tracker.WaitIdle();
  LoadResult r;
  r.duration_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (cpu0) {
    if (auto c = ProcessCpuSeconds(*coordinator_pid); c.ok()) r.coordinator_cpu_s = *c - *cpu0;
  }
  r.peak_concurrency = tracker.peak();
  for (const Record& rec : records) {
    r.messages += rec.messages;
    if (!rec.ok) {
      ++r.failed;
      ++r.errors[rec.error];
      continue;
    }
    ++r.completed;
    r.input_tokens += rec.prompt_len;
    r.output_tokens += rec.Tokens();
    r.length_mismatches += rec.Tokens() != rec.output_len;
  }
  Latencies l = Collect(records);
  r.ttft = Describe(std::move(l.ttft));
  r.tpot = Describe(std::move(l.tpot));
  r.itl = Describe(std::move(l.itl));
  r.e2e = Describe(std::move(l.e2e));
  return r;
}

nlohmann::json LoadJson(const LoadResult& r) {
  nlohmann::json j = {{"completed", r.completed},
                      {"failed", r.failed},
                      {"output_length_mismatches", r.length_mismatches},
                      {"duration_s", r.duration_s},
                      {"total_input_tokens", r.input_tokens},
                      {"total_output_tokens", r.output_tokens},
                      {"request_throughput", r.completed / r.duration_s},
                      {"output_token_throughput", r.output_tokens / r.duration_s},
                      {"total_token_throughput", (r.input_tokens + r.output_tokens) / r.duration_s},
                      {"peak_concurrency", r.peak_concurrency},
                      {"responses", r.messages},
                      {"ttft_ms", DistJson(r.ttft)},
                      {"tpot_ms", DistJson(r.tpot)},
                      {"itl_ms", DistJson(r.itl)},
                      {"e2el_ms", DistJson(r.e2e)},
                      {"errors", r.errors}};
  if (r.coordinator_cpu_s) j["coordinator_cpu_s"] = *r.coordinator_cpu_s;
  return j;
}

void PrintLoad(const Options& o, const std::string& target, const LoadResult& r) {
  auto line = [](const char* name, double v) { std::printf("%-42s %12.2f\n", name, v); };
  auto count = [](const char* name, int64_t v) {
    std::printf("%-42s %12lld\n", name, static_cast<long long>(v));
  };
  auto section = [&](const char* title, const char* abbrev, const Dist& d) {
    std::printf("%s\n", title);
    std::printf("%-42s %12.2f\n", absl::StrCat("Mean ", abbrev, " (ms):").c_str(), d.mean);
    std::printf("%-42s %12.2f\n", absl::StrCat("Median ", abbrev, " (ms):").c_str(), d.p50);
    std::printf("%-42s %12.2f\n", absl::StrCat("P90 ", abbrev, " (ms):").c_str(), d.p90);
    std::printf("%-42s %12.2f\n", absl::StrCat("P99 ", abbrev, " (ms):").c_str(), d.p99);
  };
  std::printf("============== Serving Benchmark Result ==============\n");
  std::printf("%-42s %12s\n", "Target:", target.c_str());
  std::printf("%-42s %12s\n", "Dataset:", o.dataset.c_str());
  if (std::isfinite(o.request_rate)) {
    line("Request rate (req/s, Poisson):", o.request_rate);
  } else {
    std::printf("%-42s %12s\n", "Request rate (req/s):", "inf");
  }
  if (o.max_concurrency > 0) {
    count("Max request concurrency:", o.max_concurrency);
  } else {
    std::printf("%-42s %12s\n", "Max request concurrency:", "unbounded");
  }
  count("Successful requests:", r.completed);
  count("Failed requests:", r.failed);
  for (const auto& [error, n] : r.errors) {
    std::printf("  %lld x %s\n", static_cast<long long>(n), error.c_str());
  }
  if (r.length_mismatches > 0) count("Outputs of another length than asked:", r.length_mismatches);
  line("Benchmark duration (s):", r.duration_s);
  count("Total input tokens:", r.input_tokens);
  count("Total generated tokens:", r.output_tokens);
  line("Request throughput (req/s):", r.completed / r.duration_s);
  line("Output token throughput (tok/s):", r.output_tokens / r.duration_s);
  line("Total token throughput (tok/s):", (r.input_tokens + r.output_tokens) / r.duration_s);
  count("Peak concurrent requests:", r.peak_concurrency);
  line("Tokens per response:",
       r.messages > 0 ? static_cast<double>(r.output_tokens) / r.messages : 0.0);
  if (r.coordinator_cpu_s) line("Coordinator CPU (s):", *r.coordinator_cpu_s);
  section("----------------- Time to First Token ----------------", "TTFT", r.ttft);
  section("------- Time per Output Token (excl. 1st token) ------", "TPOT", r.tpot);
  section("----------------- Inter-token Latency ----------------", "ITL", r.itl);
  section("----------------- End-to-end Latency -----------------", "E2EL", r.e2e);
  std::printf("======================================================\n");
}

// ---------------------------------------------------------------------------------------
// Relay cost.

constexpr int32_t kRelayPromptLen = 16;
constexpr int32_t kRelayOutputLen = 32;

struct PathLatency {
  std::string name;
  std::vector<Record> records;
  Dist ttft, itl, tpot;
  int64_t failed = 0;
  std::string error;

  void Summarize() {
    for (const Record& r : records) {
      if (!r.ok && ++failed == 1) error = r.error;
    }
    Latencies l = Collect(records);
    ttft = Describe(std::move(l.ttft));
    itl = Describe(std::move(l.itl));
    tpot = Describe(std::move(l.tpot));
  }
};

// Median over rounds of (TTFT through `a` - TTFT through `b`) for the same round: less
// sensitive to drift in the machine's load than the difference of the two medians.
double PairedTtftDiffP50(const PathLatency& a, const PathLatency& b) {
  std::vector<double> d;
  for (size_t i = 0; i < a.records.size() && i < b.records.size(); ++i) {
    const Record& x = a.records[i];
    const Record& y = b.records[i];
    if (!x.ok || !y.ok || x.chunks.empty() || y.chunks.empty()) continue;
    d.push_back(Ms(x.chunks.front().at - x.start) - Ms(y.chunks.front().at - y.start));
  }
  return Describe(std::move(d)).p50;
}

struct InProcess {
  std::unique_ptr<kvgrid::model::Tokenizer> tokenizer;  // outlives the engine
  std::unique_ptr<kvgrid::worker::EngineLoop> loop;
};

// The worker's engine, built the way kvgrid-worker builds it with the local cluster's flags
// (fp32 KV, detokenizing, the model's EOS ids), so the three paths run the same engine work.
absl::StatusOr<InProcess> StartInProcess(const Options& o) {
  KVGRID_ASSIGN_OR_RETURN(kvgrid::cli::LoadedModel loaded, kvgrid::cli::LoadModelDir(o.model_dir));
  kvgrid::worker::EngineOptions options;
  options.max_num_seqs = o.max_num_seqs;
  KVGRID_ASSIGN_OR_RETURN(options.kv_cache_memory,
                          kvgrid::cli::ParseBytes(o.kv_cache_memory, "kv-cache-memory"));
  options.eos_token_ids =
      kvgrid::model::ResolveEosTokenIds(loaded.generation, loaded.model->config());
  options.tokenizer = loaded.tokenizer.get();
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<kvgrid::worker::Engine> engine,
                          kvgrid::worker::Engine::Create(std::move(loaded.model), options));
  // Applied by the engine loop's thread when it starts.
  kvgrid::kernels::cpu::SetNumThreads(static_cast<int>(o.threads));
  InProcess p;
  p.tokenizer = std::move(loaded.tokenizer);
  p.loop = std::make_unique<kvgrid::worker::EngineLoop>(std::move(engine));
  return p;
}

struct Capacity {
  int64_t tokens = 0, messages = 0, failed = 0;
  double wall_s = 0;
  std::optional<double> coordinator_cpu_s;
  std::optional<double> worker_cpu_s;  // all local workers together
  double client_cpu_s = 0;
};

struct RelayResult {
  std::vector<PathLatency> paths;  // coordinator, worker, in-process (those that ran)
  std::string skipped;             // why a path did not run
  Capacity capacity;
};

RelayResult RunRelayCost(const Options& o, v1::Generation::Stub* stub, int32_t vocab,
                         std::optional<pid_t> coordinator_pid,
                         const std::vector<pid_t>& worker_pids, std::mt19937_64& rng) {
  RelayResult result;
  // (a) Latency, one stream at a time, the paths interleaved round by round so that drift in
  // the machine's load affects them alike. Every request has a fresh random prompt: no path
  // gets prefix-cache hits.
  std::unique_ptr<v1::Worker::Stub> worker;
  {
    grpc::ClientContext ctx;
    v1::ClusterStatusResponse status;
    if (stub->ClusterStatus(&ctx, v1::ClusterStatusRequest(), &status).ok()) {
      for (const v1::WorkerInfo& w : status.workers()) {
        if (w.state() == v1::WORKER_STATE_SERVING) {
          worker = v1::Worker::NewStub(
              grpc::CreateChannel(w.address(), grpc::InsecureChannelCredentials()));
          break;
        }
      }
    }
    if (!worker) result.skipped += "worker direct: no serving worker in ClusterStatus. ";
  }
  absl::StatusOr<InProcess> in_process = StartInProcess(o);
  if (!in_process.ok()) {
    result.skipped += absl::StrCat("in-process: ", in_process.status().message(), ". ");
  }
  PathLatency coord, direct, local;
  coord.name = "coordinator";
  direct.name = "worker direct";
  local.name = "in-process";
  const size_t n = static_cast<size_t>(o.relay_requests);
  coord.records.resize(n);
  direct.records.resize(n);
  local.records.resize(n);
  Tracker tracker;
  // A quiet moment before each request: compute threads of the process that ran the last one
  // (OpenMP spin-waits after each parallel region) would otherwise still hold the cores.
  const auto settle = [&] {
    tracker.WaitIdle();
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.relay_pause_ms));
  };
  for (size_t i = 0; i < n; ++i) {
    RequestSpec spec{RandomPrompt(kRelayPromptLen, vocab, rng), kRelayOutputLen};
    (new StreamCall(&coord.records[i], &tracker, o.request_timeout_s))
        ->Start(stub, PublicRequest(o, spec));
    settle();
    if (worker) {
      spec.prompt = RandomPrompt(kRelayPromptLen, vocab, rng);
      v1::WorkerGenerateRequest req;
      req.set_request_id(absl::StrCat("serve-bench-direct-", i));
      req.mutable_prompt_token_ids()->Assign(spec.prompt.begin(), spec.prompt.end());
      FillParams(spec.output_len, req.mutable_sampling(), req.mutable_stopping());
      req.set_n(1);
      (new StreamCall(&direct.records[i], &tracker, o.request_timeout_s))
          ->Start(worker.get(), std::move(req));
      settle();
    }
    if (in_process.ok()) {
      kvgrid::worker::GenerationRequest req;
      req.id = absl::StrCat("serve-bench-local-", i);
      req.prompt = RandomPrompt(kRelayPromptLen, vocab, rng);
      req.sampling.temperature = 0;
      req.stopping.max_new_tokens = kRelayOutputLen;
      req.stopping.ignore_eos = true;
      Record* rec = &local.records[i];
      tracker.Launched();
      rec->start = Clock::now();
      in_process->loop->Submit(std::move(req), std::make_shared<TimingSink>(rec, &tracker));
      settle();
    }
  }
  coord.Summarize();
  result.paths.push_back(std::move(coord));
  if (worker) {
    direct.Summarize();
    result.paths.push_back(std::move(direct));
  }
  if (in_process.ok()) {
    in_process->loop->Stop();
    local.Summarize();
    result.paths.push_back(std::move(local));
    in_process->loop.reset();
  }

  // (b) Capacity: many concurrent streams through the coordinator, its CPU time over the run.
  Capacity& c = result.capacity;
  std::optional<double> coord0;
  if (coordinator_pid) {
    if (auto v = ProcessCpuSeconds(*coordinator_pid); v.ok()) coord0 = *v;
  }
  auto workers_cpu = [&] {
    double s = 0;
    for (pid_t pid : worker_pids) {
      if (auto v = ProcessCpuSeconds(pid); v.ok()) s += *v;
    }
    return s;
  };
  const double worker0 = workers_cpu();
  const double client0 = ProcessCpuSeconds(getpid()).value_or(0);
  const Clock::time_point t0 = Clock::now();
  for (int64_t round = 0; round < o.relay_rounds; ++round) {
    std::vector<Record> records(static_cast<size_t>(o.relay_streams));
    for (Record& rec : records) {
      RequestSpec spec{RandomPrompt(kRelayPromptLen, vocab, rng),
                       static_cast<int32_t>(o.relay_tokens)};
      (new StreamCall(&rec, &tracker, o.request_timeout_s))->Start(stub, PublicRequest(o, spec));
    }
    tracker.WaitIdle();
    for (const Record& rec : records) {
      c.tokens += rec.Tokens();
      c.messages += rec.messages;
      c.failed += !rec.ok;
    }
  }
  c.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (coord0) {
    if (auto v = ProcessCpuSeconds(*coordinator_pid); v.ok()) c.coordinator_cpu_s = *v - *coord0;
  }
  if (!worker_pids.empty()) c.worker_cpu_s = workers_cpu() - worker0;
  c.client_cpu_s = ProcessCpuSeconds(getpid()).value_or(0) - client0;
  return result;
}

nlohmann::json RelayJson(const Options& o, const RelayResult& r) {
  nlohmann::json paths = nlohmann::json::object();
  for (const PathLatency& p : r.paths) {
    paths[p.name] = {{"requests", p.records.size()},
                     {"failed", p.failed},
                     {"ttft_ms", DistJson(p.ttft)},
                     {"itl_ms", DistJson(p.itl)},
                     {"tpot_ms", DistJson(p.tpot)}};
    if (p.failed > 0) paths[p.name]["first_error"] = p.error;
  }
  nlohmann::json latency = {{"requests", o.relay_requests},
                            {"prompt_tokens", kRelayPromptLen},
                            {"output_tokens", kRelayOutputLen},
                            {"paths", paths}};
  auto diff = [&](size_t other) {
    const PathLatency& c = r.paths[0];
    const PathLatency& x = r.paths[other];
    return nlohmann::json{{"against", x.name},
                          {"ttft_p50_ms", c.ttft.p50 - x.ttft.p50},
                          {"ttft_paired_p50_ms", PairedTtftDiffP50(c, x)},
                          {"itl_p50_ms", c.itl.p50 - x.itl.p50},
                          {"tpot_p50_ms", c.tpot.p50 - x.tpot.p50}};
  };
  for (size_t i = 1; i < r.paths.size(); ++i) {
    latency[r.paths[i].name == "worker direct" ? "coordinator_hop" : "service_path"] = diff(i);
  }
  if (!r.skipped.empty()) latency["skipped"] = r.skipped;
  const Capacity& c = r.capacity;
  nlohmann::json capacity = {
      {"streams", o.relay_streams},
      {"tokens_per_stream", o.relay_tokens},
      {"rounds", o.relay_rounds},
      {"failed", c.failed},
      {"tokens", c.tokens},
      {"responses", c.messages},
      {"tokens_per_response", c.messages > 0 ? static_cast<double>(c.tokens) / c.messages : 0.0},
      {"wall_s", c.wall_s},
      {"tokens_per_s", c.tokens / c.wall_s},
      {"client_cpu_s", c.client_cpu_s}};
  if (c.worker_cpu_s) capacity["worker_cpu_s"] = *c.worker_cpu_s;
  if (c.coordinator_cpu_s) {
    capacity["coordinator_cpu_s"] = *c.coordinator_cpu_s;
    capacity["tokens_per_coordinator_cpu_s"] =
        *c.coordinator_cpu_s > 0 ? c.tokens / *c.coordinator_cpu_s : 0.0;
  }
  return {{"latency", latency}, {"capacity", capacity}};
}

void PrintRelay(const Options& o, const RelayResult& r) {
  std::printf("===================== Relay cost =====================\n");
  std::printf("One stream at a time: %lld rounds, %d-token prompts, %d output tokens\n",
              static_cast<long long>(o.relay_requests), kRelayPromptLen, kRelayOutputLen);
  std::printf("%-34s %9s %9s %9s %9s\n", "path (ms)", "TTFT p50", "TTFT p90", "ITL p50",
              "TPOT p50");
  for (const PathLatency& p : r.paths) {
    std::printf("%-34s %9.3f %9.3f %9.3f %9.3f", p.name.c_str(), p.ttft.p50, p.ttft.p90, p.itl.p50,
                p.tpot.p50);
    if (p.failed > 0)
      std::printf("  (%lld failed: %s)", static_cast<long long>(p.failed), p.error.c_str());
    std::printf("\n");
  }
  for (size_t i = 1; i < r.paths.size(); ++i) {
    const PathLatency& c = r.paths[0];
    const PathLatency& x = r.paths[i];
    const std::string label = absl::StrCat(
        x.name == "worker direct" ? "coordinator hop" : "service path", " (- ", x.name, ")");
    std::printf("%-34s %+9.3f %9s %+9.3f %+9.3f\n", label.c_str(), c.ttft.p50 - x.ttft.p50, "",
                c.itl.p50 - x.itl.p50, c.tpot.p50 - x.tpot.p50);
    std::printf("%-34s %+9.3f\n", "  median of per-round TTFT diffs", PairedTtftDiffP50(c, x));
  }
  if (!r.skipped.empty()) std::printf("skipped: %s\n", r.skipped.c_str());
  const Capacity& c = r.capacity;
  std::printf("Capacity: %lld streams x %lld tokens x %lld rounds through the coordinator\n",
              static_cast<long long>(o.relay_streams), static_cast<long long>(o.relay_tokens),
              static_cast<long long>(o.relay_rounds));
  std::printf("%-42s %12lld\n", "Tokens streamed:", static_cast<long long>(c.tokens));
  if (c.failed > 0)
    std::printf("%-42s %12lld\n", "Failed streams:", static_cast<long long>(c.failed));
  std::printf("%-42s %12.2f\n", "Wall time (s):", c.wall_s);
  std::printf("%-42s %12.0f\n", "Tokens/s:", c.tokens / c.wall_s);
  std::printf("%-42s %12lld\n", "Responses to the client:", static_cast<long long>(c.messages));
  std::printf("%-42s %12.2f\n", "Tokens per response:",
              c.messages > 0 ? static_cast<double>(c.tokens) / c.messages : 0.0);
  if (c.coordinator_cpu_s) {
    std::printf("%-42s %12.3f\n", "Coordinator CPU (s):", *c.coordinator_cpu_s);
    std::printf("%-42s %12.0f\n", "Tokens per coordinator CPU-second:",
                *c.coordinator_cpu_s > 0 ? c.tokens / *c.coordinator_cpu_s : 0.0);
  } else {
    std::printf("Coordinator CPU: unknown (pass --coordinator-pid with --addr)\n");
  }
  if (c.worker_cpu_s) std::printf("%-42s %12.3f\n", "Worker CPU (s):", *c.worker_cpu_s);
  std::printf("%-42s %12.3f\n", "Bench client CPU (s):", c.client_cpu_s);
  std::printf("======================================================\n");
}

// ---------------------------------------------------------------------------------------

absl::Status Run(const Options& o) {
  std::unique_ptr<LocalCluster> cluster;
  std::string addr;
  std::optional<pid_t> coordinator_pid = o.coordinator_pid;
  std::vector<pid_t> worker_pids;
  if (o.addr) {
    addr = *o.addr;
  } else {
    const std::vector<std::string> worker_flags = {
        "--max-num-seqs", std::to_string(o.max_num_seqs), "--kv-cache-memory", o.kv_cache_memory,
        "--threads",      std::to_string(o.threads)};
    KVGRID_ASSIGN_OR_RETURN(cluster, LocalCluster::Start(o.model_dir, o.workers, worker_flags));
    addr = cluster->addr();
    coordinator_pid = cluster->coordinator_pid();
    worker_pids = cluster->worker_pids();
  }
  auto stub =
      v1::Generation::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));

  int32_t vocab = 0, max_model_len = 0;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListModelsResponse models;
    const grpc::Status s = stub->ListModels(&ctx, v1::ListModelsRequest(), &models);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat(addr, ": ListModels: ", s.error_message()));
    }
    for (const v1::ModelInfo& m : models.models()) {
      if (o.served_model.empty() || m.id() == o.served_model) {
        vocab = m.vocab_size();
        max_model_len = m.max_model_len();
        break;
      }
    }
    if (vocab <= 0) {
      return absl::NotFoundError(absl::StrCat(addr, ": model '", o.served_model,
                                              "' is not served (or the cluster serves none)"));
    }
  }

  std::mt19937_64 rng(o.seed);
  nlohmann::json out = {{"target", addr},
                        {"model_dir", o.model_dir.string()},
                        {"workers", o.addr ? nlohmann::json(nullptr) : nlohmann::json(o.workers)}};
  if (o.load) {
    KVGRID_ASSIGN_OR_RETURN(std::vector<RequestSpec> specs,
                            MakeWorkload(o, vocab, max_model_len, rng));
    // One request first, not counted: connections and the worker's first-step costs.
    {
      Tracker tracker;
      Record warm;
      (new StreamCall(&warm, &tracker, o.request_timeout_s))
          ->Start(stub.get(), PublicRequest(o, {RandomPrompt(16, vocab, rng), 8}));
      tracker.WaitIdle();
      if (!warm.ok) return absl::UnavailableError(absl::StrCat("warm-up request: ", warm.error));
    }
    const LoadResult load = RunLoad(o, stub.get(), specs, rng, coordinator_pid);
    out["load"] = LoadJson(load);
    out["load"]["config"] = {
        {"dataset", o.dataset},
        {"num_prompts", o.num_prompts},
        {"request_rate",
         std::isfinite(o.request_rate) ? nlohmann::json(o.request_rate) : nlohmann::json("inf")},
        {"max_concurrency", o.max_concurrency},
        {"seed", o.seed}};
    if (o.dataset == "random") {
      out["load"]["config"]["input_len"] = o.input_len;
      out["load"]["config"]["output_len"] = o.output_len;
      out["load"]["config"]["range_ratio"] = o.range_ratio;
    }
    if (!o.json) {
      PrintLoad(o,
                o.addr ? addr
                       : absl::StrCat(addr, " (", o.workers, " local worker",
                                      o.workers > 1 ? "s" : "", ")"),
                load);
    }
  }
  if (o.relay) {
    const RelayResult relay = RunRelayCost(o, stub.get(), vocab, coordinator_pid, worker_pids, rng);
    out["relay_cost"] = RelayJson(o, relay);
    if (!o.json) PrintRelay(o, relay);
  }
  if (o.json) std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  struct sigaction sa {};
  sa.sa_handler = StopChildrenAndExit;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  auto args = kvgrid::cli::Args::Parse(argc, argv, 1);
  if (!args.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  if (args->Has("help")) {
    std::printf("%s", kHelp);
    return 0;
  }
  absl::StatusOr<Options> options = ParseOptions(*args);
  if (!options.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n%s", std::string(options.status().message()).c_str(),
                 kHelp);
    return 2;
  }
  const absl::Status status = Run(*options);
  if (!status.ok()) {
    std::fprintf(stderr, "serve_bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
