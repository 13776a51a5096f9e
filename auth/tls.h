// gRPC credentials from PEM files: TLS when a certificate and key are given, plaintext
// otherwise.
#ifndef KVGRID_AUTH_TLS_H_
#define KVGRID_AUTH_TLS_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace kvgrid::auth {

struct TlsFiles {
  std::optional<std::string> cert;  // PEM certificate chain
  std::optional<std::string> key;   // PEM private key
  std::optional<std::string> ca;    // PEM roots: the server verifies client certificates
                                    // against them (mTLS); a client verifies the server
  std::string flag_prefix = "tls";  // for error messages: --tls-cert, --tls-key, --tls-ca
};

// Server side: TLS with `cert` and `key` (and required, verified client certificates when
// `ca` is set), else insecure. Errors: INVALID_ARGUMENT when only one of cert/key is given,
// or a file cannot be read (naming the flag and file).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);

// Client side: TLS verifying the server against `ca` (system roots when unset) and presenting
// `cert`/`key` when set; `tls` false gives plaintext. Errors: as ServerCredentials.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(bool tls,
                                                                             const TlsFiles& files);

}  // namespace kvgrid::auth

#endif  // KVGRID_AUTH_TLS_H_
