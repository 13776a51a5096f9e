// A private, short-lived PKI for a local cluster (kvgrid serve): a fresh CA, one certificate
// for 127.0.0.1 / localhost that the coordinator and every worker use as server and client
// certificate, and a random cluster token, written into a new directory only the current user
// can read, removed again by the destructor. Nothing of it outlives the cluster, so links
// between its processes are private without the user making certificates.
//
// Thread-safety: not shared; create, read the paths, destroy.
#ifndef KVGRID_AUTH_THROWAWAY_CLUSTER_H_
#define KVGRID_AUTH_THROWAWAY_CLUSTER_H_

#include <filesystem>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvgrid::auth {

class ThrowawayCluster {
 public:
  // Generates EC P-256 keys, the CA (valid one day) and the certificate, and the token (32
  // random bytes, hex) under a new mkdtemp directory in `parent` (mode 0700, files 0600).
  // Errors: INTERNAL naming the OpenSSL or file operation that failed.
  static absl::StatusOr<std::unique_ptr<ThrowawayCluster>> Create(
      const std::filesystem::path& parent = std::filesystem::temp_directory_path());
  ~ThrowawayCluster();  // removes the directory
  ThrowawayCluster(const ThrowawayCluster&) = delete;
  ThrowawayCluster& operator=(const ThrowawayCluster&) = delete;

  [[nodiscard]] const std::filesystem::path& dir() const { return dir_; }
  [[nodiscard]] std::filesystem::path ca() const { return dir_ / "ca.pem"; }
  [[nodiscard]] std::filesystem::path cert() const { return dir_ / "cluster.pem"; }
  [[nodiscard]] std::filesystem::path key() const { return dir_ / "cluster.key"; }
  [[nodiscard]] std::filesystem::path token_file() const { return dir_ / "cluster-token"; }

 private:
  explicit ThrowawayCluster(std::filesystem::path dir) : dir_(std::move(dir)) {}
  std::filesystem::path dir_;
};

}  // namespace kvgrid::auth

#endif  // KVGRID_AUTH_THROWAWAY_CLUSTER_H_
