#include "worker/comm/communicator.h"

#include <algorithm>
#include <cstring>

namespace kvgrid::worker {

absl::Status BroadcastBytes(Communicator& comm, std::string* bytes, int root) {
  int64_t size = comm.rank() == root ? static_cast<int64_t>(bytes->size()) : 0;
  absl::Status s =
      comm.Broadcast(std::span<char>(reinterpret_cast<char*>(&size), sizeof(size)), root);
  if (!s.ok()) return s;
  if (comm.rank() != root) bytes->resize(static_cast<size_t>(size));
  if (size == 0) return absl::OkStatus();
  return comm.Broadcast(std::span<char>(bytes->data(), bytes->size()), root);
}

absl::StatusOr<std::vector<std::string>> GatherBytes(Communicator& comm,
                                                     const std::string& mine) {
  std::vector<std::string> all(static_cast<size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) {
    if (r == comm.rank()) all[r] = mine;
    absl::Status s = BroadcastBytes(comm, &all[r], r);
    if (!s.ok()) return s;
  }
  return all;
}

absl::StatusOr<int64_t> MinAcrossGroup(Communicator& comm, int64_t value) {
  std::string mine(sizeof(value), '\0');
  std::memcpy(mine.data(), &value, sizeof(value));
  absl::StatusOr<std::vector<std::string>> all = GatherBytes(comm, mine);
  if (!all.ok()) return all.status();
  for (const std::string& bytes : *all) {
    int64_t v = 0;
    if (bytes.size() != sizeof(v)) return absl::UnavailableError("MinAcrossGroup: a bad value");
    std::memcpy(&v, bytes.data(), sizeof(v));
    value = std::min(value, v);
  }
  return value;
}

}  // namespace kvgrid::worker
