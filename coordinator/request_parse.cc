#include "coordinator/request_parse.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/support/slice.h"
#include "model/utf8.h"

namespace kvgrid::coordinator {
namespace {

namespace pb = google::protobuf;

// Messages nest at most this deep before the search gives up (protobuf's own limit is 100).
constexpr int kMaxDepth = 32;

// What the search found: the path of the first string that is not UTF-8, or that the bytes
// are not wire data protobuf could parse (which it would say only after logging a line for
// each invalid string it met before the bad bytes), or neither.
struct Scan {
  bool malformed = false;
  std::string path;
};

Scan Find(const pb::Descriptor* d, std::string_view bytes, const std::string& prefix,
          int depth) {
  if (depth > kMaxDepth) return {.malformed = true};
  pb::UnknownFieldSet fields;
  if (!fields.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return {.malformed = true};
  }
  std::map<int, int> seen;  // field number -> occurrences so far (the repeated index)
  for (int i = 0; i < fields.field_count(); ++i) {
    const pb::UnknownField& f = fields.field(i);
    const int index = seen[f.number()]++;
    if (f.type() != pb::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const pb::FieldDescriptor* fd = d->FindFieldByNumber(f.number());
    if (fd == nullptr) continue;
    std::string path = prefix.empty() ? fd->name() : absl::StrCat(prefix, ".", fd->name());
    if (fd->is_repeated()) absl::StrAppend(&path, "[", index, "]");
    const std::string& value = f.length_delimited();
    if (fd->type() == pb::FieldDescriptor::TYPE_STRING) {
      if (!model::IsValidUtf8(value)) return {.path = path};
    } else if (fd->type() == pb::FieldDescriptor::TYPE_MESSAGE) {
      Scan inner = Find(fd->message_type(), value, path, depth + 1);
      if (inner.malformed || !inner.path.empty()) return inner;
    }
  }
  return {};
}

}  // namespace

std::string FindInvalidUtf8(const pb::Descriptor* descriptor, std::string_view bytes) {
  return Find(descriptor, bytes, "", 0).path;
}

absl::Status ParseRequest(std::string_view bytes, pb::Message* message) {
  message->Clear();
  // Looked for first: protobuf would log an error line for every such request, which a
  // client could use to flood the log.
  // Bytes that are not wire data at all never reach protobuf either: it would log the
  // invalid strings it met before the bad bytes.
  const Scan scan = bytes.size() <= static_cast<size_t>(INT32_MAX)
                        ? Find(message->GetDescriptor(), bytes, "", 0)
                        : Scan{.malformed = true};
  if (!scan.path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(scan.path, ": invalid UTF-8"));
  }
  if (!scan.malformed &&
      message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::OkStatus();
  }
  message->Clear();
  return absl::InvalidArgumentError(
      absl::StrCat("not a valid ", message->GetDescriptor()->full_name()));
}

absl::Status ParseRequest(const grpc::ByteBuffer& buffer, pb::Message* message) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a valid ", message->GetDescriptor()->full_name()));
  }
  std::string bytes;
  bytes.reserve(buffer.Length());
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return ParseRequest(bytes, message);
}

absl::Status SerializeMessage(const google::protobuf::Message& message, grpc::ByteBuffer* out) {
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    return absl::InternalError(
        absl::StrCat("cannot serialize a ", message.GetTypeName(), " (", message.ByteSizeLong(),
                     " bytes)"));
  }
  grpc::Slice slice(std::move(bytes));
  *out = grpc::ByteBuffer(&slice, 1);
  return absl::OkStatus();
}

}  // namespace kvgrid::coordinator
