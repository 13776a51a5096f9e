// Stalls: an engine step held inside its forward pass (a gated executor standing for a stuck
// kernel or a collective that never returns) shows as a growing EngineLoop::BusyFor;
// FailRunning ends the running and the queued requests at once while the step is stuck, and
// the engine frees their blocks once it comes back; the watchdog reports the stall after its
// timeout, ends whatever arrives while it lasts, and reports its end when steps finish again.
#include "worker/service/stall_watchdog.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/unit/worker_service/collector.h"
#include "worker/executor/cpu_executor.h"
#include "worker/service/engine_loop.h"

namespace kvgrid::worker {
namespace {

// Holds every Forward while closed.
class Gate {
 public:
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    closed_ = false;
  }
  void Pass() {
    absl::MutexLock lock(&mu_);
    ++waiting_;
    mu_.Await(absl::Condition(
        +[](Gate* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g->mu_) { return !g->closed_; }, this));
    --waiting_;
  }
  // Waits until a Forward is held at the gate.
  bool WaitHeld(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Gate* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g->mu_) { return g->waiting_ > 0; }, this),
        timeout);
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

class GatedExecutor final : public Executor {
 public:
  GatedExecutor(std::unique_ptr<Executor> inner, Gate* gate)
      : inner_(std::move(inner)), gate_(gate) {}
  const model::ModelConfig& config() const override { return inner_->config(); }
  const TensorParallel& tensor_parallel() const override { return inner_->tensor_parallel(); }
  const KvGeometry& kv_geometry() const override { return inner_->kv_geometry(); }
  int32_t num_blocks() const override { return inner_->num_blocks(); }
  int32_t num_swap_blocks() const override { return inner_->num_swap_blocks(); }
  absl::Status Forward(const ForwardBatch& batch, std::vector<float>* logits) override {
    gate_->Pass();
    return inner_->Forward(batch, logits);
  }
  absl::Status CopyBlocks(BlockCopyKind kind, std::span<const BlockCopy> copies) override {
    return inner_->CopyBlocks(kind, copies);
  }

 private:
  std::unique_ptr<Executor> inner_;
  Gate* gate_;
};

std::unique_ptr<Engine> MakeEngine(Gate* gate) {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny");
  EXPECT_TRUE(model.ok()) << model.status();
  EngineOptions options;
  auto cpu = CpuExecutor::Create(*std::move(model), CpuPoolOptions(options));
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  auto engine =
      Engine::Create(std::make_unique<GatedExecutor>(*std::move(cpu), gate), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

GenerationRequest Request(int i, int64_t max_new) {
  GenerationRequest r;
  r.id = absl::StrCat("r", i);
  for (int j = 0; j < 5 + i; ++j) r.prompt.push_back(10 + (j * 13 + i * 7) % 200);
  r.sampling.temperature = 0;
  r.stopping.max_new_tokens = max_new;
  r.stopping.ignore_eos = true;
  return r;
}

using ::kvgrid::worker::testing::Collector;

// Polls `done` for up to `timeout`.
template <typename F>
bool Eventually(F done, absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time end = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(EngineLoopStallTest, FailRunningEndsRequestsWhileTheStepIsStuck) {
  Gate gate;
  EngineLoop loop(MakeEngine(&gate));
  const int32_t total = loop.Stats().blocks_total;
  EXPECT_EQ(loop.BusyFor(), absl::ZeroDuration());  // idle: waiting for work

  auto running = std::make_shared<Collector>();
  loop.Submit(Request(1, 1000), running);
  ASSERT_TRUE(running->WaitTokens(2));
  gate.Close();
  ASSERT_TRUE(gate.WaitHeld(absl::Seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_GE(loop.BusyFor(), absl::Milliseconds(100));
  auto queued = std::make_shared<Collector>();
  loop.Submit(Request(2, 10), queued);  // never reaches the stuck engine
  EXPECT_EQ(loop.NumActive(), 2);

  EXPECT_EQ(loop.FailRunning(absl::UnavailableError("stalled")), 2);
  ASSERT_TRUE(running->WaitDone(absl::Seconds(1)));  // at once, the step still stuck
  ASSERT_TRUE(queued->WaitDone(absl::Seconds(1)));
  EXPECT_EQ(running->error().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(queued->error().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(loop.NumActive(), 0);
  const size_t tokens_at_failure = running->num_tokens();
  EXPECT_GT(loop.Stats().blocks_used, 0);  // the engine still holds the stuck sequence

  gate.Open();
  // The engine drops what FailRunning ended and goes idle: every block back, nothing more
  // reaches the ended sinks.
  ASSERT_TRUE(Eventually([&] {
    return loop.Stats().blocks_used == 0 && loop.BusyFor() == absl::ZeroDuration();
  }));
  EXPECT_EQ(loop.Stats().blocks_free, total);
  EXPECT_EQ(running->num_tokens(), tokens_at_failure);
  EXPECT_EQ(running->after_end(), 0);
  EXPECT_EQ(queued->after_end(), 0);

  // The loop serves on, and the freed id can be used again.
  auto again = std::make_shared<Collector>();
  loop.Submit(Request(1, 6), again);
  ASSERT_TRUE(again->WaitDone());
  EXPECT_TRUE(again->error().ok()) << again->error();
  EXPECT_EQ(again->num_tokens(), 6u);
}

TEST(StallWatchdogTest, ReportsTheStallEndsItsRequestsAndRecovers) {
  Gate gate;
  EngineLoop loop(MakeEngine(&gate));
  absl::Mutex mu;
  std::vector<bool> changes;
  StallWatchdog watchdog(
      &loop, absl::Milliseconds(300),
      [&](bool stalled) {
        absl::MutexLock lock(&mu);
        changes.push_back(stalled);
      },
      absl::Milliseconds(10));
  auto num_changes = [&] {
    absl::MutexLock lock(&mu);
    return changes.size();
  };

  // Steps that finish are progress, however many there are: no stall.
  auto quick = std::make_shared<Collector>();
  loop.Submit(Request(0, 40), quick);
  ASSERT_TRUE(quick->WaitDone());
  EXPECT_TRUE(quick->error().ok()) << quick->error();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // idle is no stall either
  EXPECT_EQ(num_changes(), 0u);
  EXPECT_FALSE(watchdog.stalled());

  auto stuck = std::make_shared<Collector>();
  loop.Submit(Request(1, 1000), stuck);
  ASSERT_TRUE(stuck->WaitTokens(1));
  gate.Close();
  const absl::Time closed = absl::Now();
  ASSERT_TRUE(stuck->WaitDone());
  const absl::Duration took = absl::Now() - closed;
  EXPECT_EQ(stuck->error().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(stuck->error().message().find("stalled"), std::string::npos) << stuck->error();
  EXPECT_GE(took, absl::Milliseconds(300));  // not before the timeout
  EXPECT_TRUE(watchdog.stalled());
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(changes, std::vector<bool>{true});
  }
  // What arrives during the stall ends too, instead of waiting behind the stuck step.
  auto late = std::make_shared<Collector>();
  loop.Submit(Request(2, 10), late);
  ASSERT_TRUE(late->WaitDone(absl::Seconds(5)));
  EXPECT_EQ(late->error().code(), absl::StatusCode::kUnavailable);

  gate.Open();
  ASSERT_TRUE(Eventually([&] { return num_changes() == 2; }));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(changes, (std::vector<bool>{true, false}));
  }
  EXPECT_FALSE(watchdog.stalled());
  ASSERT_TRUE(Eventually([&] { return loop.Stats().blocks_used == 0; }));
  auto after = std::make_shared<Collector>();
  loop.Submit(Request(3, 8), after);
  ASSERT_TRUE(after->WaitDone());
  EXPECT_TRUE(after->error().ok()) << after->error();
  EXPECT_EQ(after->num_tokens(), 8u);
  EXPECT_EQ(stuck->after_end(), 0);
}

}  // namespace
}  // namespace kvgrid::worker
