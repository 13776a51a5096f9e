// Loaders bound what they allocate by the size of the file they read: a count or id that a
// small file claims is refused naming the field before anything is sized by it.
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/special_tokens.h"
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

// Ids the tokenizer produces must have embedding rows: fewer tokenizer ids than vocab_size is
// Hugging Face's padding, more is a tokenizer that belongs to another model.
TEST(LoaderBoundsTest, TokenizerIdsPastTheVocabularyAreRefused) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::FromFile(std::string(KVGRID_SOURCE_DIR) + "/models/kjv-tiny/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status();
  const int64_t n = (*t)->vocab_size();
  ASSERT_GT(n, 1);
  EXPECT_TRUE(CheckTokenizerFitsVocabulary(**t, n, "models/x").ok());
  EXPECT_TRUE(CheckTokenizerFitsVocabulary(**t, n + 64, "models/x").ok());
  const absl::Status s = CheckTokenizerFitsVocabulary(**t, n - 1, "models/x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("models/x: the tokenizer has ids up to ", n - 1,
                                                  " but the model's vocab_size is ", n - 1)));
}

}  // namespace
}  // namespace kvgrid::model
