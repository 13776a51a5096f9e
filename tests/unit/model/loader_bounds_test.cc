// Loaders bound what they allocate by the size of the file they read: a count or id that a
// small file claims is refused naming the field before anything is sized by it.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer.h"

namespace kvgrid::model {
namespace {

using ::testing::HasSubstr;

// A 60-byte tokenizer.json whose one token claims id 16 million made the id -> token tables
// 16 million entries long (over 500 MB).
TEST(LoaderBoundsTest, TokenizerIdFarPastTheFileIsRefused) {
  const std::string json =
      R"({"model": {"type": "BPE", "vocab": {"a": 16000000}, "merges": []}})";
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(json, "tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json: model.vocab[\"a\"]: token id "
                                              "16000000 is larger than a file of"));
}

TEST(LoaderBoundsTest, AddedTokenIdFarPastTheFileIsRefused) {
  const std::string json =
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
          "added_tokens": [{"id": 9000000, "content": "<x>", "special": true}]})";
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(json, "tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("token id 9000000 is larger than a file of"));
}

}  // namespace
}  // namespace kvgrid::model
