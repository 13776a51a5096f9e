// Byte-level BPE tokenizer: merge order, added/special tokens, post-processor, decoding and
// streaming detokenization on small hand-built files; the real Llama 3 and Qwen2 files for
// known ids; and malformed files, which must give errors naming the field, never crash.
// Agreement with Hugging Face `tokenizers` on hundreds of strings is
// tests/reference/test_tokenizer.py.
#include "model/tokenizer.h"

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/model/byte_char.h"

namespace kvgrid::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const std::string kDataDir = std::string(KVGRID_SOURCE_DIR) + "/tests/data/tokenizers";

using ::kvgrid::model::testing::ByteChar;

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out.push_back('\\');
    out.push_back(ch);
  }
  return out + "\"";
}

// A small tokenizer.json: ids 0..255 are the bytes, `extra` tokens follow from 256.
struct Spec {
  std::vector<std::string> extra;
  std::string merges = "[]";
  bool ignore_merges = false;
  std::string model_type = "\"BPE\"";
  std::string added_tokens = "[]";
  std::string normalizer = "null";
  std::string pre_tokenizer =
      R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";
  std::string post_processor = "null";
  std::string decoder =
      R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})";

  std::string Json() const {
    std::string vocab;
    for (int b = 0; b < 256; ++b) {
      vocab += JsonString(ByteChar(b)) + ": " + std::to_string(b) + ", ";
    }
    for (size_t i = 0; i < extra.size(); ++i) {
      vocab += JsonString(extra[i]) + ": " + std::to_string(256 + i) + ", ";
    }
    vocab.resize(vocab.size() - 2);
    return "{\"version\": \"1.0\", \"added_tokens\": " + added_tokens +
           ", \"normalizer\": " + normalizer + ", \"pre_tokenizer\": " + pre_tokenizer +
           ", \"post_processor\": " + post_processor + ", \"decoder\": " + decoder +
           ", \"model\": {\"type\": " + model_type +
           ", \"ignore_merges\": " + (ignore_merges ? "true" : "false") + ", \"vocab\": {" + vocab +
           "}, \"merges\": " + merges + "}}";
  }
};

std::unique_ptr<Tokenizer> Load(const Spec& spec) {
  auto tokenizer = Tokenizer::FromJson(spec.Json(), "test.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

absl::Status LoadError(const std::string& json) {
  auto tokenizer = Tokenizer::FromJson(json, "test.json");
  return tokenizer.ok() ? absl::OkStatus() : tokenizer.status();
}

const Tokenizer& Llama3() {
  static const Tokenizer* tokenizer = [] {
    auto t = Tokenizer::FromFile(kDataDir + "/llama3/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  if (tokenizer == nullptr) std::abort();
  return *tokenizer;
}

const Tokenizer& Qwen() {
  static const Tokenizer* tokenizer = [] {
    auto t = Tokenizer::FromFile(kDataDir + "/qwen/tokenizer.json");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  if (tokenizer == nullptr) std::abort();
  return *tokenizer;
}

bool IsValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC2 ? 2 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// --- merges -------------------------------------------------------------------------------

TEST(TokenizerTest, MergesApplyByRankNotByPosition) {
  Spec spec;
  spec.extra = {"ab", "bc"};
  spec.merges = R"(["b c", "a b"])";
  EXPECT_THAT(Load(spec)->Encode("abc"), ElementsAre('a', 257));
  spec.merges = R"(["a b", "b c"])";
  EXPECT_THAT(Load(spec)->Encode("abc"), ElementsAre(256, 'c'));
}

TEST(TokenizerTest, MergesAsPairsAndChains) {
  Spec spec;
  spec.extra = {"ab", "abc", "abcabc"};
  spec.merges = R"([["a", "b"], ["ab", "c"], ["abc", "abc"]])";
  auto tokenizer = Load(spec);
  EXPECT_THAT(tokenizer->Encode("abcabc"), ElementsAre(258));
  // Equal ranks resolve leftmost first: "abcab" -> abc + ab.
  EXPECT_THAT(tokenizer->Encode("abcab"), ElementsAre(257, 256));
}

TEST(TokenizerTest, MergesDoNotCrossPreTokens) {
  Spec spec;
  spec.extra = {"bĠ"};
  spec.merges = R"(["b Ġ"])";
  // GPT-2's regex splits "ab ab" into "ab" and " ab"; "b " never sits in one pre-token.
  EXPECT_THAT(Load(spec)->Encode("ab ab"), ElementsAre('a', 'b', ' ', 'a', 'b'));
}

TEST(TokenizerTest, IgnoreMergesMapsWholePreTokensInTheVocabulary) {
  Spec spec;
  spec.extra = {"ab", "xyz"};  // "xyz" cannot be reached by any merge
  spec.merges = R"(["a b"])";
  EXPECT_THAT(Load(spec)->Encode("xyz ab"), ElementsAre('x', 'y', 'z', ' ', 256));
  spec.ignore_merges = true;
  EXPECT_THAT(Load(spec)->Encode("xyz ab"), ElementsAre(257, ' ', 256));
}

TEST(TokenizerTest, SplitRegexIsolatedWithUnicodeProperties) {
  Spec spec;
  spec.pre_tokenizer = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}|\\p{L}+"}, "behavior": "Isolated", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})";
  spec.extra = {"12", "123", "23", "Ã©"};  // é is the bytes C3 A9
  spec.merges = R"(["1 2", "12 3", "2 3", "Ã ©"])";
  // Digits group by three from the left (1234 -> 123 4); é is a letter under UCP.
  EXPECT_THAT(Load(spec)->Encode("1234é"), ElementsAre(257, '4', 259));
}

// --- added tokens and the post-processor ---------------------------------------------------

Spec WithAddedTokens() {
  Spec spec;
  spec.extra = {"<s>", "<x>", "<s>>"};
  spec.added_tokens = R"([
      {"id": 256, "content": "<s>", "special": true, "normalized": false},
      {"id": 257, "content": "<x>", "special": false, "normalized": false},
      {"id": 258, "content": "<s>>", "special": true, "normalized": false},
      {"id": 300, "content": "<bos>", "special": true, "normalized": false}])";
  spec.post_processor = R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<bos>": {"id": "<bos>", "ids": [300], "tokens": ["<bos>"]}}}]})";
  return spec;
}

TEST(TokenizerTest, AddedTokensMatchFirstAndLongest) {
  auto tokenizer = Load(WithAddedTokens());
  EXPECT_THAT(tokenizer->Encode("a<s>b<x>"), ElementsAre('a', 256, 'b', 257));
  EXPECT_THAT(tokenizer->Encode("<s>>"), ElementsAre(258));
  EXPECT_THAT(tokenizer->Encode("<s"), ElementsAre('<', 's'));
  EXPECT_EQ(tokenizer->vocab_size(), 301);
  EXPECT_EQ(tokenizer->TokenToId("<x>"), 257);
  EXPECT_EQ(tokenizer->TokenToId("nope"), std::nullopt);
  EXPECT_TRUE(tokenizer->IsSpecial(256));
  EXPECT_FALSE(tokenizer->IsSpecial(257));
  EXPECT_FALSE(tokenizer->IsSpecial(-1));
  EXPECT_FALSE(tokenizer->IsSpecial(100000));
}

TEST(TokenizerTest, TemplateProcessingAddsBos) {
  auto tokenizer = Load(WithAddedTokens());
  EXPECT_EQ(tokenizer->bos_token_id(), 300);
  EXPECT_THAT(tokenizer->Encode("hi", /*add_special_tokens=*/true), ElementsAre(300, 'h', 'i'));
  EXPECT_THAT(tokenizer->Encode("hi"), ElementsAre('h', 'i'));
  EXPECT_THAT(tokenizer->Encode("", true), ElementsAre(300));
  EXPECT_THAT(tokenizer->Encode(""), IsEmpty());
}

TEST(TokenizerTest, DecodeSkipsOnlySpecialTokens) {
  auto tokenizer = Load(WithAddedTokens());
  const std::vector<int32_t> ids = {300, 'a', 256, 257, 'b'};
  EXPECT_EQ(*tokenizer->Decode(ids), "<bos>a<s><x>b");
  EXPECT_EQ(*tokenizer->Decode(ids, /*skip_special_tokens=*/true), "a<x>b");
}

TEST(TokenizerTest, DecodeRejectsIdsOutsideTheVocabulary) {
  auto tokenizer = Load(WithAddedTokens());
  for (int32_t bad : {-1, 280, 301, 1 << 30}) {  // 280 is a hole between 258 and 300
    const std::vector<int32_t> ids = {'a', bad};
    auto text = tokenizer->Decode(ids);
    ASSERT_FALSE(text.ok()) << bad;
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(text.status().message(), HasSubstr(std::to_string(bad)));
  }
}

TEST(TokenizerTest, EmptyStringAndIllFormedInput) {
  auto tokenizer = Load(Spec());
  EXPECT_THAT(tokenizer->Encode(""), IsEmpty());
  // Every byte has a token, so even ill-formed UTF-8 round-trips byte for byte.
  const std::string bytes = "a\xFF\xC3 b\xE2\x82";
  const std::vector<int32_t> ids = tokenizer->Encode(bytes);
  EXPECT_EQ(*tokenizer->DecodeBytes(ids), bytes);
  EXPECT_EQ(*tokenizer->Decode(ids), "a\xEF\xBF\xBD\xEF\xBF\xBD b\xEF\xBF\xBD");
}

// --- real files ----------------------------------------------------------------------------

TEST(TokenizerTest, Llama3KnownIds) {
  const Tokenizer& t = Llama3();
  EXPECT_EQ(t.vocab_size(), 128256);
  EXPECT_THAT(t.Encode("hello world"), ElementsAre(15339, 1917));
  EXPECT_THAT(t.Encode("<|begin_of_text|>hi"), ElementsAre(128000, 6151));
  EXPECT_EQ(t.TokenToId("<|begin_of_text|>"), 128000);
  EXPECT_TRUE(t.IsSpecial(128000));
  EXPECT_FALSE(t.IsSpecial(15339));
  // This copy's post-processor is ByteLevel only: no BOS is added (callers prepend it).
  EXPECT_EQ(t.bos_token_id(), std::nullopt);
  EXPECT_THAT(t.Encode("hello", true), ElementsAre(15339));
  EXPECT_THAT(t.Encode(""), IsEmpty());
}

TEST(TokenizerTest, QwenNormalizesToNfc) {
  const Tokenizer& t = Qwen();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.Encode("caf\u00e9"), t.Encode("cafe\u0301"));
  EXPECT_EQ(*t.Decode(t.Encode("cafe\u0301")), "caf\u00e9");
  EXPECT_EQ(t.Encode("\u1100\u1161\u11a8"), t.Encode("\uac01"));  // conjoining jamo -> 각
  EXPECT_THAT(t.Encode("<|im_start|>"), ElementsAre(151644));
  EXPECT_TRUE(t.IsSpecial(151644));
  ASSERT_TRUE(t.TokenToId("<think>").has_value());
  EXPECT_FALSE(t.IsSpecial(*t.TokenToId("<think>")));
}

TEST(TokenizerTest, RealFilesRoundTrip) {
  const std::string text =
      "Hello, 世界! 👩🏽‍💻 It's 12345 ok?\r\n\tcode(x) {\n    return;\n}  مرحبا "
      "नमस्ते "
      "안녕";
  for (const Tokenizer* t : {&Llama3(), &Qwen()}) {
    const std::vector<int32_t> ids = t->Encode(text);
    EXPECT_GT(ids.size(), 10u);
    EXPECT_EQ(*t->Decode(ids), text);
  }
}

TEST(TokenizerTest, ConcurrentEncodesAgreeWithSerial) {
  const Tokenizer& t = Qwen();
  std::vector<std::string> texts;
  for (int i = 0; i < 64; ++i) {
    texts.push_back("line " + std::to_string(i * 7919) + ": caf\u00e9 世界 " +
                    std::string(i % 5, ' ') + "it's\n");
  }
  std::vector<std::vector<int32_t>> serial;
  for (const std::string& text : texts) serial.push_back(t.Encode(text));
  std::vector<std::vector<std::vector<int32_t>>> results(4);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = 0; i < texts.size(); ++i) {
          auto ids = t.Encode(texts[(i + k * 13) % texts.size()]);
          if (rep == 0) results[k].push_back(std::move(ids));
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int k = 0; k < 4; ++k) {
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(results[k][i], serial[(i + k * 13) % texts.size()]);
    }
  }
}

// --- streaming detokenization --------------------------------------------------------------

TEST(IncrementalDetokenizerTest, NeverSplitsCharactersAcrossTokens) {
  const std::string text =
      "日本語 😀👨‍👩‍👧‍👦🇯🇵 café 한국어 🧑🏾‍🚀 ok";
  for (const Tokenizer* t : {&Llama3(), &Qwen()}) {
    const std::vector<int32_t> ids = t->Encode(text);
    int partial_tokens = 0;  // tokens whose bytes are not whole characters on their own
    IncrementalDetokenizer detok(t);
    std::string streamed;
    for (int32_t id : ids) {
      const std::vector<int32_t> one = {id};
      if (!IsValidUtf8(*t->DecodeBytes(one))) ++partial_tokens;
      auto delta = detok.Push(id);
      ASSERT_TRUE(delta.ok()) << delta.status();
      EXPECT_TRUE(IsValidUtf8(*delta));
      EXPECT_EQ(delta->find("\xEF\xBF\xBD"), std::string::npos);
      streamed += *delta;
    }
    EXPECT_EQ(detok.Finish(), "");
    EXPECT_EQ(streamed, text);
    EXPECT_GT(partial_tokens, 0) << "the text no longer exercises split characters";
  }
}

TEST(IncrementalDetokenizerTest, HoldsIncompleteBytesAndReplacesInvalidOnes) {
  const Tokenizer& t = Llama3();
  const auto id = [&](int byte) { return *t.TokenToId(ByteChar(byte)); };
  IncrementalDetokenizer detok(&t);
  EXPECT_EQ(*detok.Push(id(0xE2)), "");  // first byte of '€'
  EXPECT_EQ(*detok.Push(id(0x82)), "");
  EXPECT_EQ(*detok.Push(id(0xAC)), "\u20ac");
  EXPECT_EQ(*detok.Push(id(0xFF)), "\xEF\xBF\xBD");  // can never start a character
  EXPECT_EQ(*detok.Push(id(0xE2)), "");
  EXPECT_EQ(*detok.Push(id('a')),
            "\xEF\xBF\xBD"
            "a");  // the held byte can no longer complete
  EXPECT_EQ(*detok.Push(id(0xF0)), "");
  EXPECT_EQ(*detok.Push(id(0x9F)), "");
  EXPECT_EQ(detok.Finish(), "\xEF\xBF\xBD");  // stream ended mid-character
  EXPECT_EQ(detok.Finish(), "");
}

TEST(IncrementalDetokenizerTest, SpecialTokensAndBadIds) {
  const Tokenizer& t = Llama3();
  IncrementalDetokenizer skipping(&t);
  EXPECT_EQ(*skipping.Push(128000), "");
  EXPECT_EQ(*skipping.Push(15339), "hello");
  IncrementalDetokenizer keeping(&t, /*skip_special_tokens=*/false);
  EXPECT_EQ(*keeping.Push(128000), "<|begin_of_text|>");
  auto bad = keeping.Push(200000);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

// --- malformed files -----------------------------------------------------------------------

void ExpectError(const std::string& json, const std::string& field) {
  const absl::Status status = LoadError(json);
  ASSERT_FALSE(status.ok()) << "accepted; expected an error naming " << field;
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("test.json: " + field)) << status;
}

TEST(TokenizerFileTest, TruncatedJson) {
  const std::string json = Spec().Json();
  const absl::Status status = LoadError(json.substr(0, json.size() / 2));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("test.json: not valid JSON"));
  // No prefix of a valid file crashes the reader or loads.
  for (size_t n = 0; n < json.size(); n += 13) {
    EXPECT_FALSE(LoadError(json.substr(0, n)).ok()) << n;
  }
}

TEST(TokenizerFileTest, WrongShapes) {
  ExpectError("[1, 2]", "(top level)");
  ExpectError(R"({"model": {"type": "BPE", "merges": []}})", "model.vocab: missing");
  ExpectError(R"({"model": {"type": "BPE", "vocab": [], "merges": []}})", "model.vocab");
  ExpectError(R"({"model": {"type": "BPE", "vocab": {"a": "0"}, "merges": []}})",
              R"(model.vocab["a"])");
  ExpectError(R"({"model": {"type": "BPE", "vocab": {"a": -3}, "merges": []}})",
              R"(model.vocab["a"])");
  ExpectError(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 0}, "merges": []}})",
              R"(model.vocab["b"])");
  ExpectError(R"({"model": {"type": "BPE", "vocab": {"a": 0}}})", "model.merges: missing");
  ExpectError(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": {}}})", "model.merges");
  ExpectError(R"({})", "model: missing");
}

TEST(TokenizerFileTest, BadMerges) {
  Spec spec;
  spec.extra = {"ab"};
  spec.merges = R"(["a b", 42])";
  ExpectError(spec.Json(), "model.merges[1]");
  spec.merges = R"(["a b", "ab"])";
  ExpectError(spec.Json(), "model.merges[1]");
  spec.merges = R"(["a b", ["a"]])";
  ExpectError(spec.Json(), "model.merges[1]");
  spec.merges = R"(["a b", "a b c"])";
  ExpectError(spec.Json(), "model.merges[1]");
  spec.merges = R"(["zz b"])";  // "zz" is no token
  ExpectError(spec.Json(), "model.merges[0]: 'zz' is not in model.vocab");
  spec.merges = R"(["a b", "b a"])";  // "ba" is no token
  ExpectError(spec.Json(), "model.merges[1]: merged token 'ba' is not in model.vocab");
}

TEST(TokenizerFileTest, UnsupportedOrMalformedSections) {
  Spec spec;
  spec.model_type = "\"Unigram\"";
  ExpectError(spec.Json(), "model.type");
  spec.model_type = "\"WordPiece\"";
  ExpectError(spec.Json(), "model.type");
  spec.model_type = "7";
  ExpectError(spec.Json(), "model.type");

  spec = Spec();
  spec.added_tokens = R"([{"id": 256, "content": 5}])";
  ExpectError(spec.Json(), "added_tokens[0].content");
  spec.added_tokens = R"([{"content": "<s>"}])";
  ExpectError(spec.Json(), "added_tokens[0].id");
  spec.added_tokens = R"([{"id": 256, "content": "<s>", "special": "yes"}])";
  ExpectError(spec.Json(), "added_tokens[0].special");
  spec.added_tokens = R"({})";
  ExpectError(spec.Json(), "added_tokens");

  spec = Spec();
  spec.pre_tokenizer = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"},
      {"type": "ByteLevel", "use_regex": false}]})";
  ExpectError(spec.Json(), "pre_tokenizer.pretokenizers[0].pattern.Regex");
  spec.pre_tokenizer = R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"},
      {"type": "ByteLevel", "use_regex": false}]})";
  ExpectError(spec.Json(), "pre_tokenizer.pretokenizers[0].behavior");
  spec.pre_tokenizer = R"({"type": "Whitespace"})";
  ExpectError(spec.Json(), "pre_tokenizer.type");
  spec.pre_tokenizer = "null";
  ExpectError(spec.Json(), "pre_tokenizer");

  spec = Spec();
  spec.normalizer = R"({"type": "Lowercase"})";
  ExpectError(spec.Json(), "normalizer.type");
  spec = Spec();
  spec.decoder = R"({"type": "WordPiece"})";
  ExpectError(spec.Json(), "decoder.type");
  spec = Spec();
  spec.post_processor = R"({"type": "TemplateProcessing", "single": [
      {"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {}})";
  ExpectError(spec.Json(), R"(post_processor.special_tokens["<bos>"])");
}

TEST(TokenizerFileTest, TruncatedRealFileAndMissingFile) {
  std::ifstream in(kDataDir + "/llama3/tokenizer.json", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str().substr(0, 2 << 20);
  const absl::Status status = LoadError(json);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("not valid JSON"));

  auto missing = Tokenizer::FromFile(kDataDir + "/no/such/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("no/such/tokenizer.json"));
}

}  // namespace
}  // namespace kvgrid::model
