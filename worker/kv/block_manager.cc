#include "worker/kv/block_manager.h"

#include <algorithm>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"

namespace kvgrid::worker {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  ABSL_RAW_CHECK(num_blocks >= 1, "BlockManager needs at least one block");
  ABSL_RAW_CHECK(block_size == 8 || block_size == 16 || block_size == 32,
                 "block_size must be 8, 16 or 32");
  free_.reserve(num_blocks);
  for (int32_t id = num_blocks - 1; id >= 0; --id) free_.push_back(id);
}

int64_t BlockManager::BlocksFor(int64_t num_tokens) const {
  return (num_tokens + block_size_ - 1) / block_size_;
}

absl::Status BlockManager::Reserve(SequenceId seq, int64_t num_tokens) {
  std::vector<int32_t>& table = tables_[seq];
  const int64_t needed = BlocksFor(num_tokens) - static_cast<int64_t>(table.size());
  if (needed <= 0) return absl::OkStatus();
  if (needed > static_cast<int64_t>(free_.size())) {
    if (table.empty()) tables_.erase(seq);
    return absl::ResourceExhaustedError(absl::StrCat("KV cache: ", needed,
                                                     " more blocks needed, ", free_.size(),
                                                     " free of ", num_blocks_));
  }
  for (int64_t i = 0; i < needed; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

void BlockManager::Free(SequenceId seq) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  for (auto id = it->second.rbegin(); id != it->second.rend(); ++id) free_.push_back(*id);
  tables_.erase(it);
}

const std::vector<int32_t>& BlockManager::BlockTable(SequenceId seq) const {
  static const std::vector<int32_t> kEmpty;
  auto it = tables_.find(seq);
  return it == tables_.end() ? kEmpty : it->second;
}

int64_t BlockManager::Slot(SequenceId seq, int64_t position) const {
  const std::vector<int32_t>& table = BlockTable(seq);
  const int64_t index = position / block_size_;
  ABSL_RAW_CHECK(position >= 0 && index < static_cast<int64_t>(table.size()),
                 "position outside the reserved blocks of the sequence");
  return static_cast<int64_t>(table[index]) * block_size_ + position % block_size_;
}

absl::Status BlockManager::CheckInvariants() const {
  std::vector<int> owners(num_blocks_, 0);
  for (int32_t id : free_) {
    if (id < 0 || id >= num_blocks_) return absl::InternalError(absl::StrCat("bad free id ", id));
    ++owners[id];
  }
  for (const auto& [seq, table] : tables_) {
    for (int32_t id : table) {
      if (id < 0 || id >= num_blocks_) {
        return absl::InternalError(absl::StrCat("sequence ", seq, " holds bad id ", id));
      }
      ++owners[id];
    }
  }
  for (int32_t id = 0; id < num_blocks_; ++id) {
    if (owners[id] != 1) {
      return absl::InternalError(
          absl::StrCat("block ", id, " is owned ", owners[id], " times (free list + tables)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::worker
