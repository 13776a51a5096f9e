#include "model/generation_config.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvgrid::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

void ExpectInvalid(const std::string& text, const std::string& substring) {
  absl::StatusOr<GenerationConfig> config = ParseGenerationConfig(text, "generation_config.json");
  ASSERT_FALSE(config.ok()) << "accepted: " << text;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("generation_config.json: " + substring));
}

TEST(GenerationConfigTest, Llama31Instruct) {
  absl::StatusOr<GenerationConfig> g = ParseGenerationConfig(R"({
    "bos_token_id": 128000,
    "do_sample": true,
    "eos_token_id": [128001, 128008, 128009],
    "temperature": 0.6,
    "top_p": 0.9,
    "transformers_version": "4.42.3"
  })",
                                                             "generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_EQ(g->bos_token_id, 128000);
  EXPECT_EQ(g->do_sample, true);
  EXPECT_DOUBLE_EQ(g->temperature.value(), 0.6);
  EXPECT_DOUBLE_EQ(g->top_p.value(), 0.9);
  EXPECT_FALSE(g->top_k.has_value());
  EXPECT_FALSE(g->min_p.has_value());
  EXPECT_FALSE(g->repetition_penalty.has_value());
  EXPECT_FALSE(g->max_new_tokens.has_value());
}

TEST(GenerationConfigTest, Qwen25Instruct) {
  absl::StatusOr<GenerationConfig> g = ParseGenerationConfig(R"({
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": true,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0"
  })",
                                                             "generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->eos_token_ids, ElementsAre(151645, 151643));
  EXPECT_EQ(g->top_k, 20);
  EXPECT_DOUBLE_EQ(g->repetition_penalty.value(), 1.05);
  EXPECT_DOUBLE_EQ(g->temperature.value(), 0.7);
}

TEST(GenerationConfigTest, Llama2WithScalarEosAndUnknownKeys) {
  absl::StatusOr<GenerationConfig> g = ParseGenerationConfig(R"({
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_length": 4096,
    "temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 512,
    "transformers_version": "4.31.0.dev0"
  })",
                                                             "generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(g->bos_token_id, 1);
  EXPECT_DOUBLE_EQ(g->min_p.value(), 0.05);
  EXPECT_EQ(g->max_new_tokens, 512);
  EXPECT_FALSE(g->do_sample.has_value());
}

TEST(GenerationConfigTest, EmptyObjectAndNullsLeaveEverythingUnset) {
  absl::StatusOr<GenerationConfig> g = ParseGenerationConfig(
      R"({"eos_token_id": null, "temperature": null, "top_k": null})", "generation_config.json");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->eos_token_ids.empty());
  EXPECT_FALSE(g->temperature.has_value());
  EXPECT_FALSE(g->top_k.has_value());
  EXPECT_TRUE(ParseGenerationConfig("{}", "generation_config.json").ok());
}

TEST(GenerationConfigTest, RejectsWrongTypesAndRanges) {
  ExpectInvalid(R"({"temperature": "hot"})", "temperature: expected a number, got string");
  ExpectInvalid(R"({"temperature": -0.5})", "temperature: -0.5 is outside");
  ExpectInvalid(R"({"top_p": 1.5})", "top_p: 1.5 is outside [0, 1]");
  ExpectInvalid(R"({"top_k": -1})", "top_k: -1 must be at least 0");
  ExpectInvalid(R"({"top_k": 2.5})", "top_k: expected an integer");
  ExpectInvalid(R"({"min_p": 2})", "min_p: 2 is outside");
  ExpectInvalid(R"({"repetition_penalty": 0})", "repetition_penalty: 0 is outside (0");
  ExpectInvalid(R"({"max_new_tokens": 0})", "max_new_tokens: 0 must be at least 1");
  ExpectInvalid(R"({"do_sample": "yes"})", "do_sample: expected true or false");
  ExpectInvalid(R"({"eos_token_id": [2, null]})", "eos_token_id: expected an integer");
  ExpectInvalid(R"({"eos_token_id": -2})", "eos_token_id: token id -2 is negative");
  ExpectInvalid(R"({"bos_token_id": -2})", "bos_token_id: -2 must be at least 0");
}

TEST(GenerationConfigTest, MalformedJson) {
  absl::StatusOr<GenerationConfig> g =
      ParseGenerationConfig("{\"temperature\": 0.6,,}", "generation_config.json");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()),
              HasSubstr("generation_config.json: malformed JSON"));
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("line 1, column"));
  ExpectInvalid("[]", "expected a JSON object at the top level");
}

TEST(GenerationConfigTest, LoadMissingFileGivesEmptyConfig) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "generation_config_test_missing";
  std::filesystem::create_directories(dir);
  absl::StatusOr<GenerationConfig> g = LoadGenerationConfig(dir);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->eos_token_ids.empty());
  EXPECT_FALSE(g->temperature.has_value());
  std::filesystem::remove_all(dir);
}

TEST(GenerationConfigTest, LoadFromDirectory) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "generation_config_test_load";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "generation_config.json");
    out << R"({"eos_token_id": [7, 8], "top_k": 5})";
  }
  absl::StatusOr<GenerationConfig> g = LoadGenerationConfig(dir);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT(g->eos_token_ids, ElementsAre(7, 8));
  EXPECT_EQ(g->top_k, 5);

  {
    std::ofstream out(dir / "generation_config.json");
    out << R"({"top_p": "high"})";
  }
  absl::StatusOr<GenerationConfig> bad = LoadGenerationConfig(dir);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr((dir / "generation_config.json").string() + ": top_p"));
  std::filesystem::remove_all(dir);
}

TEST(GenerationConfigTest, IdsOutsideTheVocabularyAreRefusedNamingTheField) {
  for (const auto& [text, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"eos_token_id": [1, 32000]})", "eos_token_id: token id 32000"},
           {R"({"bos_token_id": 32001})", "bos_token_id: token id 32001"},
           {R"({"pad_token_id": 40000})", "pad_token_id: token id 40000"},
       }) {
    absl::StatusOr<GenerationConfig> g =
        ParseGenerationConfig(text, "generation_config.json", /*vocab_size=*/32000);
    ASSERT_FALSE(g.ok()) << text;
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(g.status().message(), HasSubstr("generation_config.json: " + field));
    EXPECT_THAT(g.status().message(), HasSubstr("outside the vocabulary (vocab_size 32000)"));
    // Without a vocabulary to check against, the file parses as before.
    EXPECT_TRUE(ParseGenerationConfig(text, "generation_config.json").ok()) << text;
  }
  EXPECT_TRUE(ParseGenerationConfig(R"({"eos_token_id": [31999], "pad_token_id": -1})",
                                    "generation_config.json", 32000)
                  .ok());
}

}  // namespace
}  // namespace kvgrid::model
