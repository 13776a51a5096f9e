#include "auth/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvgrid::auth {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is not PEM"));
  }
  return ss.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& f) {
  if (!f.cert && !f.key) {
    if (f.ca) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-ca: needs --",
                                                     f.flag_prefix, "-cert and --",
                                                     f.flag_prefix, "-key"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (!f.cert || !f.key) {
    return absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-cert and --",
                                                   f.flag_prefix, "-key go together"));
  }
  grpc::SslServerCredentialsOptions options(
      f.ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
           : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPem(*f.cert, f.flag_prefix + "-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(*f.key, f.flag_prefix + "-key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (f.ca) {
    auto ca = ReadPem(*f.ca, f.flag_prefix + "-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(bool tls,
                                                                             const TlsFiles& f) {
  if (!tls) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  if (f.ca) {
    auto ca = ReadPem(*f.ca, f.flag_prefix + "-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  if (f.cert.has_value() != f.key.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-cert and --",
                                                   f.flag_prefix, "-key go together"));
  }
  if (f.cert) {
    auto cert = ReadPem(*f.cert, f.flag_prefix + "-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(*f.key, f.flag_prefix + "-key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *std::move(cert);
    options.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(options);
}

}  // namespace kvgrid::auth
