// The tokenizer embedded in a GGUF file's metadata, on small hand-written files: merges by
// rank, control and user-defined tokens, unused ids, BOS from add_bos_token and from the Llama 3
// default, NFC for qwen2, SentencePiece ("llama") vocabularies with their defaults and flags,
// and a tokenizer.json beside a .gguf overriding it. Malformed metadata
// must give an error naming the key and the file. Agreement with Hugging Face `tokenizers` on
// the real Llama 3, Qwen2 and kjv-tiny vocabularies is tests/reference/test_gguf_tokenizer.py.
#include "model/gguf_tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/model/byte_char.h"
#include "model/gguf.h"
#include "tests/unit/model/gguf_test_writer.h"

namespace kvgrid::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using ::kvgrid::model::testing::ByteChar;

constexpr int32_t kHe = 256, kLl = 257, kHell = 258, kBos = 259, kTool = 260, kPad = 261;

// Ids 0..255 are the bytes, then "he", "ll", "hell", a control token, a user-defined token
// and one unused (padding) id.
struct Spec {
  std::optional<std::string> model = "gpt2";
  std::optional<std::string> pre = "llama-bpe";
  std::vector<std::string> tokens;
  std::optional<std::vector<int32_t>> types;
  std::optional<std::vector<std::string>> merges = std::vector<std::string>{"h e", "l l", "he ll"};
  std::optional<uint32_t> bos = kBos;
  std::optional<bool> add_bos;

  Spec() {
    for (int b = 0; b < 256; ++b) tokens.push_back(ByteChar(b));
    tokens.insert(tokens.end(), {"he", "ll", "hell", "<|bos|>", "<tool>", "[PAD261]"});
    types = std::vector<int32_t>(256 + 3, 1);
    types->insert(types->end(), {3, 4, 5});
  }

  std::filesystem::path Write(const std::string& name) const {
    gguf_test::GgufTestWriter w;
    w.String("general.architecture", "llama");
    if (model) w.String("tokenizer.ggml.model", *model);
    if (pre) w.String("tokenizer.ggml.pre", *pre);
    w.StringArray("tokenizer.ggml.tokens", tokens);
    if (types) w.I32Array("tokenizer.ggml.token_type", *types);
    if (merges) w.StringArray("tokenizer.ggml.merges", *merges);
    if (bos) w.U32("tokenizer.ggml.bos_token_id", *bos);
    if (add_bos) w.Bool("tokenizer.ggml.add_bos_token", *add_bos);
    return w.Write(name);
  }
};

absl::StatusOr<std::unique_ptr<Tokenizer>> FromSpec(const Spec& spec,
                                                    const std::string& name = "tok.gguf") {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(spec.Write(name));
  if (!file.ok()) return file.status();
  return TokenizerFromGguf(**file);
}

std::unique_ptr<Tokenizer> Load(const Spec& spec) {
  auto tokenizer = FromSpec(spec);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

TEST(GgufTokenizerTest, MergesApplyByRank) {
  const auto t = Load(Spec());
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello"), ElementsAre(kHell, 'o'));
  EXPECT_THAT(t->Encode("he"), ElementsAre(kHe));
  EXPECT_THAT(t->Encode("llo"), ElementsAre(kLl, 'o'));
  // The Llama 3 split keeps a leading space with the word; space is byte token 32.
  EXPECT_THAT(t->Encode("a hello"), ElementsAre('a', 32, kHell, 'o'));
  EXPECT_EQ(*t->Decode(t->Encode("hello, world\n")), "hello, world\n");
}

TEST(GgufTokenizerTest, ControlTokensAreSpecialUserDefinedAreAdded) {
  const auto t = Load(Spec());
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("<|bos|>hello"), ElementsAre(kBos, kHell, 'o'));
  EXPECT_THAT(t->Encode("<tool>he"), ElementsAre(kTool, kHe));
  EXPECT_TRUE(t->IsSpecial(kBos));
  EXPECT_FALSE(t->IsSpecial(kTool));
  EXPECT_FALSE(t->IsSpecial(kHell));
  EXPECT_EQ(t->TokenToId("<tool>"), kTool);
  const std::vector<int32_t> ids = {kBos, kTool, kHell};
  EXPECT_EQ(*t->Decode(ids), "<|bos|><tool>hell");
  EXPECT_EQ(*t->Decode(ids, /*skip_special_tokens=*/true), "<tool>hell");
}

TEST(GgufTokenizerTest, UnusedIdsHaveNoText) {
  const auto t = Load(Spec());
  ASSERT_NE(t, nullptr);
  EXPECT_FALSE(t->TokenToId("[PAD261]").has_value());
  const std::vector<int32_t> ids = {kPad};
  EXPECT_EQ(t->Decode(ids).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GgufTokenizerTest, Llama3AddsBosByDefault) {
  const auto t = Load(Spec());
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello", /*add_special_tokens=*/true), ElementsAre(kBos, kHell, 'o'));
  EXPECT_EQ(t->bos_token_id(), kBos);
}

TEST(GgufTokenizerTest, AddBosTokenFlagWins) {
  Spec spec;
  spec.add_bos = false;
  auto t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello", true), ElementsAre(kHell, 'o'));
  EXPECT_FALSE(t->bos_token_id().has_value());

  spec.pre = "qwen2";  // no BOS by default
  spec.add_bos.reset();
  t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello", true), ElementsAre(kHell, 'o'));
  spec.add_bos = true;
  t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello", true), ElementsAre(kBos, kHell, 'o'));
}

TEST(GgufTokenizerTest, NoBosIdMeansNoDefaultBos) {
  Spec spec;
  spec.bos.reset();
  const auto t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello", true), ElementsAre(kHell, 'o'));
}

TEST(GgufTokenizerTest, Qwen2ComposesBeforeSplitting) {
  Spec spec;
  spec.pre = "qwen2";
  auto t = Load(spec);
  ASSERT_NE(t, nullptr);
  // "e" + U+0301 composes to U+00E9 (bytes C3 A9) under NFC.
  EXPECT_THAT(t->Encode("e\xCC\x81"), ElementsAre(0xC3, 0xA9));
  spec.pre = "llama-bpe";
  t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("e\xCC\x81"), ElementsAre('e', 0xCC, 0x81));
}

TEST(GgufTokenizerTest, DigitsSplitByPreTokenizer) {
  // Llama 3 groups up to three digits per pre-token, Qwen2 one, GPT-2 any number; with
  // "1 2" as a merge, only a pre-token holding both digits can merge them.
  Spec spec;
  spec.tokens[kPad] = "12";
  spec.types->back() = 1;
  spec.merges->push_back("1 2");
  const int32_t k12 = kPad;
  for (const auto& [pre, want] : std::vector<std::pair<std::string, std::vector<int32_t>>>{
           {"llama-bpe", {k12, '3', '4'}}, {"qwen2", {'1', '2', '3', '4'}},
           {"gpt-2", {k12, '3', '4'}}, {"default", {k12, '3', '4'}}}) {
    spec.pre = pre;
    const auto t = Load(spec);
    ASSERT_NE(t, nullptr) << pre;
    EXPECT_EQ(t->Encode("1234"), want) << pre;
  }
}

TEST(GgufTokenizerTest, MissingPreIsDefault) {
  Spec spec;
  spec.pre.reset();
  const auto t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("hello"), ElementsAre(kHell, 'o'));
  // Only the Llama 3 names add BOS by default.
  EXPECT_THAT(t->Encode("hello", true), ElementsAre(kHell, 'o'));
}

TEST(GgufTokenizerTest, MissingTypesMeanNormal) {
  Spec spec;
  spec.types.reset();
  spec.tokens[kPad] = "pad";
  const auto t = Load(spec);
  ASSERT_NE(t, nullptr);
  EXPECT_FALSE(t->IsSpecial(kBos));
  EXPECT_THAT(t->Encode("hello"), ElementsAre(kHell, 'o'));
}

// --- SentencePiece ("llama") --------------------------------------------------------------

// <unk> <s> </s>, the 256 byte tokens, then "▁", "a", "b", "ab", "▁a"; no scores (all 0).
std::filesystem::path WriteSentencePiece(const std::string& name, std::optional<bool> space_prefix,
                                         std::optional<bool> add_bos,
                                         std::optional<std::vector<int32_t>> types_override = {}) {
  std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char text[8];
    std::snprintf(text, sizeof(text), "<0x%02X>", b);
    tokens.push_back(text);
    types.push_back(6);
  }
  for (const char* p : {"▁", "a", "b", "ab", "▁a"}) {
    tokens.push_back(p);
    types.push_back(1);
  }
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", "llama");
  w.String("tokenizer.ggml.model", "llama");
  w.StringArray("tokenizer.ggml.tokens", tokens);
  w.I32Array("tokenizer.ggml.token_type", types_override ? *types_override : types);
  if (space_prefix) w.Bool("tokenizer.ggml.add_space_prefix", *space_prefix);
  if (add_bos) w.Bool("tokenizer.ggml.add_bos_token", *add_bos);
  return w.Write(name);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> OpenSentencePiece(const std::filesystem::path& path) {
  absl::StatusOr<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) return file.status();
  return TokenizerFromGguf(**file);
}

constexpr int32_t kSpace = 259, kA = 260, kB = 261, kAb = 262, kSpaceA = 263;

TEST(GgufSentencePieceTest, DefaultsAddBosAndSpacePrefix) {
  auto t = OpenSentencePiece(WriteSentencePiece("spm.gguf", std::nullopt, std::nullopt));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode("ab a"), ElementsAre(kSpaceA, kB, kSpaceA));
  EXPECT_THAT((*t)->Encode("a", /*add_special_tokens=*/true), ElementsAre(1, kSpaceA));
  EXPECT_THAT((*t)->Encode("</s>a"), ElementsAre(2, kSpaceA));
  EXPECT_THAT((*t)->Encode("\n"), ElementsAre(kSpace, 3 + '\n'));
  EXPECT_EQ(*(*t)->Decode((*t)->Encode("ab a\n")), "ab a\n");
  EXPECT_TRUE((*t)->IsSpecial(2));
  EXPECT_EQ((*t)->bos_token_id(), 1);
}

TEST(GgufSentencePieceTest, FlagsTurnPrefixAndBosOff) {
  auto t = OpenSentencePiece(WriteSentencePiece("spm.gguf", false, false));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT((*t)->Encode("ab a", true), ElementsAre(kAb, kSpaceA));
  // Without the prefix nothing is stripped when decoding either.
  const std::vector<int32_t> ids = {kSpaceA};
  EXPECT_EQ(*(*t)->Decode(ids), " a");
}

TEST(GgufSentencePieceTest, BadTypesAreRefused) {
  std::vector<int32_t> types(259 + 5, 1);
  types[7] = 11;
  auto t = OpenSentencePiece(WriteSentencePiece("bad.gguf", std::nullopt, std::nullopt, types));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("bad.gguf: tokenizer.ggml.token_type[7]: 11"));
  types.pop_back();
  t = OpenSentencePiece(WriteSentencePiece("bad.gguf", std::nullopt, std::nullopt, types));
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.ggml.token_type has 263 entries"));
}

// --- errors -------------------------------------------------------------------------------

void ExpectError(const Spec& spec, absl::StatusCode code, const std::string& what) {
  auto t = FromSpec(spec, "bad.gguf");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), code) << t.status();
  EXPECT_THAT(t.status().message(), HasSubstr(what));
  EXPECT_THAT(t.status().message(), HasSubstr("bad.gguf"));
}

TEST(GgufTokenizerTest, TypeCountMismatchIsRefused) {
  Spec spec;
  spec.types->pop_back();
  ExpectError(spec, absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.token_type has 261 entries but tokenizer.ggml.tokens has 262");
}

TEST(GgufTokenizerTest, UnknownPreIsRefused) {
  Spec spec;
  spec.pre = "falcon";
  ExpectError(spec, absl::StatusCode::kUnimplemented, "tokenizer.ggml.pre 'falcon'");
}

TEST(GgufTokenizerTest, OtherModelsAreRefused) {
  Spec spec;
  spec.model = "bert";
  ExpectError(spec, absl::StatusCode::kUnimplemented, "tokenizer.ggml.model 'bert'");
  spec.model = "t5";
  ExpectError(spec, absl::StatusCode::kUnimplemented, "tokenizer.ggml.model 't5'");
  spec.model.reset();
  ExpectError(spec, absl::StatusCode::kNotFound, "tokenizer.ggml.model");
}

TEST(GgufTokenizerTest, MissingMergesAreRefused) {
  Spec spec;
  spec.merges.reset();
  ExpectError(spec, absl::StatusCode::kNotFound, "tokenizer.ggml.merges");
}

TEST(GgufTokenizerTest, MergeOfAnUnknownTokenIsRefused) {
  Spec spec;
  spec.merges = std::vector<std::string>{"h e", "x y"};
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.merges[1]");
  spec.merges = std::vector<std::string>{"hey"};
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.merges[0]");
}

TEST(GgufTokenizerTest, RepeatedTokenIsRefused) {
  Spec spec;
  spec.tokens[kLl] = "he";
  ExpectError(spec, absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.tokens[257] 'he' repeats tokenizer.ggml.tokens[256]");
}

TEST(GgufTokenizerTest, UnknownTokenTypeIsRefused) {
  Spec spec;
  (*spec.types)[kHe] = 9;
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.token_type[256]: 9");
}

TEST(GgufTokenizerTest, InvalidUtf8IsRefused) {
  Spec spec;
  spec.tokens[kHe] = "\xFF";
  ExpectError(spec, absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.tokens[256] is not valid UTF-8");
}

TEST(GgufTokenizerTest, BosMustBeAToken) {
  Spec spec;
  spec.add_bos = true;
  spec.bos.reset();
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.bos_token_id is not set");
  spec.bos = 9999;
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.bos_token_id 9999");
  spec.bos = kPad;  // unused: no text to add
  ExpectError(spec, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.bos_token_id 261");
}

TEST(GgufTokenizerTest, WrongValueTypeIsRefused) {
  gguf_test::GgufTestWriter w;
  w.String("tokenizer.ggml.model", "gpt2");
  w.String("tokenizer.ggml.tokens", "not an array");
  auto file = GgufFile::Open(w.Write("wrong_type.gguf"));
  ASSERT_TRUE(file.ok()) << file.status();
  auto t = TokenizerFromGguf(**file);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("'tokenizer.ggml.tokens' is not an array"));
}

// --- LoadModelTokenizer -------------------------------------------------------------------

TEST(LoadModelTokenizerTest, GgufUsesEmbeddedElseTokenizerJsonBeside) {
  const std::filesystem::path dir = gguf_test::GgufTestWriter::TestDir() / "load_model_tokenizer";
  std::filesystem::remove_all(dir);
  const std::filesystem::path gguf = Spec().Write("load_model_tokenizer/m.gguf");
  auto t = LoadModelTokenizer(gguf);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE(*t, nullptr);
  EXPECT_THAT((*t)->Encode("hello"), ElementsAre(kHell, 'o'));

  // A tokenizer.json beside the file (bytes only, no merges) overrides the embedded one.
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    vocab += (b ? ", \"" : "\"") + std::string(b == '"' || b == '\\' ? "\\" : "") + ByteChar(b) +
             "\": " + std::to_string(b);
  }
  std::ofstream(dir / "tokenizer.json")
      << R"({"model": {"type": "BPE", "vocab": {)" << vocab << R"(}, "merges": []},)"
      << R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false},)"
      << R"("decoder": {"type": "ByteLevel"}})";
  t = LoadModelTokenizer(gguf);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE(*t, nullptr);
  EXPECT_THAT((*t)->Encode("hello"), ElementsAre('h', 'e', 'l', 'l', 'o'));
}

TEST(LoadModelTokenizerTest, NoneIsNull) {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", "llama");
  const std::filesystem::path gguf = w.Write("no_tokenizer/m.gguf");
  auto t = LoadModelTokenizer(gguf);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, nullptr);
  t = LoadModelTokenizer(gguf.parent_path());  // a directory without tokenizer.json
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, nullptr);
}

TEST(LoadModelTokenizerTest, BrokenEmbeddedTokenizerIsAnError) {
  Spec spec;
  spec.pre = "falcon";
  auto t = LoadModelTokenizer(spec.Write("broken_tokenizer/m.gguf"));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace kvgrid::model
