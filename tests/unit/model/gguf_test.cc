// GgufFile on hand-written files: numeric metadata arrays are held at their own width inside
// the mapping (a large u8 array costs no heap), and counts the file cannot hold are refused
// naming the key before anything is allocated for them.
#include "model/gguf.h"

#include <sys/resource.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/model/gguf_test_writer.h"

namespace kvgrid::model {
namespace {

using ::testing::HasSubstr;

int64_t PeakRssBytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

TEST(GgufFileTest, IntegerArraysKeepTheirValues) {
  gguf_test::GgufTestWriter w;
  w.I32Array("a.i32", {-3, 0, 7});
  w.U8Array("a.u8", 4, 200);
  auto file = GgufFile::Open(w.Write("ints.gguf"));
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const GgufNumberArray*> i32 = (*file)->GetIntArray("a.i32");
  ASSERT_TRUE(i32.ok()) << i32.status();
  ASSERT_EQ((*i32)->size(), 3u);
  EXPECT_EQ((*i32)->element_bytes(), 4u);
  EXPECT_EQ((*i32)->Int(0), -3);
  EXPECT_EQ((*i32)->Int(2), 7);
  EXPECT_DOUBLE_EQ((*i32)->Float(2), 7.0);
  absl::StatusOr<const GgufNumberArray*> u8 = (*file)->GetIntArray("a.u8");
  ASSERT_TRUE(u8.ok()) << u8.status();
  EXPECT_EQ((*u8)->element_bytes(), 1u);
  EXPECT_EQ((*u8)->Int(3), 200);
  EXPECT_THAT((*file)->GetStringArray("a.u8").status().message(),
              HasSubstr("is not an array of strings"));
}

// The finding: a 64 MiB u8 array made the reader hold 627 MB (each element widened to an
// int64_t). Held in the mapping, opening the file must not grow the peak RSS by anything near
// eight times the array.
TEST(GgufFileTest, LargeU8ArrayIsNotWidened) {
  constexpr uint64_t kCount = uint64_t{64} << 20;
  std::filesystem::path path;
  {
    gguf_test::GgufTestWriter w;
    w.U8Array("big", kCount, 1);
    path = w.Write("big.gguf");
  }
  const int64_t before = PeakRssBytes();
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const int64_t grown = PeakRssBytes() - before;
  absl::StatusOr<const GgufNumberArray*> big = (*file)->GetIntArray("big");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ((*big)->size(), kCount);
  EXPECT_EQ((*big)->Int(kCount - 1), 1);
  EXPECT_LT(grown, static_cast<int64_t>(kCount)) << "peak RSS grew by " << grown << " bytes";
}

TEST(GgufFileTest, CountsTheFileCannotHoldAreRefusedNamingTheKey) {
  for (uint32_t elem : {0u, 5u, 8u, 12u}) {  // u8, i32, string, f64
    gguf_test::GgufTestWriter w;
    w.LyingArray("tokenizer.ggml.lie", elem, uint64_t{1} << 40, std::string(64, '\0'));
    auto file = GgufFile::Open(w.Write("lie.gguf"));
    ASSERT_FALSE(file.ok()) << "element type " << elem;
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(file.status().message(), HasSubstr("'tokenizer.ggml.lie'"));
    EXPECT_THAT(file.status().message(), HasSubstr("do not fit in the file"));
  }
}

TEST(GgufFileTest, BoolArrayValuesOtherThanZeroAndOneAreRefused) {
  gguf_test::GgufTestWriter w;
  w.LyingArray("flags", 7, 3, std::string("\x01\x00\x02", 3));
  auto file = GgufFile::Open(w.Write("bools.gguf"));
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("'flags': element 2"));
}

TEST(GgufFileTest, StringArrayRunningPastTheFileIsRefused) {
  // Three strings claimed; the third says it is 1000 bytes long and the file ends first.
  gguf_test::GgufTestWriter w;
  std::string payload;
  for (const std::string s : {"ab", "c"}) {
    const uint64_t n = s.size();
    payload.append(reinterpret_cast<const char*>(&n), sizeof(n));
    payload.append(s);
  }
  const uint64_t n = 1000;
  payload.append(reinterpret_cast<const char*>(&n), sizeof(n));
  w.LyingArray("toks", 8, 3, payload);
  auto file = GgufFile::Open(w.Write("strings.gguf"));
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr("'toks': truncated string array"));
}

TEST(GgufFileTest, StringArraysAreViewsOfTheFile) {
  gguf_test::GgufTestWriter w;
  w.StringArray("toks", {"", "a", "longer than fifteen bytes"});
  auto file = GgufFile::Open(w.Write("views.gguf"));
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const GgufStringArray*> toks = (*file)->GetStringArray("toks");
  ASSERT_TRUE(toks.ok()) << toks.status();
  ASSERT_EQ((*toks)->size(), 3u);
  EXPECT_EQ((**toks)[0], "");
  EXPECT_EQ((**toks)[2], "longer than fifteen bytes");
  EXPECT_EQ((*toks)->ToVector(), (std::vector<std::string>{"", "a", "longer than fifteen bytes"}));
  EXPECT_THAT((*file)->GetIntArray("toks").status().message(), HasSubstr("not an array of numbers"));
}

// 8 million empty strings (64 MiB of lengths) held 330 MB as std::strings; as views the reader
// holds one offset per element, the file's own size.
TEST(GgufFileTest, LargeStringArrayCostsAboutTheFile) {
  constexpr uint64_t kCount = uint64_t{8} << 20;
  std::filesystem::path path;
  {
    gguf_test::GgufTestWriter w;
    w.LyingArray("strs", 8, kCount, std::string(kCount * 8, '\0'));
    path = w.Write("strs.gguf");
  }
  const int64_t before = PeakRssBytes();
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const int64_t grown = PeakRssBytes() - before;
  absl::StatusOr<const GgufStringArray*> strs = (*file)->GetStringArray("strs");
  ASSERT_TRUE(strs.ok()) << strs.status();
  EXPECT_EQ((*strs)->size(), kCount);
  // The offsets (8 bytes each) and the mapped pages the parse touched, nothing more.
  EXPECT_LT(grown, static_cast<int64_t>(kCount * 8 * 5 / 2)) << "peak RSS grew by " << grown;
}

}  // namespace
}  // namespace kvgrid::model
