// What `kvgrid generate` and `kvgrid chat` share as clients of a running cluster: the
// connection flags (--addr, --api-key, TLS), the sampling flags as request fields, and one
// streamed Generate call.
#ifndef KVGRID_TOOLS_KVGRID_CLUSTER_CLIENT_H_
#define KVGRID_TOOLS_KVGRID_CLUSTER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "auth/tls.h"
#include "kvgrid/v1/generation.grpc.pb.h"
#include "tools/kvgrid/args.h"
#include "tools/kvgrid/sampling_flags.h"

namespace kvgrid::cli {

// --addr (default 127.0.0.1:50051), --api-key (default $KVGRID_API_KEY), --tls, --tls-ca,
// --tls-cert, --tls-key, --timeout-s.
struct ConnectionFlags {
  std::string addr;
  std::string api_key;
  auth::TlsFiles tls_files;
  bool tls = false;
  std::optional<double> timeout_s;  // deadline of each call
};

// Errors: INVALID_ARGUMENT naming a flag whose value does not parse.
absl::StatusOr<ConnectionFlags> ReadConnectionFlags(Args& args);

// A stub on a channel to flags.addr. Errors: as auth::ChannelCredentials (unreadable files).
absl::StatusOr<std::unique_ptr<v1::Generation::Stub>> Connect(const ConnectionFlags& flags);

// Sets the sampling and stopping fields of `request` that `flags` give.
void ApplySamplingFlags(const SamplingFlags& flags, v1::GenerateRequest* request);

// One continuation of a finished call.
struct Continuation {
  std::vector<int32_t> ids;
  std::string text;
  std::string finish;  // "stop", "length", or "" when the stream ended early
  std::string worker;
  v1::Usage usage;
  v1::Timings timings;
};

// Runs a Generate call to its end, calling `on_text(index, text)` for each piece of new text
// as it arrives (may be empty). Returns one Continuation per index (max(1, n)). Errors: the
// call's status, its message prefixed with the address.
absl::StatusOr<std::vector<Continuation>> StreamGenerate(
    v1::Generation::Stub& stub, const ConnectionFlags& flags, const v1::GenerateRequest& request,
    const std::function<void(uint32_t index, const std::string& text)>& on_text);

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_CLUSTER_CLIENT_H_
