// auth/tls.h and auth/throwaway_cluster.h: what kvgrid serve generates is a valid private PKI,
// and bad certificate flags are refused naming the flag, before any handshake.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "auth/throwaway_cluster.h"
#include "auth/tls.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "openssl/x509_vfy.h"
#include "openssl/x509v3.h"

namespace kvgrid::auth {
namespace {

using ::testing::HasSubstr;

X509* ReadCert(const std::filesystem::path& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return nullptr;
  X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  return cert;
}

TEST(ThrowawayClusterTest, IsAPrivateCaAndALoopbackCertificateRemovedAfterwards) {
  std::filesystem::path dir;
  {
    absl::StatusOr<std::unique_ptr<ThrowawayCluster>> c = ThrowawayCluster::Create();
    ASSERT_TRUE(c.ok()) << c.status();
    dir = (*c)->dir();
    struct stat st {};
    ASSERT_EQ(stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700);
    for (const auto& p : {(*c)->ca(), (*c)->cert(), (*c)->key(), (*c)->token_file()}) {
      ASSERT_EQ(stat(p.c_str(), &st), 0) << p;
      EXPECT_EQ(st.st_mode & 0777, 0600) << p;
    }
    std::ifstream t((*c)->token_file());
    std::string token;
    t >> token;
    EXPECT_EQ(token.size(), 64u);

    X509* ca = ReadCert((*c)->ca());
    X509* cert = ReadCert((*c)->cert());
    ASSERT_NE(ca, nullptr);
    ASSERT_NE(cert, nullptr);
    // The certificate chains to the CA and names 127.0.0.1 and localhost.
    X509_STORE* store = X509_STORE_new();
    X509_STORE_add_cert(store, ca);
    X509_STORE_CTX* ctx = X509_STORE_CTX_new();
    X509_STORE_CTX_init(ctx, store, cert, nullptr);
    EXPECT_EQ(X509_verify_cert(ctx), 1)
        << X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx));
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(store);
    EXPECT_EQ(X509_check_ip_asc(cert, "127.0.0.1", 0), 1);
    EXPECT_EQ(X509_check_host(cert, "localhost", 0, 0, nullptr), 1);
    EXPECT_NE(X509_check_host(cert, "example.com", 0, 0, nullptr), 1);
    EXPECT_NE(X509_check_ca(cert), 1);
    EXPECT_EQ(X509_check_ca(ca), 1);
    X509_free(cert);
    X509_free(ca);

    // Its files are accepted as server and mTLS credentials.
    TlsFiles files{.cert = (*c)->cert().string(), .key = (*c)->key().string(),
                   .ca = (*c)->ca().string(), .flag_prefix = "worker-tls"};
    EXPECT_TRUE(ServerCredentials(files).ok());
    EXPECT_TRUE(ChannelCredentials(true, files).ok());
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(TlsTest, AKeyOfAnotherCertificateIsRefusedNamingTheFlag) {
  auto a = ThrowawayCluster::Create();
  auto b = ThrowawayCluster::Create();
  ASSERT_TRUE(a.ok() && b.ok());
  TlsFiles files{.cert = (*a)->cert().string(), .key = (*b)->key().string(),
                 .flag_prefix = "worker-tls"};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> s = ServerCredentials(files);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("--worker-tls-key"));
  EXPECT_THAT(s.status().message(), HasSubstr("is not the key of"));
  // Not PEM, missing halves, a CA without a certificate.
  files.key = (*a)->token_file().string();
  EXPECT_THAT(ServerCredentials(files).status().message(), HasSubstr("is not PEM"));
  EXPECT_THAT(ServerCredentials({.cert = (*a)->cert().string(), .flag_prefix = "worker-tls"})
                  .status()
                  .message(),
              HasSubstr("--worker-tls-cert and --worker-tls-key go together"));
  EXPECT_THAT(ServerCredentials({.ca = (*a)->ca().string()}).status().message(),
              HasSubstr("--tls-ca: needs --tls-cert"));
  EXPECT_THAT(ServerCredentials({.cert = (*a)->cert().string(), .key = (*a)->key().string(),
                                 .refresh_s = 0})
                  .status()
                  .message(),
              HasSubstr("--tls-refresh-s"));
}

TEST(TlsTest, TheClusterTokenCrossesNoPlaintextLinkUnlessAllowed) {
  EXPECT_TRUE(CheckTokenTransport("t", "", "the worker port", false).ok());
  EXPECT_TRUE(CheckTokenTransport("t", "secret", "", false).ok());
  absl::Status s = CheckTokenTransport("t", "secret", "the worker port", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("the worker port"));
  EXPECT_THAT(s.message(), HasSubstr("--allow-insecure-cluster"));
  EXPECT_TRUE(CheckTokenTransport("t", "secret", "the worker port", true).ok());
}

TEST(TlsTest, ClusterChannelsArePlaintextWithoutACa) {
  absl::StatusOr<ClusterChannels> plain = ClusterChannels::ForClient({});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->tls());
  EXPECT_NE(plain->Create("127.0.0.1:1"), nullptr);
  EXPECT_NE(ClusterChannels().Create("127.0.0.1:1"), nullptr);
}

}  // namespace
}  // namespace kvgrid::auth
