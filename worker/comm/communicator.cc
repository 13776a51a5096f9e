#include "worker/comm/communicator.h"

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

}  // namespace kvgrid::worker
