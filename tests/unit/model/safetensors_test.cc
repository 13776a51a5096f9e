#include "model/safetensors.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvgrid::model {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// --- A small safetensors writer for the tests ----------------------------------------------

struct Tensor {
  std::string name;
  std::string dtype;  // as written in the header: "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::string bytes;  // raw little-endian data
};

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file from a literal header (no padding) and data section, for malformed cases.
std::string RawFile(const std::string& header, const std::string& data = "") {
  return LengthPrefix(header.size()) + header + data;
}

// A well-formed file: tensors laid out back to back in the given order, header padded with
// spaces to a multiple of 8 like the reference writer does.
std::string BuildFile(const std::vector<Tensor>& tensors, const std::string& metadata = "") {
  std::vector<std::string> entries;
  if (!metadata.empty()) entries.push_back(absl::StrCat("\"__metadata__\": ", metadata));
  std::string data;
  for (const Tensor& t : tensors) {
    entries.push_back(absl::StrCat("\"", t.name, "\": {\"dtype\": \"", t.dtype, "\", \"shape\": [",
                                   absl::StrJoin(t.shape, ", "), "], \"data_offsets\": [",
                                   data.size(), ", ", data.size() + t.bytes.size(), "]}"));
    data += t.bytes;
  }
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ", "), "}");
  while (header.size() % 8 != 0) header += ' ';
  return RawFile(header, data);
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           absl::StrCat("safetensors_test_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path Write(const std::string& name, const std::string& contents) {
    const fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    return path;
  }

  // Opens `contents` as a file and expects `code` with every substring in the message.
  void ExpectOpenError(const std::string& contents, absl::StatusCode code,
                       const std::vector<std::string>& substrings) {
    const fs::path path = Write("bad.safetensors", contents);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << "accepted";
    EXPECT_EQ(file.status().code(), code) << file.status();
    const std::string message(file.status().message());
    EXPECT_THAT(message, HasSubstr(path.string())) << "the error must name the file";
    for (const std::string& s : substrings) EXPECT_THAT(message, HasSubstr(s));
    // Checkpoint::Open reports the same error.
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(path);
    ASSERT_FALSE(checkpoint.ok());
    EXPECT_EQ(checkpoint.status().code(), code);
  }

  fs::path dir_;
};

// --- Valid files -------------------------------------------------------------------------

TEST_F(SafetensorsTest, F32ValuesAreExact) {
  const std::vector<float> values = {1.5f, -2.25f, 3e-38f, std::numeric_limits<float>::infinity(),
                                     0.1f, -0.0f};
  const fs::path path =
      Write("model.safetensors", BuildFile({{"w", "F32", {2, 3}, Bytes(values)}}));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::StatusOr<const TensorView*> view = (*ckpt)->Find("w");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ((*view)->dtype, DType::kF32);
  EXPECT_THAT((*view)->shape, ElementsAre(2, 3));
  EXPECT_EQ((*view)->NumElements(), 6);
  EXPECT_EQ((*view)->data.size(), 24u);
  EXPECT_EQ((*view)->file, path);

  std::vector<float> out;
  const std::vector<int64_t> shape = {2, 3};
  ASSERT_TRUE((*ckpt)->ReadF32("w", shape, &out).ok());
  ASSERT_EQ(out.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &out[i], 4);
    std::memcpy(&b, &values[i], 4);
    EXPECT_EQ(a, b) << i;
  }
}

TEST_F(SafetensorsTest, F16ValuesAreExact) {
  // 1, -2, smallest subnormal 2^-24, largest finite 65504, -inf, 0.5 + 2^-11.
  const std::vector<uint16_t> bits = {0x3c00, 0xc000, 0x0001, 0x7bff, 0xfc00, 0x3801};
  const std::vector<float> want = {1.0f,
                                   -2.0f,
                                   std::ldexp(1.0f, -24),
                                   65504.0f,
                                   -std::numeric_limits<float>::infinity(),
                                   0.5f + std::ldexp(1.0f, -11)};
  const fs::path path = Write("model.safetensors", BuildFile({{"h", "F16", {6}, Bytes(bits)}}));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->Find("h").value()->dtype, DType::kF16);
  std::vector<float> out;
  ASSERT_TRUE((*ckpt)->ReadF32("h", {}, &out).ok());
  ASSERT_EQ(out.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(out[i], want[i]) << i;
}

TEST_F(SafetensorsTest, BF16ValuesAreExact) {
  // 1, -3, largest finite, smallest normal, 1 + 2^-7.
  const std::vector<uint16_t> bits = {0x3f80, 0xc040, 0x7f7f, 0x0080, 0x3f81};
  const std::vector<float> want = {1.0f, -3.0f, std::ldexp(255.0f, 120),
                                   std::numeric_limits<float>::min(), 1.0f + 1.0f / 128};
  const fs::path path = Write("model.safetensors", BuildFile({{"b", "BF16", {1, 5}, Bytes(bits)}}));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::vector<float> out;
  const std::vector<int64_t> shape = {1, 5};
  ASSERT_TRUE((*ckpt)->ReadF32("b", shape, &out).ok());
  ASSERT_EQ(out.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(out[i], want[i]) << i;
}

TEST_F(SafetensorsTest, IntegerDtypesAreViewedButNotConverted) {
  const std::vector<int8_t> i8 = {-128, 0, 127};
  const std::vector<uint8_t> u8 = {0, 200, 255, 7};
  const std::vector<int32_t> i32 = {-5, 1 << 30};
  const fs::path path = Write("model.safetensors", BuildFile({{"a", "I8", {3}, Bytes(i8)},
                                                              {"b", "U8", {2, 2}, Bytes(u8)},
                                                              {"c", "I32", {2}, Bytes(i32)}}));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const auto& tensors = (*file)->tensors();
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors.at("a").dtype, DType::kI8);
  EXPECT_EQ(tensors.at("b").dtype, DType::kU8);
  EXPECT_EQ(tensors.at("c").dtype, DType::kI32);
  int32_t second;
  std::memcpy(&second, tensors.at("c").data.data() + 4, 4);
  EXPECT_EQ(second, 1 << 30);
  EXPECT_EQ(static_cast<uint8_t>(tensors.at("b").data[1]), 200);

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok());
  std::vector<float> out;
  absl::Status s = (*ckpt)->ReadF32("a", {}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'a' has dtype i8"));
}

TEST_F(SafetensorsTest, MetadataAndEmptyTensors) {
  const fs::path path =
      Write("model.safetensors", BuildFile({{"empty", "F32", {0, 4}, ""},
                                            {"x", "F32", {1}, Bytes(std::vector<float>{2.0f})},
                                            {"scalar", "F32", {}, Bytes(std::vector<float>{7.0f})}},
                                           R"({"format": "pt", "note": "hi"})"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->metadata().at("note"), "hi");
  EXPECT_EQ((*file)->tensors().size(), 3u);
  EXPECT_EQ((*file)->tensors().at("empty").NumElements(), 0);
  EXPECT_EQ((*file)->tensors().at("scalar").NumElements(), 1);

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok());
  std::vector<float> out = {1, 2, 3};
  ASSERT_TRUE((*ckpt)->ReadF32("empty", {}, &out).ok());
  EXPECT_TRUE(out.empty());
  ASSERT_TRUE((*ckpt)->ReadF32("scalar", {}, &out).ok());
  EXPECT_THAT(out, ElementsAre(7.0f));
}

TEST_F(SafetensorsTest, MisalignedDataIsReadCorrectly) {
  // A 3-byte header puts tensor data at offset 11: no element is naturally aligned.
  const std::vector<float> values = {1.25f, -8.5f, 3.0f};
  const std::vector<uint16_t> halves = {0x3c00, 0x4000};
  const std::string header =
      absl::StrCat(R"({"f":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)",
                   R"("h":{"dtype":"F16","shape":[2],"data_offsets":[12,16]})");
  std::string text = header;
  text += "}";
  if (text.size() % 4 == 0) text += ' ';  // keep the data misaligned
  const fs::path path = Write("model.safetensors", RawFile(text, Bytes(values) + Bytes(halves)));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_NE(reinterpret_cast<uintptr_t>((*ckpt)->Find("f").value()->data.data()) % 4, 0u);
  std::vector<float> out;
  ASSERT_TRUE((*ckpt)->ReadF32("f", {}, &out).ok());
  EXPECT_THAT(out, ElementsAre(1.25f, -8.5f, 3.0f));
  ASSERT_TRUE((*ckpt)->ReadF32("h", {}, &out).ok());
  EXPECT_THAT(out, ElementsAre(1.0f, 2.0f));
}

TEST_F(SafetensorsTest, ReadF32ChecksShapeAndName) {
  const fs::path path = Write(
      "model.safetensors", BuildFile({{"w", "F32", {2, 3}, Bytes(std::vector<float>(6, 1.0f))}}));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok());
  std::vector<float> out;
  const std::vector<int64_t> wrong = {3, 2};
  absl::Status s = (*ckpt)->ReadF32("w", wrong, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'w' has shape [2, 3], expected [3, 2]"));
  const std::vector<int64_t> shorter = {6};
  EXPECT_EQ((*ckpt)->ReadF32("w", shorter, &out).code(), absl::StatusCode::kInvalidArgument);

  s = (*ckpt)->ReadF32("nope", {}, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor 'nope' not found"));
  EXPECT_FALSE((*ckpt)->Contains("nope"));
  EXPECT_TRUE((*ckpt)->Contains("w"));
  EXPECT_EQ((*ckpt)->Find("nope").status().code(), absl::StatusCode::kNotFound);
}

// --- Sharded checkpoints -----------------------------------------------------------------

class ShardedTest : public SafetensorsTest {
 protected:
  void WriteShards() {
    Write("model-00001-of-00002.safetensors",
          BuildFile({{"embed", "BF16", {2}, Bytes(std::vector<uint16_t>{0x3f80, 0x4000})},
                     {"layer0", "F32", {1}, Bytes(std::vector<float>{5.0f})}}));
    Write("model-00002-of-00002.safetensors",
          BuildFile({{"layer1", "F16", {2}, Bytes(std::vector<uint16_t>{0x4200, 0xbc00})}}));
  }
  std::string Index(const std::string& extra_entries = "") {
    return absl::StrCat(R"({"metadata": {"total_size": 16}, "weight_map": {)",
                        R"("embed": "model-00001-of-00002.safetensors",)",
                        R"("layer0": "model-00001-of-00002.safetensors",)",
                        R"("layer1": "model-00002-of-00002.safetensors")", extra_entries, "}}");
  }
};

TEST_F(ShardedTest, OpensDirectoryAndIndex) {
  WriteShards();
  const fs::path index = Write("model.safetensors.index.json", Index());
  // A stray single file must lose to the index.
  Write("model.safetensors", BuildFile({{"stray", "F32", {1}, Bytes(std::vector<float>{0})}}));

  for (const fs::path& path : {dir_, index}) {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    EXPECT_THAT((*ckpt)->Names(), ElementsAre("embed", "layer0", "layer1"));
    std::vector<float> out;
    ASSERT_TRUE((*ckpt)->ReadF32("embed", {}, &out).ok());
    EXPECT_THAT(out, ElementsAre(1.0f, 2.0f));
    ASSERT_TRUE((*ckpt)->ReadF32("layer0", {}, &out).ok());
    EXPECT_THAT(out, ElementsAre(5.0f));
    ASSERT_TRUE((*ckpt)->ReadF32("layer1", {}, &out).ok());
    EXPECT_THAT(out, ElementsAre(3.0f, -1.0f));
    EXPECT_EQ((*ckpt)->Find("layer1").value()->file, dir_ / "model-00002-of-00002.safetensors");
    EXPECT_FALSE((*ckpt)->Contains("stray"));
  }
}

TEST_F(ShardedTest, DirectoryWithSingleFile) {
  Write("model.safetensors", BuildFile({{"only", "F32", {1}, Bytes(std::vector<float>{4.0f})}}));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->Names(), ElementsAre("only"));
}

TEST_F(ShardedTest, TensorsTheIndexDoesNotListAreNotExposed) {
  WriteShards();
  Write("model.safetensors.index.json",
        R"({"weight_map": {"embed": "model-00001-of-00002.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->Names(), ElementsAre("embed"));
}

TEST_F(ShardedTest, MissingShard) {
  WriteShards();
  fs::remove(dir_ / "model-00002-of-00002.safetensors");
  const fs::path index = Write("model.safetensors.index.json", Index());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(ckpt.status().message());
  EXPECT_THAT(message, HasSubstr(index.string()));
  EXPECT_THAT(message, HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_THAT(message, HasSubstr("layer1"));
  EXPECT_THAT(message, HasSubstr("missing"));
}

TEST_F(ShardedTest, IndexListsATensorTheShardLacks) {
  WriteShards();
  const fs::path index = Write("model.safetensors.index.json",
                               Index(R"(, "layer2": "model-00002-of-00002.safetensors")"));
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(index);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(ckpt.status().message());
  EXPECT_THAT(message, HasSubstr(index.string()));
  EXPECT_THAT(message, HasSubstr("tensor 'layer2'"));
  EXPECT_THAT(message, HasSubstr("model-00002-of-00002.safetensors, which does not contain it"));
}

TEST_F(ShardedTest, MalformedIndexes) {
  WriteShards();
  struct Case {
    std::string text;
    std::string want;
  };
  for (const Case& c : std::vector<Case>{
           {"{", "malformed JSON"},
           {"[]", "expected a JSON object"},
           {R"({"metadata": {}})", "weight_map: missing"},
           {R"({"weight_map": []})", "weight_map: expected an object"},
           {R"({"weight_map": {"a": 3}})", "weight_map: tensor 'a': expected a shard file name"},
           {R"({"weight_map": {"a": "/etc/passwd"}})", "must be a relative path"},
           {R"({"weight_map": {"a": "../x.safetensors"}})", "must be a relative path"},
       }) {
    const fs::path index = Write("model.safetensors.index.json", c.text);
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    ASSERT_FALSE(ckpt.ok()) << c.text;
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(index.string()));
    EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr(c.want)) << c.text;
  }
}

TEST_F(ShardedTest, BrokenShardReportsTheShard) {
  WriteShards();
  Write("model-00002-of-00002.safetensors", "xy");
  Write("model.safetensors.index.json", Index());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ckpt.status().message()),
              HasSubstr("model-00002-of-00002.safetensors: file too small"));
}

TEST_F(SafetensorsTest, NothingThere) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(
      std::string(ckpt.status().message()),
      HasSubstr("no model.safetensors or model.safetensors.index.json in " + dir_.string()));

  EXPECT_EQ(Checkpoint::Open(dir_ / "absent.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir_ / "absent.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

// --- Malformed files ---------------------------------------------------------------------

TEST_F(SafetensorsTest, EmptyAndTinyFiles) {
  ExpectOpenError("", absl::StatusCode::kInvalidArgument,
                  {"file too small for the 8-byte header (0 bytes)"});
  ExpectOpenError("abc", absl::StatusCode::kInvalidArgument,
                  {"file too small for the 8-byte header (3 bytes)"});
}

TEST_F(SafetensorsTest, TruncatedFile) {
  const std::string full = BuildFile({{"w", "F32", {4}, Bytes(std::vector<float>{1, 2, 3, 4})}});
  // Cut inside the data: the tensor's end now lies past the data section.
  ExpectOpenError(full.substr(0, full.size() - 3), absl::StatusCode::kInvalidArgument,
                  {"tensor 'w'", "data_offsets: end 16 is beyond the data section of 13 bytes"});
  // Cut inside the header.
  ExpectOpenError(full.substr(0, 20), absl::StatusCode::kInvalidArgument,
                  {"runs past the end of the file"});
}

TEST_F(SafetensorsTest, HeaderLengthLargerThanFile) {
  ExpectOpenError(LengthPrefix(1000) + "{}", absl::StatusCode::kInvalidArgument,
                  {"header length 1000 runs past the end of the file (10 bytes)"});
}

TEST_F(SafetensorsTest, HeaderOverTheLimit) {
  ExpectOpenError(LengthPrefix(kMaxSafetensorsHeaderBytes + 1) + "{}",
                  absl::StatusCode::kInvalidArgument,
                  {"header length 100000001 exceeds the limit of 100000000 bytes"});
  // A length near 2^64 must not wrap around when the data start is computed.
  ExpectOpenError(LengthPrefix(std::numeric_limits<uint64_t>::max()) + "{}",
                  absl::StatusCode::kInvalidArgument, {"exceeds the limit"});
}

TEST_F(SafetensorsTest, HeaderNotJsonOrNotAnObject) {
  ExpectOpenError(RawFile("{\"w\": {"), absl::StatusCode::kInvalidArgument,
                  {"header is not valid JSON", "parse error"});
  ExpectOpenError(RawFile("\xff\xfe"), absl::StatusCode::kInvalidArgument,
                  {"header is not valid JSON"});
  ExpectOpenError(RawFile(""), absl::StatusCode::kInvalidArgument, {"header is not valid JSON"});
  ExpectOpenError(RawFile("[1, 2]"), absl::StatusCode::kInvalidArgument,
                  {"header is not a JSON object (got array)"});
  ExpectOpenError(RawFile("{\"w\": 5}"), absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': expected an object"});
}

TEST_F(SafetensorsTest, BadDtype) {
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kUnimplemented,
                  {"tensor 'w'", "dtype \"F64\" is not supported"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}})", "x"),
                  absl::StatusCode::kUnimplemented, {"tensor 'w'", "\"Q9\""});
  ExpectOpenError(RawFile(R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})", "xxxx"),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': dtype: expected a string"});
  ExpectOpenError(RawFile(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", "xxxx"),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': dtype: missing"});
}

TEST_F(SafetensorsTest, BadShape) {
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': shape: dimension 1 is number -1, not a non-negative integer"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': shape: dimension 0"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': shape: expected a list"});
  ExpectOpenError(
      RawFile(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", std::string(8, '\0')),
      absl::StatusCode::kInvalidArgument, {"tensor 'w': shape: missing"});
}

TEST_F(SafetensorsTest, ShapeProductOverflow) {
  // 2^40 * 2^40 overflows 64 bits.
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1099511627776, 1099511627776],
                        "data_offsets": [0, 4]}})",
                          "xxxx"),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': shape: element count", "overflows"});
  // 2^62 elements fit, but 2^62 * 4 bytes does not.
  ExpectOpenError(
      RawFile(R"({"w": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 4]}})",
              "xxxx"),
      absl::StatusCode::kInvalidArgument, {"tensor 'w': shape: byte size", "overflows 64 bits"});
  // A dimension beyond int64.
  ExpectOpenError(
      RawFile(R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 1]}})",
              "x"),
      absl::StatusCode::kInvalidArgument, {"tensor 'w': shape: element count"});
}

TEST_F(SafetensorsTest, BadOffsets) {
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 100]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': data_offsets: end 100 is beyond the data section of 8 bytes"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': data_offsets: begin 8 is after end 4"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': data_offsets: expected [begin, end]"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': data_offsets: expected"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1]}})", std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"tensor 'w': data_offsets: missing"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [1],
                        "data_offsets": [18446744073709551612, 18446744073709551615]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"beyond the data section"});
}

TEST_F(SafetensorsTest, SizeMismatch) {
  ExpectOpenError(RawFile(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'w': data_offsets: [0, 8] holds 8 bytes, but shape [3] x F32 needs 12"});
  ExpectOpenError(RawFile(R"({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 4]}})",
                          std::string(8, '\0')),
                  absl::StatusCode::kInvalidArgument, {"needs 8"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  ExpectOpenError(RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                          std::string(12, '\0')),
                  absl::StatusCode::kInvalidArgument,
                  {"tensor 'a' [0, 8) and tensor 'b' [4, 12) overlap"});
  // Identical ranges, listed in the other name order.
  ExpectOpenError(RawFile(R"({"z": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                              "y": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                          std::string(4, '\0')),
                  absl::StatusCode::kInvalidArgument, {"overlap"});
  // One tensor inside another.
  ExpectOpenError(RawFile(R"({"big": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                              "in": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]},
                              "tail": {"dtype": "U8", "shape": [1], "data_offsets": [8, 9]}})",
                          std::string(9, '\0')),
                  absl::StatusCode::kInvalidArgument, {"tensor 'big'", "tensor 'in'", "overlap"});
}

TEST_F(SafetensorsTest, AdjacentTensorsAndGapsAreFine) {
  const fs::path path = Write(
      "ok.safetensors", RawFile(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                  "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
                  "c": {"dtype": "U8", "shape": [0], "data_offsets": [1, 1]},
                  "d": {"dtype": "U8", "shape": [1], "data_offsets": [6, 7]}})",
                                std::string(8, '\0')));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 4u);
}

TEST_F(SafetensorsTest, BadMetadata) {
  ExpectOpenError(RawFile(R"({"__metadata__": {"format": 1}})"), absl::StatusCode::kInvalidArgument,
                  {"__metadata__: value of \"format\" is not a string"});
  ExpectOpenError(RawFile(R"({"__metadata__": "pt"})"), absl::StatusCode::kInvalidArgument,
                  {"__metadata__: expected an object of strings"});
}

TEST_F(SafetensorsTest, NotARegularFile) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(dir_);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvgrid::model
