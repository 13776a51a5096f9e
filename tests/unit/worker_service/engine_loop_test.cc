// The engine loop: requests submitted from several threads get the outputs the engine gives
// them alone; refusals and aborts reach their sinks (an abort ends its sink with ABORTED,
// and one on behalf of another sink leaves the request alone); Stop fails what is left with
// UNAVAILABLE and frees every block.
#include "worker/service/engine_loop.h"

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/unit/worker_service/collector.h"

namespace kvgrid::worker {
namespace {

std::unique_ptr<Engine> MakeEngine() {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / "llama3-tiny");
  EXPECT_TRUE(model.ok()) << model.status();
  auto engine = Engine::Create(*std::move(model), EngineOptions{});
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

GenerationRequest Request(int i, int64_t max_new = 12) {
  GenerationRequest r;
  r.id = absl::StrCat("r", i);
  for (int j = 0; j < 4 + 3 * i; ++j) r.prompt.push_back(10 + (j * 13 + i * 7) % 200);
  r.sampling.temperature = 0;
  r.stopping.max_new_tokens = max_new;
  r.stopping.ignore_eos = true;
  return r;
}

using ::kvgrid::worker::testing::Collector;

TEST(EngineLoopTest, ConcurrentSubmissionsMatchTheEngineAlone) {
  std::map<std::string, std::vector<int32_t>> alone;
  for (int i = 0; i < 8; ++i) {
    auto engine = MakeEngine();
    ASSERT_TRUE(engine->AddRequest(Request(i)).ok());
    while (engine->HasWork()) {
      auto step = engine->Step();
      ASSERT_TRUE(step.ok());
      for (const TokenOutput& o : *step) alone[o.request_id].push_back(o.token_id);
    }
  }
  EngineLoop loop(MakeEngine());
  std::vector<std::shared_ptr<Collector>> sinks;
  for (int i = 0; i < 8; ++i) sinks.push_back(std::make_shared<Collector>());
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&loop, &sinks, i] { loop.Submit(Request(i), sinks[i]); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    sinks[i]->Wait();
    EXPECT_TRUE(sinks[i]->error().ok()) << sinks[i]->error();
    EXPECT_EQ(sinks[i]->tokens(), alone[absl::StrCat("r", i)]) << "request " << i;
  }
  // The loop counts a request done once the step that finished it is over.
  for (int i = 0; i < 500 && loop.NumActive() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(loop.NumActive(), 0);
  loop.Stop();
  EXPECT_EQ(loop.Stats().blocks_used, 0);
}

TEST(EngineLoopTest, RefusalsAbortsAndStop) {
  EngineLoop loop(MakeEngine());
  auto bad = std::make_shared<Collector>();
  GenerationRequest r = Request(0);
  r.sampling.top_p = 2.0;
  loop.Submit(r, bad);
  bad->Wait();
  EXPECT_EQ(bad->error().code(), absl::StatusCode::kInvalidArgument);

  auto dup_a = std::make_shared<Collector>();
  auto dup_b = std::make_shared<Collector>();
  loop.Submit(Request(1, 100000), dup_a);
  loop.Submit(Request(1, 100000), dup_b);  // same id while the first runs
  dup_b->Wait();
  EXPECT_EQ(dup_b->error().code(), absl::StatusCode::kInvalidArgument);
  // The refused duplicate's stream cancelling aborts on its own behalf: r1 belongs to dup_a
  // and keeps running.
  loop.Abort("r1", dup_b);
  loop.Abort("never-existed");
  const size_t before = dup_a->tokens().size();
  for (int i = 0; i < 500 && dup_a->tokens().size() < before + 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(dup_a->tokens().size(), before + 3);
  EXPECT_TRUE(dup_a->error().ok()) << dup_a->error();
  EXPECT_EQ(loop.NumActive(), 1);
  // An abort by id alone (Worker.Abort) ends r1's sink, which would otherwise wait forever.
  loop.Abort("r1");
  dup_a->Wait();
  EXPECT_EQ(dup_a->error().code(), absl::StatusCode::kAborted);
  // After the abort the loop holds nothing for r1 (its statistics follow the abort's drain).
  for (int i = 0; i < 200 && (loop.NumActive() > 0 || loop.Stats().blocks_used > 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(loop.NumActive(), 0);
  EXPECT_EQ(loop.Stats().blocks_used, 0);

  auto running = std::make_shared<Collector>();
  GenerationRequest long_request = Request(2, 100000);
  loop.Submit(long_request, running);
  loop.Stop();
  running->Wait();
  EXPECT_EQ(running->error().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(loop.Stats().blocks_used, 0);
  auto late = std::make_shared<Collector>();
  loop.Submit(Request(3), late);
  late->Wait();
  EXPECT_EQ(late->error().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvgrid::worker
