#include "coordinator/registry.h"

#include <algorithm>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "coordinator/placement.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvgrid::coordinator {
namespace {

// Leading full prompt blocks remembered per placement, and entries kept per worker.
constexpr int64_t kAffinityBlocks = 32;
constexpr size_t kAffinityEntries = 8192;
// The least time a keep-alive ping on a worker channel may take to be answered.
constexpr int64_t kKeepAliveAckFloorMs = 5000;
// Lost workers are listed in ClusterStatus for a while, then forgotten.
constexpr absl::Duration kForgetLostAfter = absl::Minutes(5);

// Chained hash of each leading full block of `prompt` (at most kAffinityBlocks).
std::vector<uint64_t> BlockHashes(std::span<const int32_t> prompt, int64_t block_size) {
  std::vector<uint64_t> hashes;
  uint64_t h = 0x9e3779b97f4a7c15ull;
  const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(prompt.size()) / block_size,
                                           kAffinityBlocks);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = 0; i < block_size; ++i) {
      h ^= static_cast<uint32_t>(prompt[b * block_size + i]) + 0x9e3779b97f4a7c15ull + (h << 6) +
           (h >> 2);
    }
    hashes.push_back(h);
  }
  return hashes;
}

std::string NewEpoch() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrCat(absl::Hex(v & 0xffffffffffull, absl::kZeroPad10));
}

v1::WorkerState StateOf(bool live, bool lost, bool draining, bool stalled) {
  if (live) return v1::WORKER_STATE_SERVING;
  if (draining && !lost) return v1::WORKER_STATE_DRAINING;
  if (stalled && !lost) return v1::WORKER_STATE_STALLED;
  return v1::WORKER_STATE_LOST;
}

}  // namespace

WorkerRegistry::WorkerRegistry(RegistryOptions options)
    : options_(options), epoch_(options_.epoch.empty() ? NewEpoch() : options_.epoch) {}

void WorkerRegistry::MarkLostLocked(Entry& e) {
  e.lost = true;
  e.usage.Clear();
  e.blocks_promised = 0;
}

std::string WorkerRegistry::Register(const v1::RegisterWorkerRequest& request) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, e] : workers_) {
    if (e.info.address() == request.address()) MarkLostLocked(e);  // a restart at the same place
  }
  Entry e;
  e.id = absl::StrCat("w", next_id_++, "-", epoch_);
  e.info = request;
  if (e.info.group_id().empty()) e.info.set_group_id(e.id);
  // Streams to a worker that froze or dropped off the network while its TCP connection stays
  // up would otherwise wait forever: the coordinator only reads on them. Keep-alive pings
  // during calls, one per heartbeat timeout, break such a connection when a ping goes
  // unanswered for as long again, and at least kKeepAliveAckFloorMs (a busy machine may answer
  // late, and a broken connection fails every stream on it over); the relay then fails its
  // requests over. The worker's server accepts pings this frequent (kvgrid-worker sets no ping
  // strikes).
  grpc::ChannelArguments args;
  const int64_t interval_ms =
      std::clamp<int64_t>(absl::ToInt64Milliseconds(options_.heartbeat_timeout), 100, 60000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(interval_ms));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(std::max(interval_ms, kKeepAliveAckFloorMs)));
  // A server stream's client sends no data after its request: allow pings regardless.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  e.stub = v1::Worker::NewStub(options_.worker_channels.Create(request.address(), args));
  e.usage.set_blocks_free(request.capacity().blocks_total());
  e.last_heartbeat = absl::Now();
  const std::string id = e.id;
  workers_.emplace(id, std::move(e));
  return id;
}

bool WorkerRegistry::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end() || it->second.lost) return false;
  Entry& e = it->second;
  e.usage = request.usage();
  e.draining = request.draining();
  e.stalled = request.stalled();
  e.last_heartbeat = absl::Now();
  e.blocks_promised = 0;
  return true;
}

void WorkerRegistry::MarkLost(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) MarkLostLocked(it->second);
}

bool WorkerRegistry::ExpireStale() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  bool changed = false;
  for (auto it = workers_.begin(); it != workers_.end();) {
    Entry& e = it->second;
    if (!e.lost && now - e.last_heartbeat > options_.heartbeat_timeout) {
      MarkLostLocked(e);
      changed = true;
    }
    if (e.lost && e.in_flight == 0 && now - e.last_heartbeat > kForgetLostAfter) {
      workers_.erase(it++);
      continue;
    }
    ++it;
  }
  return changed;
}

bool WorkerRegistry::LiveLocked(const Entry& e) const {
  return !e.lost && !e.draining && !e.stalled;
}

absl::StatusOr<WorkerRegistry::Placement> WorkerRegistry::Place(
    const std::string& model, std::span<const int32_t> prompt, int64_t max_new_tokens,
    const absl::flat_hash_set<std::string>& exclude) {
  absl::MutexLock lock(&mu_);
  std::vector<Candidate> candidates;
  std::vector<Entry*> entries;
  for (auto& [id, e] : workers_) {
    if (e.info.model() != model || exclude.contains(id)) continue;
    const int64_t block_size = std::max(1, e.info.capacity().block_size());
    int64_t prefix = 0;
    for (uint64_t h : BlockHashes(prompt, block_size)) {
      if (!e.prefixes.contains(h)) break;
      ++prefix;
    }
    candidates.push_back(Candidate{
        .worker_id = id,
        .live = LiveLocked(e),
        .block_size = block_size,
        .blocks_total = e.info.capacity().blocks_total(),
        .blocks_free = std::max<int64_t>(0, e.usage.blocks_free() - e.blocks_promised),
        .max_model_len = e.info.capacity().max_model_len(),
        .in_flight = e.in_flight,
        .max_num_seqs = std::max(1, e.info.max_num_seqs()),
        .prefix_blocks = prefix,
        .kv_window = e.info.capacity().kv_window(),
        .prefill_chunk = e.info.capacity().max_num_batched_tokens(),
    });
    entries.push_back(&e);
  }
  if (candidates.empty()) {
    return absl::UnavailableError(absl::StrCat("no live worker serves model '", model, "'"));
  }
  absl::StatusOr<size_t> chosen = ChooseWorker(
      candidates, PlacementRequest{.prompt_tokens = static_cast<int64_t>(prompt.size()),
                                   .max_new_tokens = max_new_tokens,
                                   .max_queue_depth = options_.max_queue_depth});
  if (!chosen.ok()) return chosen.status();
  Entry& e = *entries[*chosen];
  const Candidate& c = candidates[*chosen];
  ++e.in_flight;
  e.blocks_promised += WorstCaseBlocks(c, {.prompt_tokens = static_cast<int64_t>(prompt.size()),
                                           .max_new_tokens = max_new_tokens});
  ++tick_;
  for (uint64_t h : BlockHashes(prompt, c.block_size)) e.prefixes[h] = tick_;
  if (e.prefixes.size() > kAffinityEntries) {
    // Keep the most recent half.
    std::vector<int64_t> ticks;
    ticks.reserve(e.prefixes.size());
    for (const auto& [h, t] : e.prefixes) ticks.push_back(t);
    std::nth_element(ticks.begin(), ticks.begin() + ticks.size() / 2, ticks.end());
    const int64_t cut = ticks[ticks.size() / 2];
    absl::erase_if(e.prefixes, [cut](const auto& kv) { return kv.second < cut; });
  }
  return Placement{e.id, e.stub};
}

void WorkerRegistry::Release(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end() && it->second.in_flight > 0) --it->second.in_flight;
}

int WorkerRegistry::NumLive(const std::string& model) const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, e] : workers_) {
    if (e.info.model() == model && LiveLocked(e)) ++n;
  }
  return n;
}

void WorkerRegistry::FillStatus(v1::ClusterStatusResponse* response) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::map<std::string, const Entry*> sorted;  // stable order for readers
  for (const auto& [id, e] : workers_) sorted[id] = &e;
  for (const auto& [id, e] : sorted) {
    v1::WorkerInfo* w = response->add_workers();
    w->set_worker_id(id);
    w->set_address(e->info.address());
    w->set_device(e->info.device());
    w->set_model(e->info.model());
    w->set_group_id(e->info.group_id());
    w->set_rank(e->info.rank());
    w->set_state(StateOf(LiveLocked(*e), e->lost, e->draining, e->stalled));
    *w->mutable_capacity() = e->info.capacity();
    *w->mutable_usage() = e->usage;
    w->set_in_flight(static_cast<int32_t>(e->in_flight));
    w->set_seconds_since_heartbeat(absl::ToDoubleSeconds(now - e->last_heartbeat));
    // One worker per group until tensor-parallel groups exist.
    v1::GroupInfo* g = response->add_groups();
    g->set_group_id(e->info.group_id());
    g->set_model(e->info.model());
    g->set_size(std::max<uint32_t>(1, e->info.group_size()));
    g->set_state(w->state());
    *g->mutable_capacity() = e->info.capacity();
    g->set_in_flight(w->in_flight());
    g->set_queue_depth(std::max(0, w->in_flight() - e->usage.num_running()));
  }
}

}  // namespace kvgrid::coordinator
