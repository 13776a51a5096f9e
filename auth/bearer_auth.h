// Bearer tokens on gRPC calls: the `authorization: Bearer <token>` metadata checked against
// a set of accepted tokens. Tokens are compared as SHA-256 digests with a constant-time
// comparison, so neither their contents nor their lengths leak through timing.
//
// Used for the public API keys (clients -> coordinator) and for the cluster token that only
// the coordinator and its workers hold (coordinator <-> workers).
//
// Thread-safety: immutable after construction; Check may run concurrently.
#ifndef KVGRID_AUTH_BEARER_AUTH_H_
#define KVGRID_AUTH_BEARER_AUTH_H_

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace kvgrid::auth {

class BearerAuth {
 public:
  // Accepts every call (no tokens configured).
  BearerAuth() = default;
  // Empty tokens are ignored; no non-empty token means every call is accepted.
  static BearerAuth FromTokens(const std::vector<std::string>& tokens);
  // One token per line; blank lines and lines starting with '#' are skipped.
  // Errors: NOT_FOUND or INVALID_ARGUMENT naming `flag` and the file; INVALID_ARGUMENT when
  // the file holds no token.
  static absl::StatusOr<BearerAuth> FromFile(const std::filesystem::path& path,
                                             const std::string& flag);
  // The tokens from `--<flag>-file` when given, else the comma-separated `--<flag>s`.
  // Either may be absent.
  static absl::StatusOr<BearerAuth> FromFlags(const std::optional<std::string>& file,
                                              const std::optional<std::string>& list,
                                              const std::string& file_flag);

  [[nodiscard]] bool enabled() const { return !digests_.empty(); }
  // OK when no tokens are configured or the call carries an accepted one; UNAUTHENTICATED
  // (saying whether the token was missing or wrong) otherwise.
  [[nodiscard]] grpc::Status Check(const grpc::ServerContextBase& context) const;
  // The same for an HTTP request's Authorization header (nullopt: absent).
  [[nodiscard]] grpc::Status CheckHeader(std::optional<std::string_view> authorization) const;

 private:
  std::vector<std::array<uint8_t, 32>> digests_;
};

// The one token a process sends (the cluster token): the first token of `file` when given,
// else `value`, else empty (no token). Errors: as BearerAuth::FromFile.
absl::StatusOr<std::string> ResolveToken(const std::optional<std::string>& file,
                                         const std::optional<std::string>& value,
                                         const std::string& file_flag);

// Adds `authorization: Bearer <token>` to an outgoing call; nothing for an empty token.
void AttachBearer(grpc::ClientContext* context, const std::string& token);

}  // namespace kvgrid::auth

#endif  // KVGRID_AUTH_BEARER_AUTH_H_
