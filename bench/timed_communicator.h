// A Communicator that times every collective of the one it wraps, for benchmarks that report
// the share of a step spent in collectives (tp_bench, cp_bench). Not thread-safe: one rank's
// thread uses it.
#ifndef KVGRID_BENCH_TIMED_COMMUNICATOR_H_
#define KVGRID_BENCH_TIMED_COMMUNICATOR_H_

#include <chrono>
#include <span>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"

namespace kvgrid::bench {

class TimedCommunicator final : public worker::Communicator {
 public:
  explicit TimedCommunicator(worker::Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(std::span<float> d) override {
    return Time([&] { return inner_->AllReduceSum(d); });
  }
  absl::Status AllGather(std::span<const float> in, std::span<float> out) override {
    return Time([&] { return inner_->AllGather(in, out); });
  }
  absl::Status Broadcast(std::span<char> d, int root) override {
    return Time([&] { return inner_->Broadcast(d, root); });
  }
  absl::Status Barrier() override { return Time([&] { return inner_->Barrier(); }); }

  double seconds = 0;  // spent in collectives so far

 private:
  template <typename F>
  absl::Status Time(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = f();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }
  worker::Communicator* inner_;
};

}  // namespace kvgrid::bench

#endif  // KVGRID_BENCH_TIMED_COMMUNICATOR_H_
