#include "coordinator/rendezvous_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvgrid::coordinator {

absl::Status RendezvousStore::Set(const std::string& key, std::string value) {
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: ", value.size(), " bytes, at most ", kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  if (values_.size() >= kMaxKeys && !values_.contains(key)) {
    return absl::ResourceExhaustedError(absl::StrCat("the store holds ", kMaxKeys, " keys"));
  }
  values_[key] = std::move(value);
  return absl::OkStatus();
}

std::optional<std::string> RendezvousStore::Get(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

void RendezvousStore::ErasePrefix(const std::string& prefix) {
  absl::MutexLock lock(&mu_);
  auto it = values_.lower_bound(prefix);
  while (it != values_.end() && it->first.compare(0, prefix.size(), prefix) == 0) {
    it = values_.erase(it);
  }
}

}  // namespace kvgrid::coordinator
