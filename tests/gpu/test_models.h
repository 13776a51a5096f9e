// Test helpers for the gpu tests of the whole model: a small random Qwen2-like config, the
// trained models/kjv-tiny, and the greedy tokens of a fixed mixed batch through an engine.
#ifndef KVGRID_TESTS_GPU_TEST_MODELS_H_
#define KVGRID_TESTS_GPU_TEST_MODELS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/model_config.h"
#include "worker/engine/engine.h"

namespace kvgrid::testing {

// Qwen2-shaped (q/k/v bias, tied head, 4 heads over 2 KV heads of 64), two layers.
inline model::ModelConfig TinyQwen(int64_t vocab = 512) {
  model::ModelConfig c;
  c.model_type = "qwen2";
  c.vocab_size = vocab;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = true;
  c.attention_bias = true;
  return c;
}

// models/kjv-tiny in the repository at $KVGRID_SOURCE_DIR, else the build's source directory.
inline std::filesystem::path KjvTiny() {
  const char* env = std::getenv("KVGRID_SOURCE_DIR");
  return std::filesystem::path(env != nullptr ? env : KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";
}

// Four greedy requests of `max_new_tokens` new tokens each (kjv-tiny token ids), stepped to
// the end; the tokens by request id. Fails the test if a step fails or a KV block is left held.
inline std::map<std::string, std::vector<int32_t>> Greedy(worker::Engine& engine,
                                                          int64_t max_new_tokens = 12) {
  const std::vector<std::vector<int32_t>> prompts = {
      {258, 900, 44}, {267, 309, 297, 336}, {259, 402}, {368, 287, 258, 1016, 268}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    worker::GenerationRequest r;
    r.id = absl::StrCat("r", i);
    r.prompt = prompts[i];
    r.sampling.temperature = 0;
    r.stopping.max_new_tokens = max_new_tokens;
    r.stopping.ignore_eos = true;
    EXPECT_TRUE(engine.AddRequest(std::move(r)).ok());
  }
  std::map<std::string, std::vector<int32_t>> out;
  for (int guard = 0; engine.HasWork() && guard < 1000; ++guard) {
    auto step = engine.Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    for (const worker::TokenOutput& t : *step) out[t.request_id].push_back(t.token_id);
  }
  EXPECT_EQ(engine.Stats().blocks_free, engine.Stats().blocks_total) << "KV blocks leaked";
  return out;
}

// Steps of logits `got` within `tolerance` of `want`, relative to each step's largest
// magnitude (at least 1).
inline void ExpectClose(const std::vector<std::vector<float>>& got,
                        const std::vector<std::vector<float>>& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size()) << "step " << s;
    double worst = 0, magnitude = 0;
    for (size_t i = 0; i < want[s].size(); ++i) {
      worst = std::max(worst, std::fabs(double{got[s][i]} - want[s][i]));
      magnitude = std::max(magnitude, std::fabs(double{want[s][i]}));
    }
    EXPECT_LE(worst, tolerance * std::max(1.0, magnitude)) << "step " << s;
  }
}

}  // namespace kvgrid::testing

#endif  // KVGRID_TESTS_GPU_TEST_MODELS_H_
