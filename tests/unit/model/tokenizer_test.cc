// BPE tokenizer: merge order, added/special tokens, post-processor, decoding and streaming
// detokenization on small hand-built byte-level and SentencePiece-style files and on
// llama.cpp-style SentencePiece vocabularies; the real Llama 3 and Qwen2 files for known ids;
// and malformed files, which must give errors naming the field, never crash.
// Agreement with Hugging Face `tokenizers` on hundreds of strings is
// tests/reference/test_tokenizer.py and test_sentencepiece_tokenizer.py; with llama.cpp,
// test_llama_cpp_vocab.py.
#include "model/tokenizer.h"

#include <algorithm>
#include <cstdio>
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

// --- SentencePiece-style files ------------------------------------------------------------

// Llama 2's layout: <unk> 0, <s> 1, </s> 2, the byte tokens <0x00>..<0xFF> at 3..258, then
// the pieces below from kPiece on.
constexpr int32_t kPiece = 259;
const std::vector<std::string> kPieces = {"▁", "h",  "e",  "l",   "o",     "w",      "r",
                                          "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "<x>"};
int32_t Piece(const std::string& p) {
  for (size_t i = 0; i < kPieces.size(); ++i) {
    if (kPieces[i] == p) return kPiece + static_cast<int32_t>(i);
  }
  return -1;
}
int32_t ByteId(int b) { return 3 + b; }

constexpr char kLlama2Normalizer[] = R"({"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]})";
constexpr char kLlama2Decoder[] = R"({"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]})";

struct SpmSpec {
  std::string normalizer = kLlama2Normalizer;
  std::string pre_tokenizer = "null";
  std::string decoder = kLlama2Decoder;
  bool byte_fallback = true;
  bool fuse_unk = true;
  std::string extra_added;  // more added_tokens entries, each starting with ", "

  std::string Json() const {
    std::string vocab = R"("<unk>": 0, "<s>": 1, "</s>": 2)";
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      vocab += ", " + JsonString(name) + ": " + std::to_string(ByteId(b));
    }
    for (size_t i = 0; i < kPieces.size(); ++i) {
      vocab += ", " + JsonString(kPieces[i]) + ": " + std::to_string(kPiece + i);
    }
    return std::string(R"({"version": "1.0", "added_tokens": [
        {"id": 0, "content": "<unk>", "special": true, "normalized": false},
        {"id": 1, "content": "<s>", "special": true, "normalized": false},
        {"id": 2, "content": "</s>", "special": true, "normalized": false})") +
           extra_added + "], \"normalizer\": " + normalizer +
           ", \"pre_tokenizer\": " + pre_tokenizer + R"(, "post_processor": {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": )" +
           decoder + R"(, "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": )" +
           (byte_fallback ? "true" : "false") + ", \"fuse_unk\": " + (fuse_unk ? "true" : "false") +
           ", \"vocab\": {" + vocab +
           R"(}, "merges": ["▁ h", "l l", "▁h e", "▁he ll", "▁hell o"]}})";
  }
};

std::unique_ptr<Tokenizer> LoadSpm(const SpmSpec& spec) {
  auto tokenizer = Tokenizer::FromJson(spec.Json(), "spm.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

std::string Stream(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip = true,
                   bool continues_text = false) {
  IncrementalDetokenizer detok(&t, skip, continues_text);
  std::string out;
  for (int32_t id : ids) out += *detok.Push(id);
  return out + detok.Finish();
}

TEST(SentencePieceTest, Llama2NormalizerMergesAndByteFallback) {
  auto t = LoadSpm(SpmSpec());
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello"), ElementsAre(Piece("▁hello")));
  EXPECT_THAT(t->Encode("hello world"),
              ElementsAre(Piece("▁hello"), Piece("▁"), Piece("w"), Piece("o"), Piece("r"),
                          Piece("l"), Piece("d")));
  // é is not a piece: its two bytes' tokens. The space before "he" is the Prepend's "▁".
  EXPECT_THAT(t->Encode("hé"), ElementsAre(Piece("▁h"), ByteId(0xC3), ByteId(0xA9)));
  EXPECT_THAT(t->Encode("hello", /*add_special_tokens=*/true), ElementsAre(1, Piece("▁hello")));
  EXPECT_THAT(t->Encode(""), IsEmpty());
  EXPECT_THAT(t->Encode("", true), ElementsAre(1));
  // Legacy behaviour: the text after a special token gets its own "▁".
  EXPECT_THAT(t->Encode("<s>hello"), ElementsAre(1, Piece("▁hello")));
  // An ill-formed byte falls back to its byte token and decodes back to the byte.
  EXPECT_THAT(t->Encode("h\xFF"), ElementsAre(Piece("▁h"), ByteId(0xFF)));
  EXPECT_EQ(*t->DecodeBytes(t->Encode("h\xFF")), "h\xFF");
}

TEST(SentencePieceTest, DecodeStripsTheFirstSpaceOnly) {
  auto t = LoadSpm(SpmSpec());
  ASSERT_NE(t, nullptr);
  for (const std::string text : {"hello world", "  hello", "hé llo", "héé\nwé"}) {
    EXPECT_EQ(*t->Decode(t->Encode(text)), text);
    EXPECT_EQ(Stream(*t, t->Encode(text)), text);
  }
  const std::vector<int32_t> ids = {1, Piece("▁hello")};
  EXPECT_EQ(*t->Decode(ids), "<s> hello");  // the text starts with "<s>": nothing stripped
  EXPECT_EQ(*t->Decode(ids, /*skip_special_tokens=*/true), "hello");
  EXPECT_EQ(Stream(*t, ids, /*skip=*/true), "hello");
  EXPECT_EQ(Stream(*t, ids, /*skip=*/false), "<s> hello");
  // Text that continues a prompt keeps its space.
  EXPECT_EQ(Stream(*t, ids, /*skip=*/true, /*continues_text=*/true), " hello");
}

TEST(SentencePieceTest, ByteRunsAreHeldAndInvalidRunsReplacedPerByte) {
  auto t = LoadSpm(SpmSpec());
  ASSERT_NE(t, nullptr);
  IncrementalDetokenizer detok(t.get());
  EXPECT_EQ(*detok.Push(Piece("▁h")), "h");
  EXPECT_EQ(*detok.Push(ByteId(0xE2)), "");  // '€' is E2 82 AC
  EXPECT_EQ(*detok.Push(ByteId(0x82)), "");
  EXPECT_EQ(*detok.Push(ByteId(0xAC)), "");  // the run may go on
  EXPECT_EQ(*detok.Push(Piece("e")),
            "\u20ac"
            "e");
  EXPECT_EQ(*detok.Push(ByteId(0xF0)), "");
  EXPECT_EQ(*detok.Push(ByteId(0x9F)), "");
  EXPECT_EQ(detok.Finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // not UTF-8: one U+FFFD per byte
  const std::vector<int32_t> broken = {ByteId(0xF0), ByteId(0x9F), Piece("e")};
  EXPECT_EQ(*t->Decode(broken),
            "\xEF\xBF\xBD\xEF\xBF\xBD"
            "e");
  EXPECT_EQ(*t->DecodeBytes(broken),
            "\xF0\x9F"
            "e");
  // A valid run is one character even when a wrong byte follows later in another run.
  const std::vector<int32_t> ok = {ByteId(0xC3), ByteId(0xA9), Piece("e"), ByteId(0xFF)};
  EXPECT_EQ(*t->Decode(ok),
            "\u00e9"
            "e\xEF\xBF\xBD");
  EXPECT_EQ(Stream(*t, ok), *t->Decode(ok));
}

TEST(SentencePieceTest, UnknownCharactersWithoutByteFallback) {
  SpmSpec spec;
  spec.byte_fallback = false;
  auto fused = LoadSpm(spec);
  ASSERT_NE(fused, nullptr);
  EXPECT_THAT(fused->Encode("héé"), ElementsAre(Piece("▁h"), 0));
  spec.fuse_unk = false;
  auto unfused = LoadSpm(spec);
  ASSERT_NE(unfused, nullptr);
  EXPECT_THAT(unfused->Encode("héé"), ElementsAre(Piece("▁h"), 0, 0));
}

TEST(SentencePieceTest, MetaspacePrependSchemes) {
  SpmSpec spec;
  spec.normalizer = "null";
  spec.pre_tokenizer =
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false})";
  auto first = LoadSpm(spec);
  ASSERT_NE(first, nullptr);
  EXPECT_THAT(first->Encode("hello"), ElementsAre(Piece("▁hello")));
  // "first": only where the text starts the input, not after a special token.
  EXPECT_THAT(first->Encode("<s>hello"),
              ElementsAre(1, Piece("h"), Piece("e"), Piece("ll"), Piece("o")));
  spec.pre_tokenizer =
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true})";
  auto always = LoadSpm(spec);
  ASSERT_NE(always, nullptr);
  EXPECT_THAT(always->Encode("<s>hello"), ElementsAre(1, Piece("▁hello")));
  // split: each "▁" starts a piece, so "▁" + "▁hello"; a leading "▁" is not doubled.
  EXPECT_THAT(always->Encode("  hello"), ElementsAre(Piece("▁"), Piece("▁hello")));
  EXPECT_THAT(always->Encode(" hello"), ElementsAre(Piece("▁hello")));
  spec.pre_tokenizer = R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"})";
  auto never = LoadSpm(spec);
  ASSERT_NE(never, nullptr);
  EXPECT_THAT(never->Encode("he"), ElementsAre(Piece("h"), Piece("e")));
}

TEST(SentencePieceTest, MetaspaceDecoderDropsReplacementsOfTheFirstToken) {
  SpmSpec spec;
  spec.decoder = R"({"type": "Sequence", "decoders": [{"type": "ByteFallback"},
      {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}]})";
  auto t = LoadSpm(spec);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = {Piece("▁hello"), Piece("▁"), Piece("w")};
  EXPECT_EQ(*t->Decode(ids), "hello w");
  EXPECT_EQ(Stream(*t, ids), "hello w");
  EXPECT_EQ(Stream(*t, ids, true, /*continues_text=*/true), " hello w");
}

TEST(SentencePieceTest, StripAtTheEndIsHeldBack) {
  SpmSpec spec;
  spec.decoder = R"({"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 0, "stop": 2}]})";
  auto t = LoadSpm(spec);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = {Piece("▁h"), Piece("▁"), Piece("▁"), Piece("▁")};
  EXPECT_EQ(*t->Decode(ids), " h ");
  IncrementalDetokenizer detok(t.get());
  EXPECT_EQ(*detok.Push(Piece("▁h")), " h");
  EXPECT_EQ(*detok.Push(Piece("▁")), "");
  EXPECT_EQ(*detok.Push(Piece("▁")), "");
  EXPECT_EQ(*detok.Push(Piece("▁")), " ");  // three spaces: at most two can be stripped
  EXPECT_EQ(*detok.Push(Piece("w")), "  w");
  EXPECT_EQ(detok.Finish(), "");
}

TEST(SentencePieceTest, AddedTokenFlags) {
  SpmSpec spec;
  spec.extra_added = R"(, {"id": 272, "content": "<x>", "special": false, "normalized": false,
                          "single_word": true, "lstrip": false, "rstrip": false})";
  auto t = LoadSpm(spec);
  ASSERT_NE(t, nullptr);
  const int32_t x = Piece("<x>");
  ASSERT_EQ(x, 272);
  EXPECT_THAT(t->Encode("he <x>"), ElementsAre(Piece("▁he"), Piece("▁"), x));
  // Touching a word character, the text is not the token (it falls back to bytes here).
  const std::vector<int32_t> glued = t->Encode("he<x>");
  EXPECT_EQ(std::count(glued.begin(), glued.end(), x), 0);
  EXPECT_EQ(*t->Decode(glued), "he<x>");
}

TEST(SentencePieceTest, UnsupportedDecodersAndBadFields) {
  SpmSpec spec;
  // A Replace after Fuse could match across tokens unless its pattern is one character.
  spec.decoder = R"({"type": "Sequence", "decoders": [{"type": "Fuse"},
      {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}]})";
  EXPECT_TRUE(Tokenizer::FromJson(spec.Json(), "spm.json").ok());
  spec.decoder = R"({"type": "Sequence", "decoders": [{"type": "Fuse"},
      {"type": "Replace", "pattern": {"String": "ab"}, "content": "b"}]})";
  auto status = Tokenizer::FromJson(spec.Json(), "spm.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("spm.json: decoder.decoders[1].type: 'Replace' after Fuse"));
  spec = SpmSpec();
  spec.decoder = R"({"type": "ByteLevel"})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: pre_tokenizer: has no ByteLevel step"));
  spec = SpmSpec();
  spec.decoder = R"({"type": "Strip", "content": " ", "start": 1})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: decoder.stop: missing"));
  spec = SpmSpec();
  spec.pre_tokenizer = R"({"type": "Metaspace", "replacement": "ab"})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: pre_tokenizer.replacement: expected one character"));
  spec.pre_tokenizer = R"({"type": "Metaspace", "replacement": "▁", "add_prefix_space": false})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: pre_tokenizer.add_prefix_space"));
  spec = SpmSpec();
  spec.normalizer = R"({"type": "Replace", "pattern": {"Regex": "("}, "content": ""})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: normalizer.pattern.Regex"));
  spec.normalizer = R"({"type": "Prepend"})";
  EXPECT_THAT(Tokenizer::FromJson(spec.Json(), "spm.json").status().message(),
              HasSubstr("spm.json: normalizer.prepend: missing"));
}

// --- llama.cpp's SentencePiece (FromSentencePiece) ---------------------------------------

Tokenizer::SentencePieceVocab SmallVocab() {
  Tokenizer::SentencePieceVocab v;
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    v.tokens.push_back(name);
    v.types.push_back(6);
  }
  for (const char* p : {"▁", "a", "b", "c", "ab", "bc", "▁a", "<t>"}) {
    v.tokens.push_back(p);
    v.types.push_back(std::string(p) == "<t>" ? 4 : 1);
  }
  v.scores.assign(v.tokens.size(), 0.0f);
  v.bos_id = 1;
  return v;
}

int32_t SpmId(const Tokenizer::SentencePieceVocab& v, const std::string& token) {
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    if (v.tokens[i] == token) return static_cast<int32_t>(i);
  }
  return -1;
}

TEST(SentencePieceScoresTest, HighestScoreMergesFirstLeftmostAmongEquals) {
  Tokenizer::SentencePieceVocab v = SmallVocab();
  v.add_space_prefix = false;
  auto equal = Tokenizer::FromSentencePiece(v, "v");
  ASSERT_TRUE(equal.ok()) << equal.status();
  EXPECT_THAT((*equal)->Encode("abc"), ElementsAre(SpmId(v, "ab"), SpmId(v, "c")));
  v.scores[SpmId(v, "bc")] = 1.0f;
  auto scored = Tokenizer::FromSentencePiece(v, "v");
  ASSERT_TRUE(scored.ok());
  EXPECT_THAT((*scored)->Encode("abc"), ElementsAre(SpmId(v, "a"), SpmId(v, "bc")));
}

TEST(SentencePieceScoresTest, SpacePrefixSpecialsBytesAndDecode) {
  const Tokenizer::SentencePieceVocab v = SmallVocab();
  auto t = Tokenizer::FromSentencePiece(v, "v");
  ASSERT_TRUE(t.ok()) << t.status();
  const Tokenizer& tok = **t;
  EXPECT_THAT(tok.Encode("a"), ElementsAre(SpmId(v, "▁a")));
  EXPECT_THAT(tok.Encode("a", true), ElementsAre(1, SpmId(v, "▁a")));
  // After a control or user-defined token the text gets a space prefix again.
  EXPECT_THAT(tok.Encode("a</s>a<t>a"),
              ElementsAre(SpmId(v, "▁a"), 2, SpmId(v, "▁a"), SpmId(v, "<t>"), SpmId(v, "▁a")));
  // No token for "é" or "d": byte tokens.
  EXPECT_THAT(tok.Encode("éd"), ElementsAre(SpmId(v, "▁"), 3 + 0xC3, 3 + 0xA9, 3 + 'd'));
  EXPECT_EQ(*tok.Decode(tok.Encode("ab éd a")), "ab éd a");
  EXPECT_EQ(Stream(tok, tok.Encode("ab éd a")), "ab éd a");
  EXPECT_TRUE(tok.IsSpecial(1));
  EXPECT_TRUE(tok.IsSpecial(0));
  EXPECT_FALSE(tok.IsSpecial(SpmId(v, "<t>")));
  EXPECT_EQ(*tok.Decode(tok.Encode("<s>a"), /*skip_special_tokens=*/true), "a");
}

TEST(SentencePieceScoresTest, StripIdsSwallowAsciiWhitespace) {
  Tokenizer::SentencePieceVocab v = SmallVocab();
  v.rstrip_ids = {2};
  v.lstrip_ids = {SpmId(v, "<t>")};
  auto t = Tokenizer::FromSentencePiece(v, "v");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode("a</s> \n a"), ElementsAre(SpmId(v, "▁a"), 2, SpmId(v, "▁a")));
  EXPECT_THAT((*t)->Encode("a \t<t>a"),
              ElementsAre(SpmId(v, "▁a"), SpmId(v, "<t>"), SpmId(v, "▁a")));
  v.rstrip_ids = {-1};
  EXPECT_EQ(Tokenizer::FromSentencePiece(v, "v").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SentencePieceScoresTest, BadVocabulariesAreRefused) {
  Tokenizer::SentencePieceVocab v = SmallVocab();
  v.scores.pop_back();
  EXPECT_THAT(Tokenizer::FromSentencePiece(v, "v.gguf").status().message(),
              HasSubstr("v.gguf: the scores have"));
  v = SmallVocab();
  v.types[5] = 9;
  EXPECT_THAT(Tokenizer::FromSentencePiece(v, "v.gguf").status().message(),
              HasSubstr("token 5 has type 9"));
  v = SmallVocab();
  v.bos_id = 100000;
  EXPECT_EQ(Tokenizer::FromSentencePiece(v, "v.gguf").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromSentencePiece({}, "v.gguf").status().code(),
            absl::StatusCode::kInvalidArgument);
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
