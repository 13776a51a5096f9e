// The key-value store tensor-parallel groups rendezvous through (StoreSet/StoreGet of the
// Coordinator service). Bounded: at most kMaxKeys keys of at most kMaxValueBytes each.
//
// Thread-safety: all methods may be called concurrently.
#ifndef KVGRID_COORDINATOR_RENDEZVOUS_STORE_H_
#define KVGRID_COORDINATOR_RENDEZVOUS_STORE_H_

#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvgrid::coordinator {

class RendezvousStore {
 public:
  static constexpr size_t kMaxKeys = 65536;
  static constexpr size_t kMaxValueBytes = 1 << 20;

  // Errors: INVALID_ARGUMENT (empty key, value too large), RESOURCE_EXHAUSTED (too many keys).
  absl::Status Set(const std::string& key, std::string value);
  std::optional<std::string> Get(const std::string& key) const;
  // Drops every key starting with `prefix`.
  void ErasePrefix(const std::string& prefix);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_RENDEZVOUS_STORE_H_
