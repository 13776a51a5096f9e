#include "worker/engine/step_plan.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"

namespace kvgrid::worker {
namespace {

template <typename T>
void Put(std::string& out, const std::vector<T>& v) {
  const int64_t n = static_cast<int64_t>(v.size());
  out.append(reinterpret_cast<const char*>(&n), sizeof(n));
  if (n > 0) out.append(reinterpret_cast<const char*>(v.data()), sizeof(T) * v.size());
}

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  absl::Status Get(std::vector<T>* v) {
    int64_t n;
    if (pos_ + sizeof(n) > s_.size()) return Truncated();
    std::memcpy(&n, s_.data() + pos_, sizeof(n));
    pos_ += sizeof(n);
    if (n < 0 || static_cast<uint64_t>(n) > (s_.size() - pos_) / sizeof(T)) return Truncated();
    v->resize(static_cast<size_t>(n));
    if (n > 0) std::memcpy(v->data(), s_.data() + pos_, sizeof(T) * v->size());
    pos_ += sizeof(T) * v->size();
    return absl::OkStatus();
  }
  absl::Status GetInt(int64_t* x) {
    if (pos_ + sizeof(*x) > s_.size()) return Truncated();
    std::memcpy(x, s_.data() + pos_, sizeof(*x));
    pos_ += sizeof(*x);
    return absl::OkStatus();
  }
  bool done() const { return pos_ == s_.size(); }

 private:
  static absl::Status Truncated() { return absl::InvalidArgumentError("step plan: truncated"); }
  const std::string& s_;
  size_t pos_ = 1;  // after the kind byte
};

}  // namespace

std::string EncodePlan(const StepPlan& plan) {
  std::string out(1, static_cast<char>(plan.kind));
  if (plan.kind == PlanKind::kForward) {
    const ForwardBatch& b = plan.batch;
    Put(out, b.token_ids);
    Put(out, b.positions);
    Put(out, b.slots);
    Put(out, b.query_start);
    Put(out, b.seq_lens);
    Put(out, b.block_tables);
    out.append(reinterpret_cast<const char*>(&b.max_blocks_per_seq), sizeof(int64_t));
    Put(out, b.logit_rows);
  } else if (plan.kind != PlanKind::kStop && plan.kind != PlanKind::kKeepAlive) {
    Put(out, plan.copies);
  }
  return out;
}

absl::StatusOr<StepPlan> DecodePlan(const std::string& bytes) {
  if (bytes.empty() ||
      static_cast<uint8_t>(bytes[0]) > static_cast<uint8_t>(PlanKind::kKeepAlive)) {
    return absl::InvalidArgumentError("step plan: unknown kind");
  }
  StepPlan plan;
  plan.kind = static_cast<PlanKind>(bytes[0]);
  Reader r(bytes);
  if (plan.kind == PlanKind::kForward) {
    ForwardBatch& b = plan.batch;
    KVGRID_RETURN_IF_ERROR(r.Get(&b.token_ids));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.positions));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.slots));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.query_start));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.seq_lens));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.block_tables));
    KVGRID_RETURN_IF_ERROR(r.GetInt(&b.max_blocks_per_seq));
    KVGRID_RETURN_IF_ERROR(r.Get(&b.logit_rows));
  } else if (plan.kind != PlanKind::kStop && plan.kind != PlanKind::kKeepAlive) {
    KVGRID_RETURN_IF_ERROR(r.Get(&plan.copies));
  }
  if (!r.done()) return absl::InvalidArgumentError("step plan: trailing bytes");
  return plan;
}

BlockCopyKind ToBlockCopyKind(PlanKind kind) {
  switch (kind) {
    case PlanKind::kCopyDeviceToSwap: return BlockCopyKind::kDeviceToSwap;
    case PlanKind::kCopySwapToDevice: return BlockCopyKind::kSwapToDevice;
    default: return BlockCopyKind::kDeviceToDevice;
  }
}

absl::StatusOr<GroupPools> AgreeOnPools(const Executor& executor, Communicator& group) {
  // Each size travels as two 16-bit halves, exact in a float.
  auto halves = [](int32_t v) {
    return std::array<float, 2>{static_cast<float>(v >> 16), static_cast<float>(v & 0xffff)};
  };
  const auto blocks = halves(executor.num_blocks());
  const auto swap = halves(executor.num_swap_blocks());
  const std::array<float, 4> mine = {blocks[0], blocks[1], swap[0], swap[1]};
  std::vector<float> all(4 * static_cast<size_t>(group.size()));
  KVGRID_RETURN_IF_ERROR(group.AllGather(mine, std::span<float>(all)));
  auto whole = [&](int rank, int which) {
    return (static_cast<int32_t>(all[4 * rank + 2 * which]) << 16) |
           static_cast<int32_t>(all[4 * rank + 2 * which + 1]);
  };
  GroupPools pools{.num_blocks = whole(0, 0), .num_swap_blocks = whole(0, 1)};
  const bool must_agree = executor.context_parallel().size > 1;
  for (int r = 1; r < group.size(); ++r) {
    const int32_t b = whole(r, 0), s = whole(r, 1);
    if (must_agree && (b != pools.num_blocks || s != pools.num_swap_blocks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-cache-memory / --swap-space: the ranks of a context-parallel group need pools "
          "of one size, but rank 0 holds ", pools.num_blocks, " KV blocks and ",
          pools.num_swap_blocks, " swap blocks and rank ", r, " holds ", b, " and ", s));
    }
    pools.num_blocks = std::min(pools.num_blocks, b);
    pools.num_swap_blocks = std::min(pools.num_swap_blocks, s);
  }
  return pools;
}

absl::Status RunFollower(Executor& executor, Communicator& comm) {
  KVGRID_RETURN_IF_ERROR(AgreeOnPools(executor, comm).status());
  std::string bytes;
  std::vector<float> logits;
  for (;;) {
    KVGRID_RETURN_IF_ERROR(BroadcastBytes(comm, &bytes, /*root=*/0));
    KVGRID_ASSIGN_OR_RETURN(StepPlan plan, DecodePlan(bytes));
    switch (plan.kind) {
      case PlanKind::kStop:
        return absl::OkStatus();
      case PlanKind::kKeepAlive:
        break;
      case PlanKind::kForward:
        // The leader validated the batch; a failure here would desynchronize the group.
        KVGRID_RETURN_IF_ERROR(executor.Forward(plan.batch, &logits));
        break;
      case PlanKind::kCopyDeviceToDevice:
      case PlanKind::kCopyDeviceToSwap:
      case PlanKind::kCopySwapToDevice:
        KVGRID_RETURN_IF_ERROR(executor.CopyBlocks(ToBlockCopyKind(plan.kind), plan.copies));
        break;
    }
  }
}

}  // namespace kvgrid::worker
