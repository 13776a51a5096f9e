#include "auth/throwaway_cluster.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "openssl/bio.h"
#include "openssl/evp.h"
#include "openssl/pem.h"
#include "openssl/rand.h"
#include "openssl/x509.h"
#include "openssl/x509v3.h"

namespace kvgrid::auth {
namespace {

struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct CertFree {
  void operator()(X509* c) const { X509_free(c); }
};
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;
using Cert = std::unique_ptr<X509, CertFree>;

absl::Status OpenSslError(const char* what) {
  return absl::InternalError(absl::StrCat("throwaway cluster certificates: ", what, " failed"));
}

absl::StatusOr<Key> NewKey() {
  Key key(EVP_EC_gen("P-256"));
  if (!key) return OpenSslError("EVP_EC_gen(P-256)");
  return key;
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (ext == nullptr) return OpenSslError("X509V3_EXT_conf_nid");
  const int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  return ok == 1 ? absl::OkStatus() : OpenSslError("X509_add_ext");
}

// A certificate for `key` named `cn`, signed by `issuer_key` (`issuer` null: self-signed).
absl::StatusOr<Cert> NewCert(EVP_PKEY* key, const char* cn, X509* issuer, EVP_PKEY* issuer_key,
                             bool ca) {
  Cert cert(X509_new());
  if (!cert) return OpenSslError("X509_new");
  X509_set_version(cert.get(), 2);  // v3
  uint64_t serial = 0;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&serial), sizeof(serial)) != 1) {
    return OpenSslError("RAND_bytes");
  }
  ASN1_INTEGER_set_uint64(X509_get_serialNumber(cert.get()), serial >> 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -60);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 24 * 3600);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(cn), -1, -1, 0);
  X509* signer = issuer != nullptr ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  if (ca) {
    if (absl::Status s = AddExtension(cert.get(), signer, NID_basic_constraints,
                                      "critical,CA:TRUE");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = AddExtension(cert.get(), signer, NID_key_usage,
                                      "critical,keyCertSign,cRLSign");
        !s.ok()) {
      return s;
    }
  } else {
    for (auto [nid, value] : {std::pair{NID_basic_constraints, "critical,CA:FALSE"},
                              std::pair{NID_subject_alt_name, "IP:127.0.0.1,DNS:localhost"},
                              std::pair{NID_ext_key_usage, "serverAuth,clientAuth"}}) {
      if (absl::Status s = AddExtension(cert.get(), signer, nid, value); !s.ok()) return s;
    }
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) == 0) return OpenSslError("X509_sign");
  return cert;
}

// Writes `data` to a new file of mode 0600.
absl::Status WritePrivate(const std::filesystem::path& path, const std::string& data) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", path.string(), ": ",
                                            std::strerror(errno)));
  }
  const bool ok = write(fd, data.data(), data.size()) == static_cast<ssize_t>(data.size());
  close(fd);
  return ok ? absl::OkStatus()
            : absl::InternalError(absl::StrCat("cannot write ", path.string()));
}

template <typename WriteFn>
absl::StatusOr<std::string> Pem(WriteFn write) {
  BIO* bio = BIO_new(BIO_s_mem());
  if (bio == nullptr || write(bio) != 1) {
    BIO_free(bio);
    return OpenSslError("PEM_write_bio");
  }
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ThrowawayCluster>> ThrowawayCluster::Create(
    const std::filesystem::path& parent) {
  std::string templ = (parent / "kvgrid-serve-XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create a directory in ", parent.string(),
                                            ": ", std::strerror(errno)));
  }
  std::unique_ptr<ThrowawayCluster> cluster(new ThrowawayCluster(templ));  // removes on error
  auto ca_key = NewKey();
  if (!ca_key.ok()) return ca_key.status();
  auto ca = NewCert(ca_key->get(), "kvgrid serve throwaway CA", nullptr, ca_key->get(), true);
  if (!ca.ok()) return ca.status();
  auto key = NewKey();
  if (!key.ok()) return key.status();
  auto cert = NewCert(key->get(), "localhost", ca->get(), ca_key->get(), false);
  if (!cert.ok()) return cert.status();
  auto ca_pem = Pem([&](BIO* b) { return PEM_write_bio_X509(b, ca->get()); });
  auto cert_pem = Pem([&](BIO* b) { return PEM_write_bio_X509(b, cert->get()); });
  auto key_pem = Pem([&](BIO* b) {
    return PEM_write_bio_PrivateKey(b, key->get(), nullptr, nullptr, 0, nullptr, nullptr);
  });
  for (const auto* pem : {&ca_pem, &cert_pem, &key_pem}) {
    if (!pem->ok()) return pem->status();
  }
  unsigned char token[32];
  if (RAND_bytes(token, sizeof(token)) != 1) return OpenSslError("RAND_bytes");
  const std::string token_hex =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(token), sizeof(token)));
  for (const auto& [path, data] : {std::pair{cluster->ca(), *ca_pem},
                                   std::pair{cluster->cert(), *cert_pem},
                                   std::pair{cluster->key(), *key_pem},
                                   std::pair{cluster->token_file(), token_hex + "\n"}}) {
    if (absl::Status s = WritePrivate(path, data); !s.ok()) return s;
  }
  return cluster;
}

ThrowawayCluster::~ThrowawayCluster() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

}  // namespace kvgrid::auth
