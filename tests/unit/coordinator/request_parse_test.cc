// ParseRequest: wire bytes that protobuf refuses are answered INVALID_ARGUMENT naming the
// string field that is not UTF-8, by its path through nested and repeated messages, or saying
// the bytes are no request at all.
#include "coordinator/request_parse.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "google/protobuf/stubs/logging.h"
#include "kvgrid/v1/generation.pb.h"

namespace kvgrid::coordinator {
namespace {

using ::testing::HasSubstr;

constexpr char kMarker[] = "QQQQ";

// `message` serialized with its one kMarker replaced by bytes that are not UTF-8.
std::string Corrupt(const google::protobuf::Message& message) {
  std::string bytes = message.SerializeAsString();
  const size_t at = bytes.find(kMarker);
  EXPECT_NE(at, std::string::npos);
  EXPECT_EQ(bytes.find(kMarker, at + 1), std::string::npos);
  bytes.replace(at, 4, "\xff\xfe\xc3(");
  return bytes;
}

TEST(RequestParseTest, ValidBytesParse) {
  v1::GenerateRequest in;
  in.set_prompt("In the beginning \xe2\x9c\x93");
  in.set_request_id("r1");
  v1::GenerateRequest out;
  ASSERT_TRUE(ParseRequest(in.SerializeAsString(), &out).ok());
  EXPECT_EQ(out.prompt(), in.prompt());
  EXPECT_EQ(out.request_id(), "r1");
}

TEST(RequestParseTest, InvalidUtf8InATopLevelFieldIsNamed) {
  v1::GenerateRequest in;
  in.set_model("kjv-tiny");
  in.set_prompt(kMarker);
  v1::GenerateRequest out;
  const absl::Status s = ParseRequest(Corrupt(in), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "prompt: invalid UTF-8");
}

TEST(RequestParseTest, InvalidUtf8InARepeatedMessageIsNamedByPath) {
  v1::GenerateRequest in;
  for (const char* content : {"a", "b", kMarker}) {
    v1::ChatMessage* m = in.add_messages();
    m->set_role("user");
    m->set_content(content);
  }
  v1::GenerateRequest out;
  EXPECT_EQ(ParseRequest(Corrupt(in), &out).message(), "messages[2].content: invalid UTF-8");
}

TEST(RequestParseTest, StopStringsAreNamedByIndex) {
  v1::GenerateRequest in;
  in.set_prompt("x");
  in.mutable_stopping()->add_stop("ok");
  in.mutable_stopping()->add_stop(kMarker);
  v1::GenerateRequest out;
  EXPECT_EQ(ParseRequest(Corrupt(in), &out).message(), "stopping.stop[1]: invalid UTF-8");
}

TEST(RequestParseTest, OverlongAndSurrogateEncodingsAreInvalid) {
  for (const std::string bad : {std::string("\xc0\xaf"), std::string("\xed\xa0\x80"),
                                std::string("\xf4\x90\x80\x80"), std::string("\xe2\x9c")}) {
    v1::TokenizeRequest in;
    in.set_text(kMarker);
    std::string bytes = in.SerializeAsString();
    bytes.replace(bytes.find(kMarker), 4, bad + std::string(4 - bad.size(), 'a'));
    EXPECT_EQ(FindInvalidUtf8(v1::TokenizeRequest::descriptor(), bytes), "text") << bad;
  }
}

TEST(RequestParseTest, BytesThatAreNoMessageSaySo) {
  v1::GenerateRequest out;
  const absl::Status s = ParseRequest(std::string("\xff\xff\xff\xff"), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not a valid kvgrid.v1.GenerateRequest"));
}

// Found by tests/fuzz/grpc_request_fuzz: bytes that fail to parse only after an invalid
// string made protobuf log a line for it, once per request. They are refused before protobuf
// sees them, and protobuf logs nothing.
int protobuf_log_lines = 0;
void CountProtobufLog(google::protobuf::LogLevel, const char*, int, const std::string&) {
  ++protobuf_log_lines;
}

TEST(RequestParseTest, MalformedBytesAfterAnInvalidStringNeverReachProtobuf) {
  google::protobuf::LogHandler* previous = google::protobuf::SetLogHandler(&CountProtobufLog);
  protobuf_log_lines = 0;
  v1::GenerateRequest in;
  in.set_prompt(kMarker);
  v1::GenerateRequest nested;
  nested.add_messages()->set_content(kMarker);
  for (const std::string& valid_then_bad :
       {Corrupt(in) + "\xff\xff\xff", Corrupt(nested) + std::string("\x0a\x05" "ab")}) {
    v1::GenerateRequest out;
    const absl::Status s = ParseRequest(valid_then_bad, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("not a valid kvgrid.v1.GenerateRequest"));
  }
  // A truncated nested message holding an invalid string, then more fields.
  std::string inner = Corrupt(nested);
  inner.pop_back();
  v1::GenerateRequest out;
  EXPECT_EQ(ParseRequest(inner, &out).code(), absl::StatusCode::kInvalidArgument);
  google::protobuf::SetLogHandler(previous);
  EXPECT_EQ(protobuf_log_lines, 0);
}

}  // namespace
}  // namespace kvgrid::coordinator
