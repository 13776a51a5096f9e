// Qwen3 and the RoPE scaling types in config.json and in GGUF metadata: each type's keys and
// defaults, the context window they extend, head_dim independent of hidden_size, and refusals
// that name the field (config.json) or the file and key (GGUF).
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_config.h"
#include "model/model_config.h"
#include "tests/unit/model/gguf_test_writer.h"

namespace kvgrid::model {
namespace {

using ::testing::HasSubstr;

// Qwen/Qwen3-0.6B's config.json as published.
constexpr char kQwen3_0_6B[] = R"json({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

// A small llama config with `extra` spliced in.
std::string Llama(const std::string& extra) {
  return R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
             "max_position_embeddings": 4096)" +
         (extra.empty() ? "" : ", " + extra) + "}";
}

absl::StatusOr<ModelConfig> Parse(const std::string& json) {
  return ParseModelConfig(json, "config.json");
}

void ExpectInvalid(const std::string& json, const std::string& fragment) {
  absl::StatusOr<ModelConfig> c = Parse(json);
  ASSERT_FALSE(c.ok()) << json;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("config.json: "));
  EXPECT_THAT(c.status().message(), HasSubstr(fragment));
}

TEST(Qwen3ConfigTest, Qwen3_0_6B) {
  absl::StatusOr<ModelConfig> c = Parse(kQwen3_0_6B);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);  // unlike Qwen2, no q/k/v bias
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_EQ(c->num_attention_heads, 16);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // not 1024 / 16
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->sliding_window, 0);
}

TEST(Qwen3ConfigTest, ModelTypeFromArchitectureAndDefaults) {
  absl::StatusOr<ModelConfig> c = Parse(R"({"architectures": ["Qwen3ForCausalLM"],
      "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 2, "head_dim": 24})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 24);
  EXPECT_EQ(c->max_position_embeddings, 32768);
  // Without head_dim, Qwen3's is transformers' default, not hidden / heads.
  c = Parse(R"({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 16,
      "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  // Other families have no q/k norm.
  c = Parse(Llama(""));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->qk_norm);
}

TEST(RopeScalingConfigTest, YarnAsQwen25DocumentsIt) {
  // Qwen2.5's model card: add this to config.json for 128K tokens.
  absl::StatusOr<ModelConfig> c = Parse(Llama(
      R"("max_position_embeddings": 32768, "rope_scaling": {"factor": 4.0,
         "original_max_position_embeddings": 32768, "type": "yarn"})"));
  ASSERT_TRUE(c.ok()) << c.status();
  const RopeScaling& s = c->rope_scaling;
  EXPECT_EQ(s.type, RopeScalingType::kYarn);
  EXPECT_DOUBLE_EQ(s.factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(s.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(s.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(s.attention_factor, 0.0);  // derived from factor
  EXPECT_TRUE(s.truncate);
  EXPECT_EQ(c->max_position_embeddings, 131072);  // original * factor
}

TEST(RopeScalingConfigTest, YarnOptionalKeys) {
  absl::StatusOr<ModelConfig> c = Parse(Llama(
      R"("rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
         "attention_factor": 1.5, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": false})"));
  ASSERT_TRUE(c.ok()) << c.status();
  const RopeScaling& s = c->rope_scaling;
  EXPECT_DOUBLE_EQ(s.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(s.beta_slow, 2.0);
  EXPECT_DOUBLE_EQ(s.attention_factor, 1.5);
  EXPECT_DOUBLE_EQ(s.mscale, 1.0);
  EXPECT_DOUBLE_EQ(s.mscale_all_dim, 0.5);
  EXPECT_FALSE(s.truncate);
  // No original_max_position_embeddings: config.json's max_position_embeddings.
  EXPECT_EQ(s.original_max_position_embeddings, 4096);
  EXPECT_EQ(c->max_position_embeddings, 4096 * 8);
  // Null betas mean the defaults, as in transformers.
  c = Parse(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": null})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_fast, 32.0);
}

TEST(RopeScalingConfigTest, YarnInRopeParameters) {
  absl::StatusOr<ModelConfig> c = Parse(Llama(
      R"("rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
         "original_max_position_embeddings": 1024})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kYarn);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 1024);
  // original * factor is below the file's window, which stays.
  EXPECT_EQ(c->max_position_embeddings, 4096);
}

TEST(RopeScalingConfigTest, DynamicAndLinearExtendTheWindow) {
  absl::StatusOr<ModelConfig> c =
      Parse(Llama(R"("rope_scaling": {"type": "dynamic", "factor": 2.0})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kDynamic);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  c = Parse(Llama(R"("rope_scaling": {"rope_type": "dynamic", "factor": 4.0,
                     "original_max_position_embeddings": 2048})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 2048);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  c = Parse(Llama(R"("rope_scaling": {"rope_type": "linear", "factor": 2.0})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  // llama3 configs already state the extended window.
  c = Parse(Llama(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 1024})"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 4096);
}

TEST(RopeScalingConfigTest, ErrorsNameTheField) {
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn"})"),
                "rope_scaling.factor: missing (required by yarn scaling)");
  ExpectInvalid(Llama(R"("rope_scaling": {"type": "dynamic"})"),
                "rope_scaling.factor: missing (required by dynamic scaling)");
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": -2})"),
                "rope_scaling.factor: -2 must be positive");
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": 2,
                         "beta_fast": 1, "beta_slow": 4})"),
                "rope_scaling.beta_fast: 1 must be greater than beta_slow 4");
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": 2, "truncate": 1})"),
                "rope_scaling.truncate: expected true or false");
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": 2,
                         "original_max_position_embeddings": 0})"),
                "rope_scaling.original_max_position_embeddings: 0 must be positive");
  ExpectInvalid(Llama(R"("rope_scaling": {"rope_type": "yarn", "factor": 2,
                         "attention_factor": "big"})"),
                "rope_scaling.attention_factor: expected a number");
  for (const char* type : {"longrope", "su", "mrope"}) {
    const std::string json =
        Llama(std::string(R"("rope_scaling": {"type": ")") + type + R"(", "factor": 2.0})");
    ExpectInvalid(json, absl::StrCat("rope_scaling.type: unsupported RoPE scaling type \"",
                                     type, "\""));
    ExpectInvalid(json, "(supported: default, linear, dynamic, yarn, llama3)");
  }
}

TEST(RopeScalingConfigTest, ScaledContextLengthIsCapped) {
  RopeScaling s;
  s.type = RopeScalingType::kLinear;
  s.factor = 1e9;
  EXPECT_EQ(ScaledContextLength(s, 4096), int64_t{1} << 24);
  s.type = RopeScalingType::kNone;
  EXPECT_EQ(ScaledContextLength(s, 4096), 4096);
}

// --- GGUF -----------------------------------------------------------------------------

constexpr uint64_t kHidden = 16, kVocab = 5;

gguf_test::GgufTestWriter Gguf(const std::string& arch) {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", arch);
  w.U32(arch + ".context_length", 4096);
  w.U32(arch + ".embedding_length", kHidden);
  w.U32(arch + ".block_count", 2);
  w.U32(arch + ".feed_forward_length", 32);
  w.U32(arch + ".attention.head_count", 4);
  w.U32(arch + ".attention.head_count_kv", 2);
  w.F32(arch + ".attention.layer_norm_rms_epsilon", 1e-6f);
  w.F32Tensor("token_embd.weight", {kHidden, kVocab}, std::vector<float>(kHidden * kVocab));
  return w;
}

absl::StatusOr<ModelConfig> FromGguf(const gguf_test::GgufTestWriter& w,
                                     const std::string& name) {
  auto file = GgufFile::Open(w.Write(name));
  if (!file.ok()) return file.status();
  return ModelConfigFromGguf(**file);
}

TEST(GgufRopeConfigTest, Qwen3WithItsOwnHeadDim) {
  gguf_test::GgufTestWriter w = Gguf("qwen3");
  w.U32("qwen3.attention.key_length", 8);
  w.U32("qwen3.attention.value_length", 8);
  auto c = FromGguf(w, "qwen3.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 8);  // hidden / heads would be 4
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(GgufRopeConfigTest, ValueLengthMustEqualKeyLength) {
  gguf_test::GgufTestWriter w = Gguf("qwen3");
  w.U32("qwen3.attention.key_length", 8);
  w.U32("qwen3.attention.value_length", 16);
  auto c = FromGguf(w, "vlen.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(), HasSubstr("vlen.gguf: qwen3.attention.value_length 16"));
}

TEST(GgufRopeConfigTest, OddKeyLengthIsRefused) {
  gguf_test::GgufTestWriter w = Gguf("llama");
  w.U32("llama.attention.key_length", 7);
  auto c = FromGguf(w, "odd.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("odd.gguf: llama.attention.key_length: 7"));
}

TEST(GgufRopeConfigTest, YarnKeys) {
  gguf_test::GgufTestWriter w = Gguf("qwen2");
  w.String("qwen2.rope.scaling.type", "yarn");
  w.F32("qwen2.rope.scaling.factor", 4.f);
  w.U32("qwen2.rope.scaling.original_context_length", 1024);
  auto c = FromGguf(w, "yarn.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  const RopeScaling& s = c->rope_scaling;
  EXPECT_EQ(s.type, RopeScalingType::kYarn);
  EXPECT_DOUBLE_EQ(s.factor, 4.0);
  EXPECT_EQ(s.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(s.beta_fast, 32.0);  // llama.cpp's defaults
  EXPECT_DOUBLE_EQ(s.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(s.attention_factor, 0.0);
  EXPECT_EQ(c->max_position_embeddings, 4096);  // 1024 * 4 is not larger

  gguf_test::GgufTestWriter w2 = Gguf("qwen2");
  w2.String("qwen2.rope.scaling.type", "yarn");
  w2.F32("qwen2.rope.scaling.factor", 4.f);
  w2.U32("qwen2.rope.scaling.original_context_length", 4096);
  w2.F32("qwen2.rope.scaling.yarn_beta_fast", 16.f);
  w2.F32("qwen2.rope.scaling.yarn_attn_factor", 1.25f);
  w2.F32("qwen2.rope.scaling.attn_factor", 2.f);
  c = FromGguf(w2, "yarn2.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_scaling.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.attention_factor, 2.5);
  EXPECT_EQ(c->max_position_embeddings, 16384);
}

TEST(GgufRopeConfigTest, LinearAndUnsupportedTypes) {
  gguf_test::GgufTestWriter w = Gguf("llama");
  w.String("llama.rope.scaling.type", "linear");
  w.F32("llama.rope.scaling.factor", 2.f);
  auto c = FromGguf(w, "linear.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
  EXPECT_EQ(c->max_position_embeddings, 8192);

  gguf_test::GgufTestWriter untyped = Gguf("llama");  // llama.cpp: a bare factor is linear
  untyped.F32("llama.rope.scaling.factor", 4.f);
  c = FromGguf(untyped, "untyped.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 4.0);

  gguf_test::GgufTestWriter lr = Gguf("llama");
  lr.String("llama.rope.scaling.type", "longrope");
  c = FromGguf(lr, "longrope.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(),
              HasSubstr("longrope.gguf: llama.rope.scaling.type 'longrope' (supported: none, "
                        "linear, yarn)"));

  gguf_test::GgufTestWriter bad = Gguf("llama");
  bad.String("llama.rope.scaling.type", "yarn");
  bad.F32("llama.rope.scaling.factor", -1.f);
  c = FromGguf(bad, "badfactor.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("badfactor.gguf: llama.rope.scaling.factor"));
}

TEST(GgufRopeConfigTest, RopeFreqsAreTheDivisors) {
  gguf_test::GgufTestWriter w = Gguf("llama");  // head_dim 4: two frequencies
  w.F32Tensor("rope_freqs.weight", {2}, {1.f, 8.f});
  auto c = FromGguf(w, "freqs.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_EQ(c->rope_scaling.freq_divisors, (std::vector<double>{1.0, 8.0}));

  gguf_test::GgufTestWriter wrong = Gguf("llama");
  wrong.F32Tensor("rope_freqs.weight", {3}, {1.f, 2.f, 3.f});
  c = FromGguf(wrong, "wrong.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("wrong.gguf: rope_freqs.weight must be F32 [2]"));

  gguf_test::GgufTestWriter zero = Gguf("llama");
  zero.F32Tensor("rope_freqs.weight", {2}, {1.f, 0.f});
  c = FromGguf(zero, "zero.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("zero.gguf: rope_freqs.weight[1]"));
}

}  // namespace
}  // namespace kvgrid::model
