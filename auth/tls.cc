#include "auth/tls.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "openssl/bio.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

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

// Checks that `key_pem` is the private key of the first certificate of `cert_pem`: gRPC's
// file watcher would otherwise keep serving without an identity and fail every handshake.
absl::Status CheckPair(const std::string& cert_pem, const std::string& key_pem,
                       const TlsFiles& f) {
  BIO* cert_bio = BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size()));
  X509* cert = PEM_read_bio_X509(cert_bio, nullptr, nullptr, nullptr);
  BIO_free(cert_bio);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", f.flag_prefix, "-cert: ", *f.cert, " holds no X.509 certificate"));
  }
  BIO* key_bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_bio, nullptr, nullptr, nullptr);
  BIO_free(key_bio);
  absl::Status status;
  if (key == nullptr) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "--", f.flag_prefix, "-key: ", *f.key, " holds no (unencrypted) private key"));
  } else if (X509_check_private_key(cert, key) != 1) {
    status = absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-key: ", *f.key,
                                                     " is not the key of ", *f.cert));
  }
  EVP_PKEY_free(key);
  X509_free(cert);
  return status;
}

// Validates the files as given (so that errors name the flag at startup, not at the first
// handshake) and returns the watcher that re-reads them.
absl::StatusOr<std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider>> Watch(
    const TlsFiles& f) {
  if (f.cert.has_value() != f.key.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-cert and --",
                                                   f.flag_prefix, "-key go together"));
  }
  if (f.refresh_s < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-refresh-s: must be >= 1, got ", f.refresh_s));
  }
  if (f.cert) {
    auto cert = ReadPem(*f.cert, f.flag_prefix + "-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(*f.key, f.flag_prefix + "-key");
    if (!key.ok()) return key.status();
    if (absl::Status s = CheckPair(*cert, *key, f); !s.ok()) return s;
  }
  if (f.ca) {
    auto ca = ReadPem(*f.ca, f.flag_prefix + "-ca");
    if (!ca.ok()) return ca.status();
  }
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      f.key.value_or(""), f.cert.value_or(""), f.ca.value_or(""),
      static_cast<unsigned int>(f.refresh_s));
}

}  // namespace

int TlsRefreshSeconds(std::optional<int64_t> flag) {
  return static_cast<int>(std::clamp<int64_t>(flag.value_or(kDefaultTlsRefreshSeconds), 0, 86400));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& f) {
  if (!f.cert && !f.key) {
    if (f.ca) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.flag_prefix, "-ca: needs --",
                                                     f.flag_prefix, "-cert and --",
                                                     f.flag_prefix, "-key"));
    }
    return grpc::InsecureServerCredentials();
  }
  auto provider = Watch(f);
  if (!provider.ok()) return provider.status();
  grpc::experimental::TlsServerCredentialsOptions options(*provider);
  options.watch_identity_key_cert_pairs();
  if (f.ca) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(bool tls,
                                                                             const TlsFiles& f) {
  if (!tls) return grpc::InsecureChannelCredentials();
  auto provider = Watch(f);
  if (!provider.ok()) return provider.status();
  grpc::experimental::TlsChannelCredentialsOptions options;
  if (f.cert || f.ca) options.set_certificate_provider(*provider);
  if (f.ca) options.watch_root_certs();  // else the system's roots
  if (f.cert) options.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(options);
}

absl::StatusOr<ClusterChannels> ClusterChannels::ForClient(const ClusterTls& tls) {
  ClusterChannels channels;
  channels.tls_ = tls.dials_tls();
  auto credentials = ChannelCredentials(channels.tls_, tls.files);
  if (!credentials.ok()) return credentials.status();
  channels.credentials_ = *std::move(credentials);
  channels.server_name_ = tls.server_name.value_or("");
  return channels;
}

std::shared_ptr<grpc::Channel> ClusterChannels::Create(const std::string& address,
                                                       grpc::ChannelArguments args) const {
  if (!credentials_) {
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  if (tls_ && !server_name_.empty()) args.SetSslTargetNameOverride(server_name_);
  return grpc::CreateCustomChannel(address, credentials_, args);
}

absl::Status CheckTokenTransport(const std::string& program, const std::string& token,
                                 const std::string& plaintext_links, bool allow_insecure) {
  if (token.empty() || plaintext_links.empty()) return absl::OkStatus();
  if (allow_insecure) {
    std::fprintf(stderr,
                 "%s: WARNING: the cluster token crosses %s in plaintext "
                 "(--allow-insecure-cluster): anyone on the network can read it\n",
                 program.c_str(), plaintext_links.c_str());
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--cluster-token: would cross ", plaintext_links,
      " in plaintext; give --worker-tls-cert, --worker-tls-key and --worker-tls-ca (see "
      "--help), or --allow-insecure-cluster on a network you trust"));
}

}  // namespace kvgrid::auth
