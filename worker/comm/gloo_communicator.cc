#include "worker/comm/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace kvgrid::worker {
namespace {

// Gloo reports failures (a peer closed the connection, a timeout) by throwing; they stop at
// this boundary.
template <typename F>
absl::Status Guard(const char* what, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("gloo ", what, ": ", e.what()));
  }
}

std::vector<char> Bytes(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

// The name of this attempt to form the group, agreed by every rank. Rank 0 picks a fresh one
// and publishes it as "attempt"; each follower acknowledges the one it reads
// ("ack/<attempt>/<rank>"), and again whenever it changes (a new rank 0 after a failed
// attempt); once all have acknowledged it, rank 0 announces "go/<attempt>". An attempt already
// announced when a follower first reads it is spent (its rank 0 announced without this
// process's ack), so the follower waits for the next one. No key is ever written twice but
// "attempt", so Gloo's write-once stores serve too. A follower waits up to `join_timeout` for
// an attempt it can take (its rank 0 may start later, or the coordinator); from its first
// acknowledgement the agreement takes at most `timeout`. Throws (Gloo's convention) when it
// fails.
std::string AgreeOnAttempt(int rank, int size, gloo::rendezvous::Store& store,
                           std::chrono::milliseconds timeout,
                           std::chrono::milliseconds join_timeout) {
  if (rank == 0) {
    std::random_device random;
    const std::string attempt = absl::StrCat(absl::Hex(random(), absl::kZeroPad8),
                                             absl::Hex(random(), absl::kZeroPad8));
    store.set("attempt", Bytes(attempt));
    std::vector<std::string> acks;
    for (int r = 1; r < size; ++r) acks.push_back(absl::StrCat("ack/", attempt, "/", r));
    store.wait(acks, timeout);
    store.set(absl::StrCat("go/", attempt), Bytes("1"));
    return attempt;
  }
  auto announced = [&store](const std::string& attempt, std::chrono::milliseconds wait) {
    try {
      store.wait({absl::StrCat("go/", attempt)}, wait);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  store.wait({"attempt"}, join_timeout);
  auto deadline = std::chrono::steady_clock::now() + std::max(join_timeout, timeout);
  std::string acked, spent;
  for (;;) {
    const std::vector<char> value = store.get("attempt");
    const std::string attempt(value.begin(), value.end());
    if (attempt != acked && attempt != spent) {
      if (announced(attempt, std::chrono::milliseconds(1))) {
        spent = attempt;
      } else {
        store.set(absl::StrCat("ack/", attempt, "/", rank), Bytes("1"));
        acked = attempt;
        deadline = std::chrono::steady_clock::now() + timeout;
      }
    }
    // Short waits, so that an attempt replaced meanwhile is noticed.
    if (!acked.empty() && announced(acked, std::chrono::milliseconds(200))) return acked;
    if (acked.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(absl::StrCat("rank ", rank, ": no attempt of rank 0 took this "
                                            "rank within ", timeout.count(), " ms"));
    }
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Connect(
    int rank, int size, gloo::rendezvous::Store& store, const std::string& hostname,
    std::chrono::milliseconds timeout, std::chrono::milliseconds join_timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: ", rank, " is not a rank of a group of ", size));
  }
  std::shared_ptr<gloo::rendezvous::Context> context;
  absl::Status s = Guard("rendezvous", [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    if (size == 1) {
      context->connectFullMesh(store, device);
      return;
    }
    gloo::rendezvous::PrefixStore attempt_store(
        absl::StrCat("attempt/", AgreeOnAttempt(rank, size, store, timeout, join_timeout)),
        store);
    context->connectFullMesh(attempt_store, device);
  });
  if (!s.ok()) return s;
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(std::move(context), rank, size, timeout));
}

absl::Status GlooCommunicator::AllReduceSum(std::span<float> data) {
  if (size_ == 1 || data.empty()) return absl::OkStatus();
  return Guard("allreduce", [&] {
    gloo::AllreduceOptions opts(context_);
    opts.setInput(data.data(), data.size());
    opts.setOutput(data.data(), data.size());
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    // The layers' all-reduces are small (tokens x hidden): bcube took 0.6 ms where the ring
    // took 1.1 ms for 256 floats between two ranks on loopback.
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::allreduce(opts);
  });
}

absl::Status GlooCommunicator::AllGather(std::span<const float> in, std::span<float> out) {
  if (out.size() != in.size() * static_cast<size_t>(size_)) {
    return absl::InvalidArgumentError("AllGather: out must hold size() * in.size() values");
  }
  if (size_ == 1) {
    std::copy(in.begin(), in.end(), out.begin());
    return absl::OkStatus();
  }
  return Guard("allgather", [&] {
    gloo::AllgatherOptions opts(context_);
    opts.setInput(const_cast<float*>(in.data()), in.size());
    opts.setOutput(out.data(), out.size());
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::allgather(opts);
  });
}

absl::Status GlooCommunicator::Broadcast(std::span<char> data, int root) {
  if (size_ == 1 || data.empty()) return absl::OkStatus();
  return Guard("broadcast", [&] {
    gloo::BroadcastOptions opts(context_);
    if (rank_ == root) opts.setInput(data.data(), data.size());
    opts.setOutput(data.data(), data.size());
    opts.setRoot(root);
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::broadcast(opts);
  });
}

absl::Status GlooCommunicator::Barrier() {
  if (size_ == 1) return absl::OkStatus();
  return Guard("barrier", [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag_++);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

}  // namespace kvgrid::worker
