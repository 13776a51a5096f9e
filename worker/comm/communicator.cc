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

absl::Status MinAcrossGroup(Communicator& comm, std::span<int64_t> values) {
  const size_t bytes = values.size() * sizeof(int64_t);
  std::string mine(bytes, '\0');
  std::memcpy(mine.data(), values.data(), bytes);
  absl::StatusOr<std::vector<std::string>> all = GatherBytes(comm, mine);
  if (!all.ok()) return all.status();
  for (const std::string& theirs : *all) {
    if (theirs.size() != bytes) return absl::UnavailableError("MinAcrossGroup: a bad value");
    for (size_t i = 0; i < values.size(); ++i) {
      int64_t v = 0;
      std::memcpy(&v, theirs.data() + i * sizeof(v), sizeof(v));
      values[i] = std::min(values[i], v);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> MinAcrossGroup(Communicator& comm, int64_t value) {
  absl::Status s = MinAcrossGroup(comm, std::span<int64_t>(&value, 1));
  if (!s.ok()) return s;
  return value;
}

}  // namespace kvgrid::worker
