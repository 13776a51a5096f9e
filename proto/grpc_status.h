// absl::Status <-> grpc::Status, once, at the service edge. The canonical codes are the same
// numbers in both; messages pass through unchanged.
#ifndef KVGRID_PROTO_GRPC_STATUS_H_
#define KVGRID_PROTO_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvgrid::proto {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace kvgrid::proto

#endif  // KVGRID_PROTO_GRPC_STATUS_H_
