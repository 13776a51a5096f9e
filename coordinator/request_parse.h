// Parsing a public request from its wire bytes with an error that names what is wrong.
//
// protobuf refuses a proto3 string field holding invalid UTF-8, and gRPC's callback API turns
// any parse failure into UNIMPLEMENTED with an empty message. Methods whose requests carry
// strings are therefore registered raw (ByteBuffer) and parsed here, so the client learns
// which field it got wrong ("messages[2].content: invalid UTF-8").
//
// Thread-safety: stateless functions.
#ifndef KVGRID_COORDINATOR_REQUEST_PARSE_H_
#define KVGRID_COORDINATOR_REQUEST_PARSE_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "grpcpp/support/byte_buffer.h"

namespace kvgrid::coordinator {

// Parses `bytes` into `message` (cleared first). Errors: INVALID_ARGUMENT "<path>: invalid
// UTF-8" for the first string field (nested and repeated ones by path, e.g.
// "messages[2].content") whose bytes are not UTF-8, else "not a valid <full message name>".
absl::Status ParseRequest(std::string_view bytes, google::protobuf::Message* message);
absl::Status ParseRequest(const grpc::ByteBuffer& buffer, google::protobuf::Message* message);

// `message` as wire bytes in `out` (replaced), as gRPC serializes a typed method's messages,
// for methods registered raw. Errors: INTERNAL when it cannot be serialized (over 2 GiB).
absl::Status SerializeMessage(const google::protobuf::Message& message, grpc::ByteBuffer* out);

// The path of the first string field of a `descriptor` message encoded in `bytes` that holds
// invalid UTF-8, or "" when there is none (or the bytes are not well-formed wire data).
std::string FindInvalidUtf8(const google::protobuf::Descriptor* descriptor,
                            std::string_view bytes);

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_REQUEST_PARSE_H_
