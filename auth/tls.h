// gRPC credentials from PEM files: TLS when a certificate and key are given, plaintext
// otherwise. Certificates are read through gRPC's file-watching provider, so replacing the
// files (a Kubernetes Secret update, a rotation) takes effect for new connections within the
// refresh interval, without a restart.
#ifndef KVGRID_AUTH_TLS_H_
#define KVGRID_AUTH_TLS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace kvgrid::auth {

// How often certificate files are re-read (--tls-refresh-s) unless a caller says otherwise.
inline constexpr int kDefaultTlsRefreshSeconds = 60;

// TlsFiles::refresh_s from the --tls-refresh-s flag: the default when absent, held to
// [0, 86400] (a value below 1 is refused, naming the flag, once credentials are made).
int TlsRefreshSeconds(std::optional<int64_t> flag);

struct TlsFiles {
  std::optional<std::string> cert;  // PEM certificate chain
  std::optional<std::string> key;   // PEM private key
  std::optional<std::string> ca;    // PEM roots: the server verifies client certificates
                                    // against them (mTLS); a client verifies the server
  std::string flag_prefix = "tls";  // for error messages: --tls-cert, --tls-key, --tls-ca
  int refresh_s = kDefaultTlsRefreshSeconds;  // files re-read this often (>= 1)
};

// Server side: TLS with `cert` and `key` (and required, verified client certificates when
// `ca` is set), else insecure. The files are re-read every `refresh_s`; a new pair takes
// effect for new connections once key and certificate match. Errors: INVALID_ARGUMENT when
// only one of cert/key is given, `ca` without them, a file cannot be read or is not PEM, or
// the key does not belong to the certificate (naming the flag and file).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);

// Client side: TLS verifying the server against `ca` (system roots when unset) and presenting
// `cert`/`key` when set; `tls` false gives plaintext. Errors: as ServerCredentials.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(bool tls,
                                                                             const TlsFiles& files);

// The links inside a cluster (coordinator <-> workers), from --worker-tls-cert, -key, -ca and
// -server-name. A process serves its cluster port with TLS when it has cert and key (and
// requires client certificates verified against `ca` when it has one: mutual TLS); it dials
// its peers with TLS, verifying them against `ca`, when it has a `ca`, and presents its cert
// and key as a client certificate. `server_name`, when set, is the name checked in every
// peer's certificate instead of the host of the address dialled (one certificate for all
// workers, e.g. "kvgrid-worker"); otherwise a worker's certificate must name the host of the
// address it registers (in Kubernetes: the pod's DNS name under the headless Service, e.g.
// a wildcard *.kvgrid-worker.<namespace>.svc.cluster.local).
struct ClusterTls {
  TlsFiles files;
  std::optional<std::string> server_name;

  [[nodiscard]] bool serves_tls() const { return files.cert.has_value(); }
  [[nodiscard]] bool dials_tls() const { return files.ca.has_value(); }
};

// A channel maker for one side of the cluster links: plaintext by default.
class ClusterChannels {
 public:
  ClusterChannels() = default;
  // Errors: as ChannelCredentials, naming the --worker-tls-* flags.
  static absl::StatusOr<ClusterChannels> ForClient(const ClusterTls& tls);

  [[nodiscard]] bool tls() const { return tls_; }
  // A channel to `address` with these credentials and `args` (plus the server-name override).
  [[nodiscard]] std::shared_ptr<grpc::Channel> Create(const std::string& address,
                                                      grpc::ChannelArguments args = {}) const;

 private:
  bool tls_ = false;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::string server_name_;
};

// The cluster token must not cross plaintext links: OK when `token` is empty or every link
// it travels is TLS (`plaintext_links` empty); else, with `allow_insecure`, a warning on
// stderr naming the links and OK; else INVALID_ARGUMENT naming them and the flags that
// fix it. `program` prefixes the warning ("kvgrid-worker").
absl::Status CheckTokenTransport(const std::string& program, const std::string& token,
                                 const std::string& plaintext_links, bool allow_insecure);

}  // namespace kvgrid::auth

#endif  // KVGRID_AUTH_TLS_H_
