// Resuming a continuation elsewhere (the coordinator's failover): a request that carries the
// tokens already generated continues exactly as the uninterrupted run — same tokens, greedy
// and seeded, same text with nothing emitted twice — and bad resume fields are refused.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/tokenizer.h"
#include "worker/engine/engine.h"

namespace kvgrid::worker {
namespace {

const std::filesystem::path kModel = std::filesystem::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";

struct Generated {
  std::vector<int32_t> tokens;
  std::vector<std::string> texts;  // per output
  std::string finish;
};

class EngineResumeTest : public ::testing::Test {
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

  GenerationRequest Request(double temperature) {
    GenerationRequest r;
    r.id = "r";
    r.prompt = tokenizer_->Encode("And God said");
    r.sampling.temperature = temperature;
    r.sampling.seed = 77;
    r.stopping.max_new_tokens = 40;
    r.stopping.ignore_eos = true;
    r.stopping.stop_strings = {"Egypt"};
    return r;
  }

  Generated Generate(GenerationRequest request) {
    auto engine = MakeEngine();
    Generated run;
    EXPECT_TRUE(engine->AddRequest(std::move(request)).ok());
    while (engine->HasWork()) {
      auto step = engine->Step();
      EXPECT_TRUE(step.ok()) << step.status();
      if (!step.ok()) break;
      for (const TokenOutput& out : *step) {
        run.tokens.push_back(out.token_id);
        run.texts.push_back(out.text);
        if (out.finish != FinishReason::kNone) run.finish = FinishReasonName(out.finish);
      }
    }
    EXPECT_EQ(engine->Stats().blocks_used, 0);
    return run;
  }

  std::unique_ptr<model::Tokenizer> tokenizer_;
};

TEST_F(EngineResumeTest, ContinuesExactlyAfterAnyPrefix) {
  for (double temperature : {0.0, 0.9}) {
    const Generated full = Generate(Request(temperature));
    ASSERT_GE(full.tokens.size(), 4u);
    std::string full_text;
    for (const std::string& t : full.texts) full_text += t;
    for (size_t k : {size_t{1}, size_t{3}, full.tokens.size() / 2, full.tokens.size() - 1}) {
      SCOPED_TRACE("temperature " + std::to_string(temperature) + ", resumed after " +
                   std::to_string(k));
      GenerationRequest r = Request(temperature);
      r.resume_tokens.assign(full.tokens.begin(), full.tokens.begin() + k);
      const Generated rest = Generate(std::move(r));
      std::vector<int32_t> joined(full.tokens.begin(), full.tokens.begin() + k);
      joined.insert(joined.end(), rest.tokens.begin(), rest.tokens.end());
      EXPECT_EQ(joined, full.tokens);
      EXPECT_EQ(rest.finish, full.finish);
      // What the first worker streamed plus what the second one streams is the whole text.
      std::string text;
      for (size_t i = 0; i < k; ++i) text += full.texts[i];
      for (const std::string& t : rest.texts) text += t;
      EXPECT_EQ(text, full_text);
    }
  }
}

TEST_F(EngineResumeTest, IndexOffsetSeedsLikeTheSibling) {
  // Continuation i of an n > 1 request, resumed alone, draws from seed + i.
  GenerationRequest parallel = Request(0.9);
  parallel.n = 3;
  parallel.stopping.stop_strings.clear();
  auto engine = MakeEngine();
  ASSERT_TRUE(engine->AddRequest(parallel).ok());
  std::vector<std::vector<int32_t>> by_index(3);
  while (engine->HasWork()) {
    auto step = engine->Step();
    ASSERT_TRUE(step.ok());
    for (const TokenOutput& out : *step) by_index[out.index].push_back(out.token_id);
  }
  GenerationRequest single = Request(0.9);
  single.stopping.stop_strings.clear();
  single.index_offset = 2;
  single.resume_tokens.assign(by_index[2].begin(), by_index[2].begin() + 5);
  const Generated rest = Generate(single);
  std::vector<int32_t> joined(by_index[2].begin(), by_index[2].begin() + 5);
  joined.insert(joined.end(), rest.tokens.begin(), rest.tokens.end());
  EXPECT_EQ(joined, by_index[2]);
}

TEST_F(EngineResumeTest, RefusesBadResumeFields) {
  auto engine = MakeEngine();
  GenerationRequest r = Request(0.0);
  r.resume_tokens = {1, 2, 999999};
  absl::Status s = engine->AddRequest(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("resume_token_ids[2]"), std::string::npos) << s;

  r = Request(0.0);
  r.resume_tokens.assign(40, 5);  // all of max_new_tokens
  s = engine->AddRequest(r);
  EXPECT_NE(s.message().find("resume_token_ids"), std::string::npos) << s;

  r = Request(0.0);
  r.n = 2;
  r.resume_tokens = {5};
  s = engine->AddRequest(r);
  EXPECT_NE(s.message().find("n = 1"), std::string::npos) << s;
  EXPECT_FALSE(engine->HasWork());
}

}  // namespace
}  // namespace kvgrid::worker
