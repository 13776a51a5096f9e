// The engine on a sliding-window model (mistral-window-tiny: a 24-token window on every
// layer): a long generation keeps the pool's used blocks bounded by the window while a
// full-attention model's grow with the sequence, and freeing out-of-window blocks changes no
// output under chunked prefill, batching, preemption (swap and recompute), the prefix cache,
// parallel sampling and resumption; every block comes back.
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/engine/engine.h"

namespace kvgrid::worker {
namespace {

constexpr char kWindowModel[] = "mistral-window-tiny";
constexpr char kFullModel[] = "llama3-tiny";
constexpr int64_t kWindow = 24;

std::unique_ptr<Engine> MakeEngine(const std::string& fixture, EngineOptions options = {}) {
  auto model = LlamaModel::Load(std::filesystem::path(KVGRID_FIXTURES_DIR) / fixture);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  auto engine = Engine::Create(*std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

std::vector<int32_t> Prompt(int64_t n, int32_t seed) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) {
    p.push_back(100 + static_cast<int32_t>((i * 37 + seed * 11) % 5000));
  }
  return p;
}

GenerationRequest Request(const std::string& id, std::vector<int32_t> prompt, int64_t max_new,
                          double temperature = 0.0, std::optional<uint64_t> seed = std::nullopt) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.sampling.top_k = 20;  // sampling over the whole 128K vocabulary is the slow part
  r.stopping.max_new_tokens = max_new;
  r.stopping.ignore_eos = true;
  return r;
}

struct Outcome {
  std::map<std::string, std::vector<int32_t>> tokens;  // by request id
  std::map<int64_t, std::vector<int32_t>> by_index;    // continuations of one request
  int64_t max_used = 0;                                // most blocks held at once
  EngineStats last;
};

// Steps to completion; checks after every step that no block leaked (used + free = total)
// and at the end that every block came back.
Outcome Drain(Engine& engine) {
  Outcome run;
  for (int guard = 0; engine.HasWork() && guard < 20000; ++guard) {
    auto step = engine.Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    for (const TokenOutput& t : *step) {
      run.tokens[t.request_id].push_back(t.token_id);
      run.by_index[t.index].push_back(t.token_id);
    }
    const EngineStats st = engine.Stats();
    EXPECT_EQ(st.blocks_used + st.blocks_free, st.blocks_total);
    run.max_used = std::max<int64_t>(run.max_used, st.blocks_used);
    EXPECT_TRUE(engine.block_manager().CheckInvariants().ok())
        << engine.block_manager().CheckInvariants();
  }
  EXPECT_FALSE(engine.HasWork());
  run.last = engine.Stats();
  EXPECT_EQ(run.last.blocks_used, 0) << "KV blocks leaked";
  EXPECT_EQ(run.last.swap_blocks_used, 0) << "swap slots leaked";
  return run;
}

// fp32 K/V at `blocks` blocks of 16 tokens.
EngineOptions Pool(int64_t blocks, int64_t chunk = 16) {
  EngineOptions o;
  o.block_size = 16;
  o.max_num_batched_tokens = chunk;
  o.kv_cache_memory = blocks * 16 * 512;  // 512 bytes per token on both fixtures
  return o;
}

TEST(SlidingWindowEngineTest, LongGenerationKeepsUsedBlocksBoundedWhileFullAttentionGrows) {
  // 40 prompt tokens (chunks of 16) and 200 generated: 240 tokens, 15 blocks of 16.
  auto window = MakeEngine(kWindowModel, Pool(64));
  auto full = MakeEngine(kFullModel, Pool(64));
  ASSERT_NE(window, nullptr);
  ASSERT_NE(full, nullptr);
  EXPECT_EQ(window->kv_window(), kWindow);
  EXPECT_EQ(full->kv_window(), 0);
  ASSERT_EQ(window->Stats().bytes_per_token, 512);
  ASSERT_EQ(full->Stats().bytes_per_token, 512);
  ASSERT_TRUE(window->AddRequest(Request("long", Prompt(40, 1), 200)).ok());
  ASSERT_TRUE(full->AddRequest(Request("long", Prompt(40, 1), 200)).ok());
  const Outcome w = Drain(*window);
  const Outcome f = Drain(*full);
  EXPECT_EQ(w.tokens.at("long").size(), 200u);
  EXPECT_EQ(f.tokens.at("long").size(), 200u);
  // A step computing [c, c + 16) holds positions [c - 23, c + 16): at most 4 blocks.
  EXPECT_LE(w.max_used, 4);
  EXPECT_GE(f.max_used, 15);
}

// A pool of 6 blocks (96 tokens) serves a 160-token sequence only because the window bounds
// it; AddRequest sizes by the window, and still refuses what the window cannot fit.
TEST(SlidingWindowEngineTest, AdmissionSizesByTheWindow) {
  auto window = MakeEngine(kWindowModel, Pool(6));
  auto full = MakeEngine(kFullModel, Pool(6));
  ASSERT_NE(window, nullptr);
  ASSERT_NE(full, nullptr);
  EXPECT_EQ(full->AddRequest(Request("long", Prompt(40, 1), 120)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(window->AddRequest(Request("long", Prompt(40, 1), 120)).ok());
  auto big = MakeEngine(kWindowModel, Pool(64));
  ASSERT_NE(big, nullptr);
  ASSERT_TRUE(big->AddRequest(Request("long", Prompt(40, 1), 120)).ok());
  EXPECT_EQ(Drain(*window).tokens, Drain(*big).tokens);
  // The window and a chunk of 64 need ceil(87 / 16) + 1 = 7 blocks: more than 6.
  auto chunky = MakeEngine(kWindowModel, Pool(6, 64));
  ASSERT_NE(chunky, nullptr);
  const absl::Status st = chunky->AddRequest(Request("long", Prompt(100, 1), 10));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("window of 24"), std::string::npos) << st;
}

// Outputs do not depend on how the prompt is chunked, how many sequences share the pool, or
// whether they are preempted (by swap or recompute) on the way.
TEST(SlidingWindowEngineTest, ChunkingBatchingAndPreemptionKeepGreedyOutputs) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(Request(absl::StrCat("r", i), Prompt(10 + 23 * i, i), 40 + 10 * i));
  }
  std::map<std::string, std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    auto engine = MakeEngine(kWindowModel, Pool(64, 8192));
    ASSERT_NE(engine, nullptr);
    ASSERT_TRUE(engine->AddRequest(r).ok());
    alone[r.id] = Drain(*engine).tokens[r.id];
  }
  for (PreemptionMode mode : {PreemptionMode::kSwap, PreemptionMode::kRecompute}) {
    // 8 blocks for four sequences of up to 4 blocks each: they must take turns.
    EngineOptions tight = Pool(8, 16);
    tight.preemption_mode = mode;
    tight.swap_space = 8 * 16 * 512;
    tight.watermark = 0;
    auto engine = MakeEngine(kWindowModel, tight);
    ASSERT_NE(engine, nullptr);
    for (const GenerationRequest& r : requests) ASSERT_TRUE(engine->AddRequest(r).ok());
    const Outcome run = Drain(*engine);
    EXPECT_EQ(run.tokens, alone) << (mode == PreemptionMode::kSwap ? "swap" : "recompute");
    EXPECT_GT(run.last.num_preemptions, 0);
    if (mode == PreemptionMode::kSwap) {
      EXPECT_GT(run.last.num_swap_outs, 0);
    } else {
      EXPECT_GT(run.last.num_recomputes, 0);
    }
    EXPECT_LE(run.max_used, 8);
  }
}

// The prefix cache keeps the released blocks (cached, evictable); a second identical prompt
// takes only the blocks its window needs and produces the same tokens.
TEST(SlidingWindowEngineTest, PrefixHitsTakeOnlyTheWindow) {
  auto engine = MakeEngine(kWindowModel, Pool(64, 16));
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = Prompt(120, 5);
  ASSERT_TRUE(engine->AddRequest(Request("a", prompt, 20)).ok());
  const Outcome first = Drain(*engine);
  EXPECT_GT(first.last.blocks_cached, 0);
  ASSERT_TRUE(engine->AddRequest(Request("b", prompt, 20)).ok());
  const Outcome second = Drain(*engine);
  EXPECT_EQ(second.tokens.at("b"), first.tokens.at("a"));
  EXPECT_GT(second.last.prefix_hit_tokens, 0);
  EXPECT_LE(second.max_used, 4);
}

// n > 1 continuations share the prompt's blocks, holes included, and match separate seeds.
TEST(SlidingWindowEngineTest, ParallelSamplingForksTheWindow) {
  auto engine = MakeEngine(kWindowModel, Pool(64, 16));
  ASSERT_NE(engine, nullptr);
  GenerationRequest r = Request("par", Prompt(50, 2), 24, 0.9, 77);
  r.n = 3;
  ASSERT_TRUE(engine->AddRequest(r).ok());
  const Outcome run = Drain(*engine);
  ASSERT_EQ(run.by_index.size(), 3u);
  EXPECT_LE(run.max_used, 3 * 4);
  for (int64_t i = 0; i < 3; ++i) {
    auto alone = MakeEngine(kWindowModel, Pool(64, 16));
    ASSERT_NE(alone, nullptr);
    ASSERT_TRUE(alone->AddRequest(Request("one", Prompt(50, 2), 24, 0.9, 77 + i)).ok());
    EXPECT_EQ(run.by_index.at(i), Drain(*alone).tokens.at("one")) << "continuation " << i;
  }
}

// A continuation resumed after a failover re-prefills prompt + generated tokens in chunks
// within the window's blocks and goes on exactly as the uninterrupted run.
TEST(SlidingWindowEngineTest, ResumedContinuationEqualsTheUninterruptedRun) {
  auto whole = MakeEngine(kWindowModel, Pool(64, 16));
  ASSERT_NE(whole, nullptr);
  ASSERT_TRUE(whole->AddRequest(Request("x", Prompt(30, 3), 100)).ok());
  const std::vector<int32_t> all = Drain(*whole).tokens.at("x");
  ASSERT_EQ(all.size(), 100u);
  auto resumed = MakeEngine(kWindowModel, Pool(6, 16));
  ASSERT_NE(resumed, nullptr);
  GenerationRequest r = Request("x", Prompt(30, 3), 100);
  r.resume_tokens.assign(all.begin(), all.begin() + 70);
  ASSERT_TRUE(resumed->AddRequest(r).ok());
  const Outcome run = Drain(*resumed);
  EXPECT_EQ(run.tokens.at("x"), std::vector<int32_t>(all.begin() + 70, all.end()));
  EXPECT_LE(run.max_used, 4);
}

}  // namespace
}  // namespace kvgrid::worker
