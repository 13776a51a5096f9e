// Presence and frequency penalties and logit_bias through the engine, on the trained tiny
// model: greedy picks follow the formula over the model's own logits, a seeded penalized
// request samples the same alone, in a batch and as an n > 1 sibling, a resumed continuation
// rebuilds its counts and goes on exactly as the uninterrupted one, and biases force or ban.
#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "worker/engine/engine.h"

namespace kvgrid::worker {
namespace {

const std::filesystem::path kModel =
    std::filesystem::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";
constexpr int32_t kVocab = 4096;  // models/kjv-tiny/config.json

class EnginePenaltiesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tok = model::Tokenizer::FromFile(kModel / "tokenizer.json");
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = *std::move(tok);
  }

  std::unique_ptr<Engine> MakeEngine() {
    auto model = LlamaModel::Load(kModel);
    EXPECT_TRUE(model.ok()) << model.status();
    EngineOptions options;
    options.tokenizer = tokenizer_.get();
    options.eos_token_ids = {4095};
    auto engine = Engine::Create(*std::move(model), options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return *std::move(engine);
  }

  GenerationRequest Request(const std::string& id, double temperature) {
    GenerationRequest r;
    r.id = id;
    r.prompt = tokenizer_->Encode("And God said, Let there be light: and there was light.");
    r.sampling.temperature = temperature;
    r.sampling.seed = 31;
    r.stopping.max_new_tokens = 32;
    r.stopping.ignore_eos = true;
    return r;
  }

  static GenerationRequest Penalized(GenerationRequest r) {
    r.sampling.presence_penalty = 0.6;
    r.sampling.frequency_penalty = 1.1;
    return r;
  }

  // Every output of every request on `engine`, run to completion, by request id then index.
  static std::map<std::string, std::map<int64_t, std::vector<TokenOutput>>> Drain(
      Engine& engine) {
    std::map<std::string, std::map<int64_t, std::vector<TokenOutput>>> out;
    while (engine.HasWork()) {
      auto step = engine.Step();
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      for (const TokenOutput& t : *step) out[t.request_id][t.index].push_back(t);
    }
    EXPECT_EQ(engine.Stats().blocks_used, 0);
    return out;
  }

  static std::vector<int32_t> Ids(const std::vector<TokenOutput>& outputs) {
    std::vector<int32_t> ids;
    for (const TokenOutput& t : outputs) ids.push_back(t.token_id);
    return ids;
  }

  // The tokens of `request` run alone on a fresh engine.
  std::vector<int32_t> Alone(GenerationRequest request) {
    auto engine = MakeEngine();
    const std::string id = request.id;
    EXPECT_TRUE(engine->AddRequest(std::move(request)).ok());
    return Ids(Drain(*engine)[id][request.index_offset]);
  }

  std::unique_ptr<model::Tokenizer> tokenizer_;
};

TEST_F(EnginePenaltiesTest, GreedyPicksTheArgmaxOfThePenalizedLogits) {
  // Logprobs are the raw logits' log-softmax, so raw logit differences are logprob
  // differences: each greedy pick must beat every reported alternative once the output so far
  // is counted as the formula says.
  GenerationRequest r = Penalized(Request("g", 0.0));
  r.sampling.logprobs = 20;
  auto engine = MakeEngine();
  ASSERT_TRUE(engine->AddRequest(r).ok());
  const std::vector<TokenOutput> outs = Drain(*engine)["g"][0];
  ASSERT_EQ(outs.size(), 32u);
  std::map<int32_t, int> counts;
  auto score = [&](int32_t id, float logprob) {
    const int c = counts.count(id) ? counts[id] : 0;
    return logprob - 1.1 * c - (c > 0 ? 0.6 : 0.0);
  };
  int penalized_picks = 0;
  for (const TokenOutput& out : outs) {
    ASSERT_TRUE(out.logprob.has_value());
    const double chosen = score(out.token_id, *out.logprob);
    for (const TokenLogprob& alt : out.top_logprobs) {
      EXPECT_GE(chosen, score(alt.token_id, alt.logprob) - 1e-4)
          << "picked " << out.token_id << ", " << alt.token_id << " scores higher";
    }
    if (out.token_id != out.top_logprobs[0].token_id) ++penalized_picks;
    ++counts[out.token_id];
  }
  EXPECT_GT(penalized_picks, 0) << "the penalties never changed a pick";
  // Without penalties the same prompt decodes differently.
  EXPECT_NE(Ids(outs), Alone(Request("g", 0.0)));
}

TEST_F(EnginePenaltiesTest, ZeroPenaltiesAndNoBiasChangeNoToken) {
  for (double temperature : {0.0, 0.9}) {
    GenerationRequest zero = Request("z", temperature);
    zero.sampling.presence_penalty = 0;
    zero.sampling.frequency_penalty = 0;
    zero.sampling.logit_bias = {{17, 0.f}};
    EXPECT_EQ(Alone(zero), Alone(Request("z", temperature))) << temperature;
  }
}

TEST_F(EnginePenaltiesTest, SeededPenalizedRequestIsTheSameAloneAndInABatch) {
  GenerationRequest probe = Penalized(Request("probe", 1.0));
  probe.sampling.top_k = 50;
  probe.sampling.logit_bias = {{tokenizer_->Encode(" light")[0], -2.f}};
  const std::vector<int32_t> expected = Alone(probe);
  auto batch = MakeEngine();
  for (int i = 0; i < 7; ++i) {
    GenerationRequest other = Request(absl::StrCat("o", i), i % 2 ? 0.8 : 0.0);
    other.prompt.resize(3 + i);
    other.sampling.seed = i;
    other.sampling.frequency_penalty = 0.3 * i - 1.0;
    other.stopping.max_new_tokens = 5 + 3 * i;
    ASSERT_TRUE(batch->AddRequest(other).ok());
    if (i == 3) ASSERT_TRUE(batch->AddRequest(probe).ok());
  }
  EXPECT_EQ(Ids(Drain(*batch)["probe"][0]), expected);
}

TEST_F(EnginePenaltiesTest, ParallelSiblingsCountOnlyTheirOwnTokens) {
  // Sibling i of a seeded n = 3 request is the request alone with seed + i: were the counts
  // shared, the siblings would penalize each other's tokens and differ.
  GenerationRequest parallel = Penalized(Request("par", 0.9));
  parallel.n = 3;
  auto engine = MakeEngine();
  ASSERT_TRUE(engine->AddRequest(parallel).ok());
  auto by_index = Drain(*engine)["par"];
  ASSERT_EQ(by_index.size(), 3u);
  for (int64_t i = 0; i < 3; ++i) {
    GenerationRequest one = Penalized(Request("one", 0.9));
    one.sampling.seed = 31 + i;
    EXPECT_EQ(Ids(by_index[i]), Alone(one)) << "continuation " << i;
  }
}

TEST_F(EnginePenaltiesTest, ResumedContinuationRebuildsTheCounts) {
  for (double temperature : {0.0, 0.9}) {
    GenerationRequest r = Penalized(Request("r", temperature));
    r.sampling.repetition_penalty = 1.2;
    const std::vector<int32_t> full = Alone(r);
    ASSERT_EQ(full.size(), 32u);
    for (size_t k : {size_t{1}, size_t{7}, size_t{20}, size_t{31}}) {
      SCOPED_TRACE(absl::StrCat("temperature ", temperature, ", resumed after ", k));
      GenerationRequest resumed = r;
      resumed.resume_tokens.assign(full.begin(), full.begin() + k);
      std::vector<int32_t> joined(full.begin(), full.begin() + k);
      const std::vector<int32_t> rest = Alone(resumed);
      joined.insert(joined.end(), rest.begin(), rest.end());
      EXPECT_EQ(joined, full);
    }
  }
}

TEST_F(EnginePenaltiesTest, PlusHundredForcesATokenAndMinusHundredBansIt) {
  const int32_t forced = tokenizer_->Encode(" Egypt")[0];
  for (double temperature : {0.0, 1.0}) {
    GenerationRequest r = Request("f", temperature);
    r.sampling.logit_bias = {{forced, 100.f}};
    r.stopping.max_new_tokens = 12;
    EXPECT_EQ(Alone(r), std::vector<int32_t>(12, forced)) << temperature;
  }
  const std::vector<int32_t> greedy = Alone(Request("b", 0.0));
  for (double temperature : {0.0, 1.0}) {
    GenerationRequest r = Request("b", temperature);
    r.sampling.logit_bias = {{greedy[0], -100.f}, {greedy[1], -100.f}};
    const std::vector<int32_t> banned = Alone(r);
    EXPECT_EQ(std::count(banned.begin(), banned.end(), greedy[0]), 0) << temperature;
    EXPECT_EQ(std::count(banned.begin(), banned.end(), greedy[1]), 0) << temperature;
  }
}

TEST_F(EnginePenaltiesTest, RefusesBadPenaltyFieldsNamingThem) {
  auto engine = MakeEngine();
  GenerationRequest r = Request("bad", 0.0);
  r.sampling.logit_bias = {{kVocab, 1.f}};
  absl::Status s = engine->AddRequest(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "logit_bias: token id 4096 is outside the vocabulary [0, 4096)");
  r = Request("bad", 0.0);
  r.sampling.presence_penalty = 3;
  s = engine->AddRequest(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("presence_penalty"), std::string::npos) << s;
  EXPECT_FALSE(engine->HasWork());
}

}  // namespace
}  // namespace kvgrid::worker
