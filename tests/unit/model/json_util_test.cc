#include "model/json_util.h"

#include <string>

#include "gtest/gtest.h"
#include "model/model_config.h"

namespace kvgrid::model {
namespace {

TEST(JsonLimitsTest, AcceptsOrdinaryNesting) {
  EXPECT_TRUE(CheckJsonDepth(R"({"a": [1, {"b": [2]}], "s": "[[[[["})", "x").ok());
}

TEST(JsonLimitsTest, RefusesDeepNestingNamingTheSource) {
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  absl::Status s = CheckJsonDepth(deep, "tokenizer.json");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("tokenizer.json"), std::string::npos);
}

TEST(JsonLimitsTest, BracketsInStringsAndEscapesDoNotCount) {
  const std::string text = "{\"k\": \"" + std::string(200, '{') + "\\\"" + "\"}";
  EXPECT_TRUE(CheckJsonDepth(text, "x").ok());
}

TEST(JsonLimitsTest, ConfigParserRefusesHugeNestingAndHugeSizes) {
  const std::string deep = "{\"x\": " + std::string(300000, '[') + std::string(300000, ']') + "}";
  EXPECT_EQ(ParseModelConfig(deep, "config.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto big = ParseModelConfig(
      R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 1000000000000, "num_hidden_layers": 2,
          "num_attention_heads": 32})",
      "config.json");
  ASSERT_FALSE(big.ok());
  EXPECT_NE(std::string(big.status().message()).find("intermediate_size"), std::string::npos);
  auto eps = ParseModelConfig(
      R"({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 11008, "num_hidden_layers": 2, "num_attention_heads": 32,
          "rms_norm_eps": 1e-50})",
      "config.json");
  ASSERT_FALSE(eps.ok());
  EXPECT_NE(std::string(eps.status().message()).find("rms_norm_eps"), std::string::npos);
}

}  // namespace
}  // namespace kvgrid::model

namespace kvgrid::model {
namespace {

TEST(DescribeJsonTest, ShortValuesWholeLongContainersCut) {
  EXPECT_EQ(DescribeJson(nlohmann::json("abc")), "string \"abc\"");
  EXPECT_EQ(DescribeJson(nlohmann::json::parse("[1,2]")), "array [1,2]");
  nlohmann::json big = nlohmann::json::array();
  for (int i = 0; i < 100000; ++i) big.push_back(i);
  const std::string d = DescribeJson(big);
  EXPECT_EQ(d.rfind("array [0,1,2", 0), 0u) << d;
  EXPECT_LE(d.size(), 70u);
}

}  // namespace
}  // namespace kvgrid::model
