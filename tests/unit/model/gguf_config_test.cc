// ModelConfigFromGguf on small hand-written files: the llama.cpp hyperparameter keys, the
// defaults for optional ones, what the tensor directory implies (vocabulary, tied embeddings,
// q/k/v bias), and refusals that name the file and the key.
#include "model/gguf_config.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/model/gguf_test_writer.h"

namespace kvgrid::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kHidden = 8, kVocab = 5;

gguf_test::GgufTestWriter Llama(const std::string& arch = "llama") {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", arch);
  w.U32(arch + ".context_length", 128);
  w.U32(arch + ".embedding_length", kHidden);
  w.U32(arch + ".block_count", 2);
  w.U32(arch + ".feed_forward_length", 16);
  w.U32(arch + ".attention.head_count", 4);
  w.F32(arch + ".attention.layer_norm_rms_epsilon", 1e-5f);
  w.F32Tensor("token_embd.weight", {kHidden, kVocab}, std::vector<float>(kHidden * kVocab));
  return w;
}

absl::StatusOr<ModelConfig> ConfigOf(const gguf_test::GgufTestWriter& w,
                                     const std::string& name = "config.gguf") {
  auto file = GgufFile::Open(w.Write(name));
  if (!file.ok()) return file.status();
  return ModelConfigFromGguf(**file);
}

TEST(GgufConfigTest, ReadsHyperparametersAndDefaults) {
  auto c = ConfigOf(Llama());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->hidden_size, 8);
  EXPECT_EQ(c->intermediate_size, 16);
  EXPECT_EQ(c->num_hidden_layers, 2);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 4);  // head_count_kv absent: no grouping
  EXPECT_EQ(c->head_dim, 2);             // key_length absent: hidden / heads
  EXPECT_EQ(c->max_position_embeddings, 128);
  EXPECT_NEAR(c->rms_norm_eps, 1e-5, 1e-12);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->vocab_size, 5);             // token_embd.weight's rows
  EXPECT_TRUE(c->tie_word_embeddings);     // no output.weight
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_TRUE(c->eos_token_ids.empty());
}

TEST(GgufConfigTest, OptionalKeysAndTensors) {
  gguf_test::GgufTestWriter w = Llama("qwen2");
  w.U32("qwen2.attention.head_count_kv", 2);
  w.U32("qwen2.attention.key_length", 4);
  w.F32("qwen2.rope.freq_base", 1e6f);
  w.U32("tokenizer.ggml.bos_token_id", 3);
  w.U32("tokenizer.ggml.eos_token_id", 4);
  w.F32Tensor("output.weight", {kHidden, kVocab}, std::vector<float>(kHidden * kVocab));
  w.F32Tensor("blk.0.attn_q.bias", {kHidden}, std::vector<float>(kHidden));
  auto c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen2");
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 4);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_EQ(c->bos_token_id, 3);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(4));
}

TEST(GgufConfigTest, SlidingWindowAppliesToEveryLayer) {
  auto c = ConfigOf(Llama());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->KvWindow(), 0);
  gguf_test::GgufTestWriter w = Llama();
  w.U32("llama.attention.sliding_window", 24);
  c = ConfigOf(w, "window.gguf");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sliding_window, 24);
  EXPECT_EQ(c->LayerWindow(0), 24);
  EXPECT_EQ(c->LayerWindow(1), 24);
  EXPECT_EQ(c->KvWindow(), 24);
}

TEST(GgufConfigTest, OtherArchitecturesAreRefused) {
  auto c = ConfigOf(Llama("gemma"), "gemma.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(c.status().message(), HasSubstr("gemma.gguf: architecture 'gemma'"));
}

TEST(GgufConfigTest, RopeFreqsOfTheWrongLengthAreRefused) {
  gguf_test::GgufTestWriter w = Llama();  // head_dim 2: one frequency
  w.F32Tensor("rope_freqs.weight", {2}, {1.f, 1.f});
  auto c = ConfigOf(w);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("rope_freqs"));
}

TEST(GgufConfigTest, MissingKeyIsNamed) {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", "llama");
  w.U32("llama.embedding_length", kHidden);
  auto c = ConfigOf(w, "missing.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr("missing.gguf"));
  EXPECT_THAT(c.status().message(), HasSubstr("llama.feed_forward_length"));
}

TEST(GgufConfigTest, InconsistentHeadsAreRefused) {
  gguf_test::GgufTestWriter w = Llama();
  w.U32("llama.attention.head_count_kv", 3);  // 4 heads do not group over 3
  auto c = ConfigOf(w, "heads.gguf");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("heads.gguf: inconsistent hyperparameters"));
}

TEST(GgufConfigTest, EmbeddingOfTheWrongWidthIsRefused) {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", "llama");
  w.U32("llama.context_length", 128);
  w.U32("llama.embedding_length", kHidden + 1);
  w.U32("llama.block_count", 2);
  w.U32("llama.feed_forward_length", 16);
  w.U32("llama.attention.head_count", 3);
  w.F32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.F32Tensor("token_embd.weight", {kHidden, kVocab}, std::vector<float>(kHidden * kVocab));
  auto c = ConfigOf(w);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("token_embd.weight is not [vocab, 9]"));
}

// The finding: a token list shorter than the embedding, and ids past it, were accepted.
TEST(GgufConfigTest, TokenListOfAnotherLengthThanTheEmbeddingIsRefused) {
  gguf_test::GgufTestWriter w = Llama();
  w.StringArray("tokenizer.ggml.tokens", {"a", "b", "c"});
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("tokenizer.ggml.tokens has 3 entries but token_embd.weight has 5 rows"));
}

TEST(GgufConfigTest, StatedVocabSizeMustMatchTheEmbedding) {
  gguf_test::GgufTestWriter w = Llama();
  w.U32("llama.vocab_size", 7);
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("llama.vocab_size 7 differs"));
}

TEST(GgufConfigTest, SpecialIdsOutsideTheVocabularyAreRefused) {
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                          "tokenizer.ggml.padding_token_id"}) {
    gguf_test::GgufTestWriter w = Llama();
    w.StringArray("tokenizer.ggml.tokens", {"a", "b", "c", "d", "e"});
    w.U32(key, kVocab);
    absl::StatusOr<ModelConfig> c = ConfigOf(w);
    ASSERT_FALSE(c.ok()) << key;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(),
                HasSubstr(std::string(key) + " 5 is outside the vocabulary [0, 5)"));
  }
  gguf_test::GgufTestWriter w = Llama();
  w.U32("tokenizer.ggml.eos_token_id", kVocab - 1);
  absl::StatusOr<ModelConfig> c = ConfigOf(w);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(kVocab - 1));
}

}  // namespace
}  // namespace kvgrid::model
