#include "model/model_config.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvgrid::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// config.json texts as published with the checkpoints (fields the parser ignores included).
constexpr char kLlama3_8B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})json";

constexpr char kLlama31_8B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.3",
  "use_cache": true,
  "vocab_size": 128256
})json";

constexpr char kLlama2_7B[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})json";

constexpr char kQwen2_0_5B[] = R"json({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 131072,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

constexpr char kQwen25_7B[] = R"json({
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
})json";

constexpr char kMistral7B[] = R"json({
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})json";

// Mistral v0.3 style: head_dim and sliding_window written as null.
constexpr char kMistral7B_v03[] = R"json({
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "head_dim": null,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "vocab_size": 32768
})json";

// transformers v5 layout: rope settings folded into rope_parameters, `dtype` for torch_dtype.
constexpr char kLlama31RopeParameters[] = R"json({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "head_dim": 64,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "vocab_size": 128256
})json";

// A minimal valid config the error tests perturb one field at a time.
std::string Minimal(const std::string& extra = "") {
  std::string text = R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8)";
  if (!extra.empty()) text += ", " + extra;
  return text + "}";
}

void ExpectInvalid(const std::string& text, const std::string& substring) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text, "config.json");
  ASSERT_FALSE(config.ok()) << "accepted: " << text;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  EXPECT_THAT(std::string(config.status().message()), HasSubstr(substring));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("config.json: "));
}

TEST(ModelConfigTest, Llama3_8B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama3_8B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_THAT(c->architectures, ElementsAre("LlamaForCausalLM"));
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->mlp_bias);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001));
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->sliding_window, 0);
}

TEST(ModelConfigTest, Llama31_8BWithLlama3RopeScaling) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama31_8B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(128001, 128008, 128009));
}

TEST(ModelConfigTest, Llama2_7B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama2_7B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab_size, 32000);
  EXPECT_EQ(c->intermediate_size, 11008);
  EXPECT_EQ(c->num_key_value_heads, 32);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);  // absent: the Llama default
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->torch_dtype, "float16");
}

TEST(ModelConfigTest, Qwen2_0_5B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen2_0_5B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 896);
  EXPECT_EQ(c->num_attention_heads, 14);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->num_hidden_layers, 24);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_TRUE(c->attention_bias);   // Qwen2 always has q/k/v bias
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window: false
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151643));
}

TEST(ModelConfigTest, Qwen25_7B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen25_7B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab_size, 152064);
  EXPECT_EQ(c->hidden_size, 3584);
  EXPECT_EQ(c->intermediate_size, 18944);
  EXPECT_EQ(c->num_attention_heads, 28);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 32768);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645));
}

TEST(ModelConfigTest, Qwen2BiasIsForcedEvenWhenTheFileSaysFalse) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": false})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->max_position_embeddings, 32768);  // Qwen2 default
}

TEST(ModelConfigTest, Mistral7B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kMistral7B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "mistral");
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
}

TEST(ModelConfigTest, MistralWindowSlidesEveryLayer) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kMistral7B, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->sliding_layers.size(), 32u);
  for (int64_t layer = 0; layer < 32; ++layer) EXPECT_EQ(c->LayerWindow(layer), 4096);
  EXPECT_EQ(c->KvWindow(), 4096);
}

// Qwen2: the window is off unless use_sliding_window, then on for layers >= max_window_layers
// (default 28); layer_types, where present, decides.
TEST(ModelConfigTest, Qwen2SlidingLayers) {
  auto parse = [](const std::string& extra) {
    return ParseModelConfig(
        std::string(R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 16,
                        "intermediate_size": 32, "num_hidden_layers": 4,
                        "num_attention_heads": 2, "sliding_window": 64)") +
            extra + "}",
        "config.json");
  };
  absl::StatusOr<ModelConfig> c = parse("");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 0);  // use_sliding_window defaults to false
  EXPECT_EQ(c->KvWindow(), 0);
  c = parse(R"(, "use_sliding_window": true, "max_window_layers": 2)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 64);
  EXPECT_EQ(c->LayerWindow(0), 0);
  EXPECT_EQ(c->LayerWindow(1), 0);
  EXPECT_EQ(c->LayerWindow(2), 64);
  EXPECT_EQ(c->LayerWindow(3), 64);
  EXPECT_EQ(c->KvWindow(), 0);  // mixed: the KV is not bounded
  c = parse(R"(, "use_sliding_window": true, "max_window_layers": 0)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->KvWindow(), 64);
  c = parse(R"(, "use_sliding_window": true)");  // max_window_layers 28 >= 4 layers: none
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_TRUE(c->sliding_layers.empty());
  c = parse(R"(, "use_sliding_window": true, "layer_types": ["full_attention",
             "sliding_attention", "full_attention", "sliding_attention"])");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->LayerWindow(0), 0);
  EXPECT_EQ(c->LayerWindow(1), 64);
  EXPECT_EQ(c->LayerWindow(2), 0);
  EXPECT_EQ(c->LayerWindow(3), 64);
  c = parse(R"(, "use_sliding_window": true, "layer_types": ["full_attention"])");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message()).find("layer_types"), std::string::npos);
  c = parse(R"(, "use_sliding_window": true, "layer_types": ["a", "b", "c", "d"])");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message()).find("layer_types[0]"), std::string::npos);
}

TEST(ModelConfigTest, Mistral7BV03WithNullHeadDimAndWindow) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kMistral7B_v03, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->vocab_size, 32768);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
}

TEST(ModelConfigTest, RopeParametersLlama3) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kLlama31RopeParameters, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, RopeParametersDefault) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(R"("rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0})"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(ModelConfigTest, RopeParametersWinOverLegacyKeys) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(R"("rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                 "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0})"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 20000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(ModelConfigTest, RopeParametersWithoutThetaFallsBackToLegacyTheta) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(R"("rope_theta": 123.0, "rope_parameters": {"rope_type": "default"})"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 123.0);
}

TEST(ModelConfigTest, LinearScalingWithLegacyTypeKey) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(R"("rope_scaling": {"type": "linear", "factor": 2.0})"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 2.0);
}

TEST(ModelConfigTest, DefaultsForOptionalFields) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(Minimal(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_EQ(c->torch_dtype, "");
  EXPECT_TRUE(c->architectures.empty());
}

TEST(ModelConfigTest, NullMeansDefault) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      Minimal(R"("num_key_value_heads": null, "head_dim": null, "eos_token_id": null,
                 "bos_token_id": null, "rope_scaling": null, "torch_dtype": null)"),
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->bos_token_id, -1);
}

TEST(ModelConfigTest, HeadDimIndependentOfHiddenSize) {
  // Mistral-Nemo / Qwen3 shape: hidden_size != heads * head_dim.
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Minimal(R"("head_dim": 16, "num_key_value_heads": 2)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->hidden_size, 64);
}

TEST(ModelConfigTest, ModelTypeInferredFromArchitectures) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(
      R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 16,
          "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_TRUE(c->attention_bias);
}

TEST(ModelConfigTest, IntegralFloatsAreAcceptedForIntegers) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Minimal(R"("max_position_embeddings": 4096.0)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 4096);
}

TEST(ModelConfigTest, KvHeadsMustDivideHeads) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig(Minimal(R"("num_key_value_heads": 3)"), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(),
            "config.json: num_key_value_heads: 3 does not divide num_attention_heads 8");
}

TEST(ModelConfigTest, RejectsBadSizes) {
  ExpectInvalid(Minimal(R"("num_key_value_heads": 0)"), "num_key_value_heads: 0 must be positive");
  ExpectInvalid(Minimal(R"("head_dim": 0)"), "head_dim: 0 must be positive");
  ExpectInvalid(Minimal(R"("head_dim": 15)"), "head_dim: 15 must be even");
  ExpectInvalid(Minimal(R"("max_position_embeddings": -1)"), "max_position_embeddings: -1");
  ExpectInvalid(R"({"model_type": "llama", "vocab_size": 0, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8})",
                "vocab_size: 0 must be positive");
  ExpectInvalid(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 60,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8})",
                "hidden_size: 60 is not divisible by num_attention_heads 8");
  ExpectInvalid(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
      "num_key_value_heads": 8, "head_dim": 9})",
                "head_dim: 9 must be even");
}

TEST(ModelConfigTest, RejectsMissingRequiredFields) {
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads"}) {
    std::string text = Minimal();
    const size_t at = text.find(std::string("\"") + field + "\"");
    ASSERT_NE(at, std::string::npos);
    // Rename the key so that the field is missing but the JSON stays valid.
    text.replace(at, 1, "\"x_");
    ExpectInvalid(text, std::string(field) + ": missing");
  }
}

TEST(ModelConfigTest, RejectsWrongTypes) {
  ExpectInvalid(R"({"model_type": "llama", "vocab_size": "100", "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8})",
                "vocab_size: expected an integer, got string");
  ExpectInvalid(Minimal(R"("max_position_embeddings": 4096.5)"),
                "max_position_embeddings: expected an integer");
  ExpectInvalid(Minimal(R"("rms_norm_eps": "1e-5")"), "rms_norm_eps: expected a number");
  ExpectInvalid(Minimal(R"("tie_word_embeddings": 1)"),
                "tie_word_embeddings: expected true or false");
  ExpectInvalid(Minimal(R"("eos_token_id": [1, "2"])"), "eos_token_id: expected an integer");
  ExpectInvalid(Minimal(R"("eos_token_id": -5)"), "eos_token_id: token id -5 is negative");
  ExpectInvalid(Minimal(R"("bos_token_id": -1)"), "bos_token_id");
  ExpectInvalid(Minimal(R"("architectures": "LlamaForCausalLM")"),
                "architectures: expected a list");
  ExpectInvalid(Minimal(R"("rope_scaling": 8)"), "rope_scaling: expected an object or null");
  ExpectInvalid(Minimal(R"("rope_parameters": [1])"), "rope_parameters: expected an object");
  ExpectInvalid(Minimal(R"("max_position_embeddings": 18446744073709551615)"),
                "max_position_embeddings: 18446744073709551615 is out of range");
}

TEST(ModelConfigTest, RejectsBadNumbers) {
  ExpectInvalid(Minimal(R"("rms_norm_eps": 0)"), "rms_norm_eps: 0 must be positive");
  ExpectInvalid(Minimal(R"("rms_norm_eps": -1e-6)"), "rms_norm_eps");
  ExpectInvalid(Minimal(R"("rope_theta": 0)"), "rope_theta: 0 must be positive");
  ExpectInvalid(Minimal(R"("rope_parameters": {"rope_type": "default", "rope_theta": -1})"),
                "rope_parameters.rope_theta");
}

TEST(ModelConfigTest, RejectsUnsupportedModels) {
  ExpectInvalid(R"({"model_type": "gpt2", "vocab_size": 10})",
                "model_type: unsupported model type \"gpt2\"");
  ExpectInvalid(R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})",
                "model_type: missing");
  ExpectInvalid(Minimal(R"("hidden_act": "gelu")"), "hidden_act: unsupported activation \"gelu\"");
}

TEST(ModelConfigTest, RejectsBadRopeScaling) {
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "longrope", "factor": 4.0})"),
                "rope_scaling.rope_type: unsupported RoPE scaling type \"longrope\"");
  ExpectInvalid(Minimal(R"("rope_scaling": {"type": "su", "factor": 4.0})"),
                "rope_scaling.type: unsupported RoPE scaling type \"su\"");
  ExpectInvalid(Minimal(R"("rope_scaling": {"factor": 4.0})"), "rope_scaling.rope_type: missing");
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "linear"})"),
                "rope_scaling.factor: missing");
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "linear", "factor": 0})"),
                "rope_scaling.factor: 0 must be positive");
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"),
                "rope_scaling.low_freq_factor: missing");
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                  "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192})"),
                "rope_scaling.high_freq_factor: 4 must be greater than low_freq_factor 4");
  ExpectInvalid(Minimal(R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 0})"),
                "rope_scaling.original_max_position_embeddings: 0 must be positive");
  ExpectInvalid(Minimal(R"("rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4})"),
                "rope_parameters.rope_type: unsupported");
}

TEST(ModelConfigTest, AwqAndGptqQuantizationConfigs) {
  // As written by transformers for AutoAWQ and for GPTQ (optimum) checkpoints.
  absl::StatusOr<ModelConfig> awq = ParseModelConfig(
      Minimal(R"("quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert":
          null, "quant_method": "awq", "version": "gemm", "zero_point": true})"),
      "config.json");
  ASSERT_TRUE(awq.ok()) << awq.status();
  EXPECT_EQ(awq->quantization.method, QuantMethod::kAwq);
  EXPECT_EQ(awq->quantization.group_size, 128);
  absl::StatusOr<ModelConfig> autoawq = ParseModelConfig(
      Minimal(R"("quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64})"),
      "config.json");
  ASSERT_TRUE(autoawq.ok()) << autoawq.status();
  EXPECT_EQ(autoawq->quantization.group_size, 64);
  absl::StatusOr<ModelConfig> gptq = ParseModelConfig(
      Minimal(R"("quantization_config": {"bits": 4, "damp_percent": 0.01, "desc_act": true,
          "group_size": -1, "quant_method": "gptq", "static_groups": false, "sym": true,
          "true_sequential": true})"),
      "config.json");
  ASSERT_TRUE(gptq.ok()) << gptq.status();
  EXPECT_EQ(gptq->quantization.method, QuantMethod::kGptq);
  EXPECT_EQ(gptq->quantization.group_size, -1);
  EXPECT_TRUE(gptq->quantization.desc_act);
  EXPECT_TRUE(gptq->quantization.zeros_minus_one);
  absl::StatusOr<ModelConfig> v2 = ParseModelConfig(
      Minimal(R"("quantization_config": {"bits": 4, "group_size": 32, "quant_method": "gptq",
          "checkpoint_format": "gptq_v2"})"),
      "config.json");
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_FALSE(v2->quantization.zeros_minus_one);
  EXPECT_FALSE(ParseModelConfig(Minimal(), "config.json")->quantization.quantized());
}

TEST(ModelConfigTest, RejectsUnsupportedQuantization) {
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "fp8"})"),
                "quantization_config.quant_method: \"fp8\" (supported: awq, gptq)");
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "gptq", "bits": 8,
                  "group_size": 128})"),
                "quantization_config.bits: 8: only 4-bit is supported");
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "awq", "bits": 4,
                  "group_size": 16})"),
                "quantization_config.group_size: 16: kvgrid needs a positive multiple of 32");
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "awq", "bits": 4,
                  "group_size": -1})"),
                "quantization_config.group_size: -1");
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "awq", "bits": 4,
                  "group_size": 128, "version": "gemv"})"),
                "quantization_config.version: \"gemv\" (supported: gemm)");
  ExpectInvalid(Minimal(R"("quantization_config": {"quant_method": "gptq", "bits": 4})"),
                "quantization_config.group_size: missing");
  ExpectInvalid(Minimal(R"("quantization_config": [4])"), "quantization_config: expected an object");
}

TEST(ModelConfigTest, MalformedJsonNamesThePosition) {
  absl::StatusOr<ModelConfig> c =
      ParseModelConfig("{\n  \"vocab_size\": 10,\n  \"hidden_size\": }", "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("config.json: malformed JSON"));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("line 3, column"));

  ExpectInvalid("", "malformed JSON");
  ExpectInvalid("[1, 2]", "expected a JSON object at the top level, got array");
}

TEST(ModelConfigTest, LoadFromDirectoryAndFile) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "model_config_test_load";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "config.json");
    out << kQwen2_0_5B;
  }
  absl::StatusOr<ModelConfig> from_dir = LoadModelConfig(dir);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  EXPECT_EQ(from_dir->hidden_size, 896);
  absl::StatusOr<ModelConfig> from_file = LoadModelConfig(dir / "config.json");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->vocab_size, 151936);

  {
    std::ofstream out(dir / "config.json");
    out << Minimal(R"("num_key_value_heads": 3)");
  }
  absl::StatusOr<ModelConfig> bad = LoadModelConfig(dir);
  ASSERT_FALSE(bad.ok());
  // Errors name the real path of the file.
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr((dir / "config.json").string() + ": num_key_value_heads"));

  absl::StatusOr<ModelConfig> missing = LoadModelConfig(dir / "nowhere");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

TEST(ModelConfigTest, ServedModelNameIgnoresTrailingSlashesAndDots) {
  EXPECT_EQ(ServedModelName("models/kjv-tiny"), "kjv-tiny");
  EXPECT_EQ(ServedModelName("models/kjv-tiny/"), "kjv-tiny");
  EXPECT_EQ(ServedModelName("models/kjv-tiny//"), "kjv-tiny");
  EXPECT_EQ(ServedModelName("models/kjv-tiny/."), "kjv-tiny");
  EXPECT_EQ(ServedModelName("/srv/q/model.gguf"), "model.gguf");
  EXPECT_EQ(ServedModelName("."), std::filesystem::current_path().filename().string());
  // The Hugging Face cache's layout: the repo's name, not the revision.
  EXPECT_EQ(ServedModelName("/h/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de289a04d12/"),
            "Qwen3-0.6B");
  EXPECT_EQ(ServedModelName("hub/models--gpt2/snapshots/607a30d783dfa663"), "gpt2");
  EXPECT_EQ(ServedModelName("/srv/snapshots/v1"), "v1");
  EXPECT_EQ(ServedModelName("/srv/models--/snapshots/v1"), "v1");
}

// Ids the embedding has no row for are refused naming the field; ids inside it (and the old
// conversions' pad_token_id of -1) load.
TEST(ModelConfigTest, TokenIdsOutsideTheVocabularyAreRefused) {
  ExpectInvalid(Minimal(R"("eos_token_id": 100)"), "eos_token_id: token id 100 is outside");
  ExpectInvalid(Minimal(R"("eos_token_id": [2, 150])"), "eos_token_id: token id 150 is outside");
  ExpectInvalid(Minimal(R"("bos_token_id": 100)"), "bos_token_id: token id 100 is outside");
  ExpectInvalid(Minimal(R"("pad_token_id": 1000)"), "pad_token_id: token id 1000 is outside");
  absl::StatusOr<ModelConfig> ok = ParseModelConfig(
      Minimal(R"("eos_token_id": [98, 99], "bos_token_id": 0, "pad_token_id": -1)"),
      "config.json");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_THAT(ok->eos_token_ids, ElementsAre(98, 99));
}

}  // namespace
}  // namespace kvgrid::model
