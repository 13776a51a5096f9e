// libFuzzer target for the public gRPC methods' request parsing (coordinator/request_parse.h):
// any bytes are parsed or refused with INVALID_ARGUMENT, never a crash; the UTF-8 search finds
// every invalid string before protobuf does (protobuf logs a line for each one it meets, and a
// log line here is a finding), names a path that its refusal repeats, and what parses
// serializes back into bytes that parse again to the same message.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "coordinator/request_parse.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "kvgrid/v1/generation.pb.h"

namespace {

void AbortOnProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                        const std::string& message) {
  std::fprintf(stderr, "protobuf logged (%s:%d): %s\n", file, line, message.c_str());
  std::abort();
}

// Deterministic, so that map fields come out in one order.
std::string Serialize(const google::protobuf::Message& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!m.SerializeToCodedStream(&coded)) std::abort();
  }
  return out;
}

template <typename Message>
void Check(std::string_view bytes) {
  Message m;
  const absl::Status s = kvgrid::coordinator::ParseRequest(bytes, &m);
  const std::string path =
      kvgrid::coordinator::FindInvalidUtf8(Message::descriptor(), bytes);
  if (!s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument || s.message().empty()) std::abort();
    if (!path.empty() && s.message() != path + ": invalid UTF-8") std::abort();
    return;
  }
  if (!path.empty()) std::abort();
  const std::string again = Serialize(m);
  Message back;
  if (!kvgrid::coordinator::ParseRequest(again, &back).ok()) std::abort();
  if (Serialize(back) != again) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(&AbortOnProtobufLog);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  Check<kvgrid::v1::GenerateRequest>(bytes);
  Check<kvgrid::v1::TokenizeRequest>(bytes);
  Check<kvgrid::v1::DetokenizeRequest>(bytes);
  return 0;
}
