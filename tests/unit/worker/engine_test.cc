// The engine on the generated fixture models: batching does not change outputs, preemption by
// recompute does not change greedy outputs, aborts and finishes return every block, and bad
// requests are refused with the field named.
#include "worker/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"

namespace kvgrid::worker {
namespace {

std::filesystem::path Fixture(const std::string& name) {
  return std::filesystem::path(KVGRID_FIXTURES_DIR) / name;
}

std::unique_ptr<Engine> MakeEngine(const std::string& fixture, EngineOptions options = {}) {
  auto model = LlamaModel::Load(Fixture(fixture));
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return nullptr;
  auto engine = Engine::Create(*std::move(model), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

GenerationRequest Request(const std::string& id, std::vector<int32_t> prompt, int64_t max_new,
                          double temperature, std::optional<uint64_t> seed = std::nullopt) {
  GenerationRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.95 : 1.0;
  r.sampling.seed = seed;
  r.stopping.max_new_tokens = max_new;
  r.stopping.ignore_eos = true;
  return r;
}

// Outputs of every request, run to completion; checks that every block came back.
std::map<std::string, std::vector<TokenOutput>> DrainOutputs(Engine& engine) {
  std::map<std::string, std::vector<TokenOutput>> out;
  int guard = 0;
  while (engine.HasWork() && ++guard < 10000) {
    auto step = engine.Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    for (const TokenOutput& t : *step) out[t.request_id].push_back(t);
  }
  EXPECT_FALSE(engine.HasWork());
  EXPECT_EQ(engine.Stats().blocks_free, engine.Stats().blocks_total) << "KV blocks leaked";
  return out;
}

std::vector<int32_t> Ids(const std::vector<TokenOutput>& outputs) {
  std::vector<int32_t> ids;
  for (const TokenOutput& t : outputs) ids.push_back(t.token_id);
  return ids;
}

// Runs to completion; returns generated tokens per request id and checks finish bookkeeping.
std::map<std::string, std::vector<int32_t>> Drain(Engine& engine) {
  std::map<std::string, std::vector<int32_t>> out;
  for (const auto& [id, outputs] : DrainOutputs(engine)) out[id] = Ids(outputs);
  return out;
}

std::vector<GenerationRequest> MixedRequests() {
  std::vector<GenerationRequest> rs;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 3 + 7 * i; ++j) prompt.push_back(100 + (j * 31 + i * 17) % 5000);
    const bool sampled = i % 2 == 1;
    rs.push_back(Request(absl::StrCat("r", i), prompt, 12 + i, sampled ? 0.8 : 0.0,
                         sampled ? std::optional<uint64_t>(1000 + i) : std::nullopt));
  }
  return rs;
}

// Greedy outputs of MixedRequests() on an engine made with `options`.
std::map<std::string, std::vector<int32_t>> GreedyMixed(const std::string& fixture,
                                                        const EngineOptions& options,
                                                        EngineStats* stats = nullptr) {
  auto engine = MakeEngine(fixture, options);
  if (engine == nullptr) return {};
  for (GenerationRequest& r : MixedRequests()) {
    r.sampling.temperature = 0;
    EXPECT_TRUE(engine->AddRequest(std::move(r)).ok());
  }
  auto out = Drain(*engine);
  if (stats) *stats = engine->Stats();
  return out;
}

// `base` shrunk to 8 blocks of 8 tokens — the six mixed sequences (up to 53 tokens each) must
// take turns — with `swap_blocks` blocks of swap space.
EngineOptions Tight(const std::string& fixture, EngineOptions base, int64_t swap_blocks) {
  auto probe = MakeEngine(fixture, base);
  const int64_t per_token = probe ? probe->Stats().bytes_per_token : 0;
  base.block_size = 8;
  base.kv_cache_memory = 8 * 8 * per_token;
  base.swap_space = swap_blocks * 8 * per_token;
  // kAuto's choice depends on measured timings; these tests need a fixed one.
  if (base.preemption_mode == PreemptionMode::kAuto) base.preemption_mode = PreemptionMode::kSwap;
  return base;
}

class EngineFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineFixtureTest, BatchedOutputsEqualOutputsAlone) {
  std::map<std::string, std::vector<int32_t>> alone;
  for (GenerationRequest& r : MixedRequests()) {
    auto engine = MakeEngine(GetParam());
    ASSERT_NE(engine, nullptr);
    const std::string id = r.id;
    ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
    alone[id] = Drain(*engine)[id];
  }
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  for (GenerationRequest& r : MixedRequests()) ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  EXPECT_EQ(Drain(*engine), alone);
}

TEST_P(EngineFixtureTest, PreemptionByRecomputeKeepsGreedyOutputs) {
  const auto expected = GreedyMixed(GetParam(), {});
  EngineStats st;
  EXPECT_EQ(GreedyMixed(GetParam(), Tight(GetParam(), {}, 0), &st), expected);
  EXPECT_EQ(st.blocks_total, 8);
  EXPECT_GT(st.num_recomputes, 0);
  EXPECT_EQ(st.num_swap_outs, 0);
}

TEST_P(EngineFixtureTest, ChunkedPrefillEqualsUnchunked) {
  const auto expected = GreedyMixed(GetParam(), {});
  // A budget of 7 tokens per step: prompts of up to 38 tokens are prefilled in chunks, while
  // running decodes go first.
  EngineOptions chunked;
  chunked.max_num_batched_tokens = 7;
  EXPECT_EQ(GreedyMixed(GetParam(), chunked), expected);
  // One long prompt alone, in chunks of 16 that attend to the earlier chunks in the cache.
  std::vector<int32_t> prompt;
  for (int j = 0; j < 100; ++j) prompt.push_back(50 + (j * 37) % 4000);
  auto whole = MakeEngine(GetParam());
  auto pieces = MakeEngine(GetParam(), {.max_num_batched_tokens = 16});
  ASSERT_NE(whole, nullptr);
  ASSERT_NE(pieces, nullptr);
  ASSERT_TRUE(whole->AddRequest(Request("long", prompt, 8, 0.0)).ok());
  ASSERT_TRUE(pieces->AddRequest(Request("long", prompt, 8, 0.0)).ok());
  int steps_before_first_token = 0;
  std::vector<int32_t> got;
  while (pieces->HasWork() && got.empty()) {
    auto out = pieces->Step();
    ASSERT_TRUE(out.ok());
    if (out->empty()) ++steps_before_first_token;
    for (const TokenOutput& t : *out) got.push_back(t.token_id);
  }
  EXPECT_EQ(steps_before_first_token, 6);  // 100 tokens: 6 chunks of 16, the 7th samples
  const auto rest = Drain(*pieces);
  got.insert(got.end(), rest.at("long").begin(), rest.at("long").end());
  EXPECT_EQ(got, Drain(*whole)["long"]);
}

TEST_P(EngineFixtureTest, MinTokensMasksStopTokensUntilReached) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("g", {10, 11, 12}, 6, 0.0)).ok());
  const std::vector<int32_t> greedy = Drain(*engine)["g"];
  GenerationRequest r = Request("m", {10, 11, 12}, 6, 0.0);
  r.stopping.stop_token_ids = {greedy[0]};
  r.stopping.min_tokens = 3;
  ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  const std::vector<int32_t> got = Drain(*engine)["m"];
  ASSERT_GE(got.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(got[i], greedy[0]) << i;  // masked
  GenerationRequest bad = Request("b", {1}, 4, 0.0);
  bad.stopping.min_tokens = 5;
  EXPECT_EQ(engine->AddRequest(std::move(bad)).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(EngineFixtureTest, LogprobsUsageAndTimings) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  GenerationRequest r = Request("lp", std::vector<int32_t>(40, 17), 5, 0.0);
  r.sampling.logprobs = 3;
  ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  std::vector<TokenOutput> outs;
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    outs.insert(outs.end(), step->begin(), step->end());
  }
  ASSERT_EQ(outs.size(), 5u);
  for (const TokenOutput& o : outs) {
    ASSERT_TRUE(o.logprob.has_value());
    ASSERT_EQ(o.top_logprobs.size(), 3u);
    EXPECT_EQ(o.top_logprobs[0].token_id, o.token_id);  // greedy picks the top token
    EXPECT_FLOAT_EQ(o.top_logprobs[0].logprob, *o.logprob);
    EXPECT_LE(*o.logprob, 0.f);
    EXPECT_GE(o.top_logprobs[0].logprob, o.top_logprobs[1].logprob);
    double mass = 0;
    for (const TokenLogprob& t : o.top_logprobs) mass += std::exp(t.logprob);
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
  const TokenOutput& last = outs.back();
  EXPECT_EQ(last.usage.prompt_tokens, 40);
  EXPECT_EQ(last.usage.completion_tokens, 5);
  EXPECT_LE(last.timings.queued_s, last.timings.first_token_s);
  EXPECT_LE(last.timings.first_token_s, last.timings.finished_s);
  // The same prompt again hits the prefix cache (2 full blocks of 16).
  ASSERT_TRUE(engine->AddRequest(Request("again", std::vector<int32_t>(40, 17), 1, 0.0)).ok());
  std::vector<TokenOutput> again;
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    again.insert(again.end(), step->begin(), step->end());
  }
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].usage.cached_prompt_tokens, 32);
  EXPECT_FALSE(again[0].logprob.has_value());
}

TEST_P(EngineFixtureTest, AbortMidPrefillFreesEveryBlock) {
  auto engine = MakeEngine(GetParam(), {.max_num_batched_tokens = 8});
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("long", std::vector<int32_t>(60, 21), 4, 0.0)).ok());
  ASSERT_TRUE(engine->Step().ok());  // first chunk of 8
  ASSERT_TRUE(engine->Step().ok());
  EXPECT_GT(engine->Stats().blocks_used, 0);
  engine->Abort("long");
  EXPECT_EQ(engine->Stats().blocks_used, 0);
  EXPECT_FALSE(engine->HasWork());
}

TEST_P(EngineFixtureTest, BurstAgainstATinyPoolCompletesWithoutLeaks) {
  auto probe = MakeEngine(GetParam());
  ASSERT_NE(probe, nullptr);
  EngineOptions tiny;
  tiny.block_size = 8;
  tiny.kv_cache_memory = 12 * 8 * probe->Stats().bytes_per_token;  // 96 tokens
  tiny.max_num_batched_tokens = 32;
  auto engine = MakeEngine(GetParam(), tiny);
  ASSERT_NE(engine, nullptr);
  for (int i = 0; i < 200; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 1 + i % 23; ++j) prompt.push_back(100 + (i * 7 + j * 3) % 900);
    GenerationRequest r = Request(absl::StrCat("b", i), prompt, 1 + i % 17,
                                  i % 2 ? 0.8 : 0.0, 9000 + i);
    ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  }
  const auto out = Drain(*engine);  // checks that every block is back
  ASSERT_EQ(out.size(), 200u);
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(out.at(absl::StrCat("b", i)).size(), static_cast<size_t>(1 + i % 17));
  }
  EXPECT_GT(engine->Stats().num_preemptions, 0);
}

TEST_P(EngineFixtureTest, SeededRequestIsTheSameAloneAndInABatchOfSixteen) {
  auto alone = MakeEngine(GetParam());
  ASSERT_NE(alone, nullptr);
  GenerationRequest probe = Request("seeded", {40, 41, 42, 43, 44}, 14, 1.1, 4242);
  probe.sampling.top_k = 50;
  ASSERT_TRUE(alone->AddRequest(probe).ok());
  const auto expected = Drain(*alone)["seeded"];
  auto batch = MakeEngine(GetParam());
  ASSERT_NE(batch, nullptr);
  for (int i = 0; i < 15; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 2 + (i * 5) % 31; ++j) prompt.push_back(500 + i * 31 + j);
    ASSERT_TRUE(batch->AddRequest(Request(absl::StrCat("o", i), prompt, 3 + i,
                                          i % 3 ? 0.7 : 0.0, i))
                    .ok());
    if (i == 7) {
      ASSERT_TRUE(batch->AddRequest(probe).ok());
    }
  }
  EXPECT_EQ(Drain(*batch)["seeded"], expected);
}

TEST_P(EngineFixtureTest, PriorityAdmitsLowerValuesFirst) {
  auto engine = MakeEngine(GetParam(), {.max_num_seqs = 1});
  ASSERT_NE(engine, nullptr);
  GenerationRequest late = Request("late", {1, 2}, 2, 0.0);
  late.priority = 5;
  GenerationRequest urgent = Request("urgent", {3, 4}, 2, 0.0);
  urgent.priority = -1;
  ASSERT_TRUE(engine->AddRequest(late).ok());
  ASSERT_TRUE(engine->AddRequest(Request("normal", {5, 6}, 2, 0.0)).ok());
  ASSERT_TRUE(engine->AddRequest(urgent).ok());
  std::vector<std::string> order;
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    for (const TokenOutput& t : *step) {
      if (order.empty() || order.back() != t.request_id) order.push_back(t.request_id);
    }
  }
  EXPECT_EQ(order, (std::vector<std::string>{"urgent", "normal", "late"}));
}

TEST_P(EngineFixtureTest, AbortFreesBlocksAndIsIdempotent) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("a", {1, 2, 3, 4, 5}, 50, 0.0)).ok());
  ASSERT_TRUE(engine->AddRequest(Request("b", {6, 7, 8}, 50, 0.0)).ok());
  ASSERT_TRUE(engine->Step().ok());
  ASSERT_TRUE(engine->Step().ok());
  EXPECT_LT(engine->Stats().blocks_free, engine->Stats().blocks_total);
  engine->Abort("a");
  engine->Abort("a");
  engine->Abort("never-existed");
  engine->Abort("b");
  EXPECT_FALSE(engine->HasWork());
  EXPECT_EQ(engine->Stats().blocks_free, engine->Stats().blocks_total);
  // The id is free again.
  EXPECT_TRUE(engine->AddRequest(Request("a", {1}, 2, 0.0)).ok());
  Drain(*engine);
}

TEST_P(EngineFixtureTest, MaxNewTokensAndFinishReason) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("x", {10, 11}, 5, 0.0)).ok());
  std::vector<TokenOutput> all;
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    all.insert(all.end(), step->begin(), step->end());
  }
  ASSERT_EQ(all.size(), 5u);
  for (size_t i = 0; i + 1 < all.size(); ++i) EXPECT_EQ(all[i].finish, FinishReason::kNone);
  EXPECT_EQ(all.back().finish, FinishReason::kLength);
}

TEST_P(EngineFixtureTest, StopTokenEndsTheSequence) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("g", {10, 11, 12}, 8, 0.0)).ok());
  const std::vector<int32_t> greedy = Drain(*engine)["g"];
  ASSERT_EQ(greedy.size(), 8u);
  GenerationRequest r = Request("s", {10, 11, 12}, 8, 0.0);
  r.stopping.stop_token_ids = {greedy[3]};
  ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  const std::vector<int32_t> stopped = Drain(*engine)["s"];
  const size_t first = std::find(greedy.begin(), greedy.end(), greedy[3]) - greedy.begin();
  EXPECT_EQ(stopped, std::vector<int32_t>(greedy.begin(), greedy.begin() + first + 1));
}

TEST_P(EngineFixtureTest, EosIdsEndTheSequenceUnlessIgnoredOrMasked) {
  std::vector<int32_t> greedy;
  {
    auto engine = MakeEngine(GetParam());
    ASSERT_NE(engine, nullptr);
    ASSERT_TRUE(engine->AddRequest(Request("g", {10, 11, 12}, 8, 0.0)).ok());
    greedy = Drain(*engine)["g"];
  }
  ASSERT_EQ(greedy.size(), 8u);
  // Two EOS ids, as Llama-3 instruct models have (<|end_of_text|>, <|eot_id|>).
  EngineOptions options;
  options.eos_token_ids = {greedy[5], greedy[2]};
  const size_t first_eos = std::find_if(greedy.begin(), greedy.end(), [&](int32_t t) {
                             return t == greedy[5] || t == greedy[2];
                           }) - greedy.begin();
  auto engine = MakeEngine(GetParam(), options);
  ASSERT_NE(engine, nullptr);

  GenerationRequest stops = Request("eos", {10, 11, 12}, 8, 0.0);
  stops.stopping.ignore_eos = false;
  GenerationRequest ignores = Request("ignore", {10, 11, 12}, 8, 0.0);  // ignore_eos
  GenerationRequest masked = Request("masked", {10, 11, 12}, 8, 0.0);
  masked.stopping.ignore_eos = false;
  masked.stopping.min_tokens = static_cast<int64_t>(first_eos) + 2;
  for (GenerationRequest* r : {&stops, &ignores, &masked}) {
    ASSERT_TRUE(engine->AddRequest(std::move(*r)).ok());
  }
  auto out = DrainOutputs(*engine);

  // The EOS token is emitted and ends the sequence with finish reason stop.
  EXPECT_EQ(Ids(out["eos"]),
            std::vector<int32_t>(greedy.begin(), greedy.begin() + first_eos + 1));
  EXPECT_EQ(out["eos"].back().finish, FinishReason::kStop);
  // ignore_eos runs to max_new_tokens.
  EXPECT_EQ(Ids(out["ignore"]), greedy);
  EXPECT_EQ(out["ignore"].back().finish, FinishReason::kLength);
  // min_tokens masks every EOS id until it is reached.
  const std::vector<int32_t> late = Ids(out["masked"]);
  ASSERT_GE(late.size(), first_eos + 2);
  for (size_t i = 0; i < first_eos + 2; ++i) {
    EXPECT_NE(late[i], greedy[5]) << i;
    EXPECT_NE(late[i], greedy[2]) << i;
  }
  EXPECT_EQ(std::vector<int32_t>(late.begin(), late.begin() + first_eos),
            std::vector<int32_t>(greedy.begin(), greedy.begin() + first_eos));
  if (out["masked"].back().finish == FinishReason::kStop) {
    EXPECT_TRUE(late.back() == greedy[5] || late.back() == greedy[2]);
  }
}

TEST_P(EngineFixtureTest, RefusesBadRequestsNamingTheField) {
  EngineOptions small;
  small.max_model_len = 64;
  auto engine = MakeEngine(GetParam(), small);
  ASSERT_NE(engine, nullptr);
  auto message = [&](GenerationRequest r) {
    absl::Status s = engine->AddRequest(std::move(r));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  EXPECT_NE(message(Request("", {1}, 1, 0.0)).find("request_id"), std::string::npos);
  EXPECT_NE(message(Request("e", {}, 1, 0.0)).find("prompt"), std::string::npos);
  EXPECT_NE(message(Request("v", {1, -3}, 1, 0.0)).find("prompt[1]"), std::string::npos);
  EXPECT_NE(message(Request("v", {1, 1 << 30}, 1, 0.0)).find("vocabulary"), std::string::npos);
  const std::string too_long = message(Request("l", std::vector<int32_t>(64, 5), 1, 0.0));
  EXPECT_NE(too_long.find("64 tokens"), std::string::npos) << too_long;
  EXPECT_NE(message(Request("m", {1}, 0, 0.0)).find("max_new_tokens"), std::string::npos);
  GenerationRequest bad_p = Request("p", {1}, 1, 1.0);
  bad_p.sampling.top_p = 0;
  EXPECT_NE(message(std::move(bad_p)).find("top_p"), std::string::npos);
  ASSERT_TRUE(engine->AddRequest(Request("dup", {1}, 1, 0.0)).ok());
  EXPECT_NE(message(Request("dup", {1}, 1, 0.0)).find("already in use"), std::string::npos);
  Drain(*engine);
}

TEST_P(EngineFixtureTest, RefusesSequencesThatCanNeverFit) {
  auto probe = MakeEngine(GetParam());
  ASSERT_NE(probe, nullptr);
  EngineOptions tiny;
  tiny.kv_cache_memory = 2 * 16 * probe->Stats().bytes_per_token;  // 2 blocks = 32 tokens
  auto engine = MakeEngine(GetParam(), tiny);
  ASSERT_NE(engine, nullptr);
  absl::Status s = engine->AddRequest(Request("big", std::vector<int32_t>(20, 3), 20, 0.0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("40 tokens"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("holds 32 tokens"), std::string::npos) << s;
  EXPECT_TRUE(engine->AddRequest(Request("ok", std::vector<int32_t>(20, 3), 12, 0.0)).ok());
  Drain(*engine);
  // A huge max_new_tokens is capped by the context window, never overflowing the arithmetic.
  s = engine->AddRequest(
      Request("huge", {1, 2, 3}, std::numeric_limits<int64_t>::max(), 0.0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("holds 32 tokens"), std::string::npos) << s;
  EXPECT_FALSE(engine->HasWork());
}

TEST_P(EngineFixtureTest, Fp16CacheStaysCloseToFp32) {
  EngineOptions f16;
  f16.k_dtype = f16.v_dtype = kernels::KvDType::kF16;
  auto a = MakeEngine(GetParam());
  auto b = MakeEngine(GetParam(), f16);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Stats().bytes_per_token * 2, a->Stats().bytes_per_token);
  ASSERT_TRUE(a->AddRequest(Request("q", {5, 6, 7, 8, 9, 10}, 16, 0.0)).ok());
  ASSERT_TRUE(b->AddRequest(Request("q", {5, 6, 7, 8, 9, 10}, 16, 0.0)).ok());
  EXPECT_EQ(Drain(*a), Drain(*b));
}

// Requests that share a long system-prompt-like prefix, submitted in two waves so the second
// wave finds the first wave's blocks in the prefix cache.
std::vector<std::vector<GenerationRequest>> SharedPrefixWaves() {
  std::vector<int32_t> prefix;
  for (int j = 0; j < 37; ++j) prefix.push_back(200 + (j * 13) % 3000);
  std::vector<std::vector<GenerationRequest>> waves(2);
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = prefix;
    for (int j = 0; j <= i; ++j) prompt.push_back(4000 + i * 10 + j);
    const bool sampled = i % 3 == 2;
    waves[i % 2].push_back(Request(absl::StrCat("p", i), prompt, 10, sampled ? 0.9 : 0.0,
                                   sampled ? std::optional<uint64_t>(77 + i) : std::nullopt));
  }
  return waves;
}

std::map<std::string, std::vector<int32_t>> RunWaves(Engine& engine) {
  std::map<std::string, std::vector<int32_t>> all;
  for (std::vector<GenerationRequest>& wave : SharedPrefixWaves()) {
    for (GenerationRequest& r : wave) EXPECT_TRUE(engine.AddRequest(std::move(r)).ok());
    for (auto& [id, tokens] : Drain(engine)) all[id] = tokens;
  }
  return all;
}

TEST_P(EngineFixtureTest, PrefixCachingDoesNotChangeOutputs) {
  EngineOptions off;
  off.enable_prefix_caching = false;
  auto plain = MakeEngine(GetParam(), off);
  auto cached = MakeEngine(GetParam());
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(cached, nullptr);
  EXPECT_EQ(RunWaves(*cached), RunWaves(*plain));
  const EngineStats st = cached->Stats();
  // Wave 2 shares the 32 prefix tokens in full blocks of 16 with wave 1.
  EXPECT_GE(st.prefix_hit_tokens, 3 * 32);
  EXPECT_GT(st.prefix_hit_rate, 0.2);
  EXPECT_EQ(plain->Stats().prefix_hit_tokens, 0);
  EXPECT_GT(st.blocks_cached, 0);  // finished sequences leave their full blocks cached
}

TEST_P(EngineFixtureTest, PreemptionBySwapKeepsGreedyOutputsAndLeaksNothing) {
  const auto expected = GreedyMixed(GetParam(), {});
  EngineStats st;
  EXPECT_EQ(GreedyMixed(GetParam(), Tight(GetParam(), {}, 64), &st), expected);
  EXPECT_GT(st.num_swap_outs, 0);
  EXPECT_EQ(st.swap_blocks_used, 0);
  EXPECT_EQ(st.num_swapped, 0);
}

// Swapping a sequence out keeps the blocks it shares on the device: with n > 1 siblings
// sharing their prompt blocks in a pool they exactly fill, a swap can free nothing, and
// sequences swapped out with shared blocks can hold what the last running one needs. Each
// case must still run to the end, in every preemption mode, leaving no block or slot behind.
TEST_P(EngineFixtureTest, SharedBlocksNeverStallSwapPreemption) {
  for (PreemptionMode mode :
       {PreemptionMode::kSwap, PreemptionMode::kAuto, PreemptionMode::kRecompute}) {
    SCOPED_TRACE(static_cast<int>(mode));
    struct Case {
      std::vector<GenerationRequest> requests;
      int64_t swap_blocks;
    };
    std::vector<Case> cases;
    auto tokens = [](int32_t first, int count) {
      std::vector<int32_t> t(count);
      std::iota(t.begin(), t.end(), first);
      return t;
    };
    auto siblings = [&](const std::string& id, int32_t first, int count, int64_t max_new,
                        uint64_t seed) {
      GenerationRequest r = Request(id, tokens(first, count), max_new, 0.9, seed);
      r.n = 2;
      return r;
    };
    // Two siblings whose 57-token prompt fills 8 blocks: the parent's copy-on-write has no
    // free block, and swapping the child out frees none.
    cases.push_back({{siblings("par", 100, 57, 7, 5)}, 64});
    // Siblings swapped out keep their two prompt blocks; the sequence left running then needs
    // one of them.
    cases.push_back({{Request("solo", tokens(200, 8), 48, 0.0), siblings("par", 300, 16, 20, 7)},
                     64});
    // One swap slot: a swapped-in sibling that cannot get its next block must not need more
    // slots to go back out than the swap space has.
    cases.push_back({{Request("a", tokens(400, 8), 24, 0.0), siblings("b", 500, 24, 17, 9)}, 1});
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE(absl::StrCat("case ", c));
      EngineOptions options = Tight(GetParam(), {}, cases[c].swap_blocks);
      options.preemption_mode = mode;  // Tight fixes kAuto to kSwap; here it stays by cost
      auto engine = MakeEngine(GetParam(), options);
      ASSERT_NE(engine, nullptr);
      std::map<std::string, int64_t> want;
      for (GenerationRequest& r : cases[c].requests) {
        want[r.id] = r.stopping.max_new_tokens * std::max<int64_t>(1, r.n);
        ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
      }
      const auto out = DrainOutputs(*engine);
      for (const auto& [id, count] : want) {
        ASSERT_TRUE(out.contains(id)) << id;
        EXPECT_EQ(static_cast<int64_t>(out.at(id).size()), count) << id;
      }
      const EngineStats st = engine->Stats();
      EXPECT_EQ(st.swap_blocks_used, 0);
      EXPECT_EQ(st.num_swapped, 0);
    }
  }
}

TEST_P(EngineFixtureTest, RecomputeModeNeverSwapsAndAutoModeKeepsOutputs) {
  const auto expected = GreedyMixed(GetParam(), {});
  EngineOptions recompute;
  recompute.preemption_mode = PreemptionMode::kRecompute;
  EngineStats st;
  EXPECT_EQ(GreedyMixed(GetParam(), Tight(GetParam(), recompute, 64), &st), expected);
  EXPECT_GT(st.num_recomputes, 0);
  EXPECT_EQ(st.num_swap_outs, 0);
  // Auto picks by measured cost, whichever it picks, outputs and accounting stay exact.
  EngineOptions by_cost = Tight(GetParam(), {}, 64);
  by_cost.preemption_mode = PreemptionMode::kAuto;
  EXPECT_EQ(GreedyMixed(GetParam(), by_cost, &st), expected);
  EXPECT_GT(st.num_preemptions, 0);
  EXPECT_EQ(st.swap_blocks_used, 0);
}

TEST_P(EngineFixtureTest, WatermarkKeepsRoomForRunningSequences) {
  auto probe = MakeEngine(GetParam());
  ASSERT_NE(probe, nullptr);
  for (double watermark : {0.0, 0.9}) {
    EngineOptions o;
    o.kv_cache_memory = 10 * 16 * probe->Stats().bytes_per_token;  // 10 blocks of 16
    o.watermark = watermark;
    auto engine = MakeEngine(GetParam(), o);
    ASSERT_NE(engine, nullptr);
    std::map<std::string, size_t> tokens;
    ASSERT_TRUE(engine->AddRequest(Request("a", {5, 6, 7, 8}, 4, 0.0)).ok());
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    for (const TokenOutput& t : *step) ++tokens[t.request_id];
    ASSERT_TRUE(engine->AddRequest(Request("b", {9, 10, 11, 12}, 4, 0.0)).ok());
    step = engine->Step();
    ASSERT_TRUE(step.ok());
    for (const TokenOutput& t : *step) ++tokens[t.request_id];
    // b needs one block: 9 free - 1 leaves 8, under a watermark of 9 blocks but not of 0.
    EXPECT_EQ(engine->Stats().num_running, watermark == 0.0 ? 2 : 1) << watermark;
    for (const auto& [id, ids] : Drain(*engine)) tokens[id] += ids.size();
    EXPECT_EQ(tokens["a"], 4u);
    EXPECT_EQ(tokens["b"], 4u);
  }
}

TEST(PreemptionTest, ChooseSwapByModeAndCost) {
  // Without room in the swap space every mode recomputes.
  for (PreemptionMode m : {PreemptionMode::kAuto, PreemptionMode::kSwap,
                           PreemptionMode::kRecompute}) {
    EXPECT_FALSE(ChooseSwap(m, false, 1.0, 0.001));
  }
  EXPECT_TRUE(ChooseSwap(PreemptionMode::kSwap, true, 0.001, 1.0));
  EXPECT_FALSE(ChooseSwap(PreemptionMode::kRecompute, true, 1.0, 0.001));
  EXPECT_TRUE(ChooseSwap(PreemptionMode::kAuto, true, -1, -1));    // nothing measured yet
  EXPECT_TRUE(ChooseSwap(PreemptionMode::kAuto, true, 0.5, -1));
  EXPECT_TRUE(ChooseSwap(PreemptionMode::kAuto, true, 0.5, 0.01));  // copying is cheaper
  EXPECT_FALSE(ChooseSwap(PreemptionMode::kAuto, true, 0.01, 0.5)); // a short sequence
  EXPECT_EQ(*ParsePreemptionMode("recompute"), PreemptionMode::kRecompute);
  const auto bad = ParsePreemptionMode("never");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("--preemption-mode"), std::string::npos);
}

TEST_P(EngineFixtureTest, SwapKeepsQuantizedCachesIntact) {
  // int8 K / int4 V rows carry scales in separate planes; a swap must move them with the
  // values, so a run with swaps equals an unconstrained one.
  EngineOptions q;
  q.k_dtype = kernels::KvDType::kInt8;
  q.v_dtype = kernels::KvDType::kInt4;
  const auto expected = GreedyMixed(GetParam(), q);
  EngineStats st;
  EXPECT_EQ(GreedyMixed(GetParam(), Tight(GetParam(), q, 64), &st), expected);
  EXPECT_GT(st.num_swap_outs, 0);
}

TEST_P(EngineFixtureTest, AccountingReflectsStoredTokens) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->AddRequest(Request("a", std::vector<int32_t>(20, 7), 30, 0.0)).ok());
  ASSERT_TRUE(engine->Step().ok());  // prefill 20 tokens, sample the 21st
  EngineStats st = engine->Stats();
  EXPECT_EQ(st.blocks_used, 2);
  EXPECT_EQ(st.tokens_stored, 20);
  EXPECT_NEAR(st.internal_waste, 1.0 - 20.0 / 32.0, 1e-9);
  EXPECT_NEAR(st.usage, 2.0 / st.blocks_total, 1e-9);
  EXPECT_EQ(st.tokens_capacity, int64_t{st.blocks_total} * 16);
  engine->Abort("a");
  EXPECT_EQ(engine->Stats().blocks_used, 0);
}

TEST_P(EngineFixtureTest, ParallelSamplingSharesThePromptAndMatchesSeparateSeeds) {
  std::vector<int32_t> prompt;
  for (int j = 0; j < 29; ++j) prompt.push_back(300 + j * 7);
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  GenerationRequest r = Request("par", prompt, 12, 0.9, 500);
  r.n = 4;
  ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  std::map<int64_t, std::vector<int32_t>> by_index;
  int64_t max_used = 0;
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok()) << step.status();
    for (const TokenOutput& t : *step) by_index[t.index].push_back(t.token_id);
    max_used = std::max<int64_t>(max_used, engine->Stats().blocks_used);
  }
  ASSERT_EQ(by_index.size(), 4u);
  EXPECT_GT(engine->Stats().cow_copies, 0);
  // 29 prompt + 12 generated = 41 tokens: 3 blocks each alone; shared, the first full prompt
  // block is held once.
  EXPECT_LE(max_used, 4 * 3 - 3);
  EXPECT_EQ(engine->Stats().blocks_used, 0);
  for (int64_t i = 0; i < 4; ++i) {
    auto alone = MakeEngine(GetParam());
    ASSERT_NE(alone, nullptr);
    ASSERT_TRUE(alone->AddRequest(Request("one", prompt, 12, 0.9, 500 + i)).ok());
    EXPECT_EQ(by_index[i], Drain(*alone)["one"]) << "continuation " << i;
  }
  // n is validated.
  GenerationRequest bad = Request("bad", prompt, 4, 0.9);
  bad.n = 0;
  EXPECT_EQ(engine->AddRequest(std::move(bad)).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(EngineFixtureTest, AbortOfAParallelRequestFreesEveryContinuation) {
  auto engine = MakeEngine(GetParam());
  ASSERT_NE(engine, nullptr);
  GenerationRequest r = Request("par", std::vector<int32_t>(21, 9), 40, 1.0, 1);
  r.n = 3;
  ASSERT_TRUE(engine->AddRequest(std::move(r)).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(engine->Step().ok());
  EXPECT_EQ(engine->Stats().num_running, 3);
  engine->Abort("par");
  EXPECT_FALSE(engine->HasWork());
  EXPECT_EQ(engine->Stats().blocks_used, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, EngineFixtureTest,
                         ::testing::Values("llama3-tiny", "qwen2-tiny"));

}  // namespace
}  // namespace kvgrid::worker

namespace kvgrid::worker {
namespace {

// Stop strings on the embedded trained model, whose text is plain English.
class StopStringEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path dir = std::filesystem::path(KVGRID_SOURCE_DIR) / "models/kjv-tiny";
    auto tok = model::Tokenizer::FromFile(dir / "tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = *std::move(tok);
    dir_ = dir;
  }
  std::unique_ptr<Engine> Make() {
    auto model = LlamaModel::Load(dir_);
    EXPECT_TRUE(model.ok());
    EngineOptions o;
    o.tokenizer = tokenizer_.get();
    auto engine = Engine::Create(*std::move(model), o);
    EXPECT_TRUE(engine.ok());
    return *std::move(engine);
  }
  // Runs one request; returns (concatenated text, every delta, last finish reason).
  std::tuple<std::string, std::vector<std::string>, FinishReason> Run(Engine& e,
                                                                      GenerationRequest r) {
    EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
    std::string text;
    std::vector<std::string> deltas;
    FinishReason finish = FinishReason::kNone;
    while (e.HasWork()) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok());
      for (const TokenOutput& t : *step) {
        text += t.text;
        deltas.push_back(t.text);
        finish = t.finish;
      }
    }
    return {text, deltas, finish};
  }
  std::filesystem::path dir_;
  std::unique_ptr<model::Tokenizer> tokenizer_;
};

TEST_F(StopStringEngineTest, StopStringEndsTheStreamAndNeverLeaks) {
  auto engine = Make();
  const std::vector<int32_t> prompt = tokenizer_->Encode("And the LORD said unto Moses");
  auto [full, unused, f0] = Run(*engine, Request("full", prompt, 40, 0.0));
  ASSERT_GT(full.size(), 40u);
  // A stop string from the middle of the greedy text (it may span tokens).
  const std::string stop = full.substr(full.size() / 2, 5);
  const size_t at = full.find(stop);
  GenerationRequest r = Request("stop", prompt, 40, 0.0);
  r.stopping.stop_strings = {stop};
  auto [text, deltas, finish] = Run(*engine, r);
  EXPECT_EQ(finish, FinishReason::kStop);
  EXPECT_EQ(text, full.substr(0, at));
  for (const std::string& d : deltas) EXPECT_EQ(d.find(stop), std::string::npos);
  r.id = "incl";
  r.stopping.include_stop_str_in_output = true;
  auto [with_stop, d2, f2] = Run(*engine, r);
  EXPECT_EQ(with_stop, full.substr(0, at + stop.size()));
  EXPECT_EQ(engine->Stats().blocks_used, 0);
}

TEST_F(StopStringEngineTest, StopStringsNeedATokenizerAndNonEmptyStrings) {
  auto engine = Make();
  GenerationRequest r = Request("e", {5, 6}, 4, 0.0);
  r.stopping.stop_strings = {""};
  EXPECT_EQ(engine->AddRequest(r).code(), absl::StatusCode::kInvalidArgument);
  auto model = LlamaModel::Load(dir_);
  ASSERT_TRUE(model.ok());
  auto bare = Engine::Create(*std::move(model), {});
  ASSERT_TRUE(bare.ok());
  r.stopping.stop_strings = {"x"};
  EXPECT_EQ((*bare)->AddRequest(r).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvgrid::worker
