// What a tensor-parallel group's leader tells the other ranks, one message per operation
// that touches the KV cache: block copies (copy-on-write, swap out, swap in) and forward
// passes, in the order the leader's engine runs them, so every rank's pool holds the same
// blocks for its own KV heads. The followers run RunFollower until the leader sends kStop.
//
// Wire format: one byte of kind, then fixed-width little-endian integers (the group runs on
// one kind of machine); decoding checks every length against the message.
#ifndef KVGRID_WORKER_ENGINE_STEP_PLAN_H_
#define KVGRID_WORKER_ENGINE_STEP_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"
#include "worker/executor/executor.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"

namespace kvgrid::worker {

enum class PlanKind : uint8_t {
  kCopyDeviceToDevice = 0,
  kCopyDeviceToSwap = 1,
  kCopySwapToDevice = 2,
  kForward = 3,
  kStop = 4,
  // Nothing to run: the leader is alive but idle (collectives would otherwise time out).
  kKeepAlive = 5,
};

struct StepPlan {
  PlanKind kind = PlanKind::kStop;
  std::vector<BlockCopy> copies = {};  // copy kinds
  ForwardBatch batch = {};             // kForward
};

// The executor's copy for a plan of kind kCopyDeviceToDevice, kCopyDeviceToSwap or
// kCopySwapToDevice (`kind` must be one of those).
BlockCopyKind ToBlockCopyKind(PlanKind kind);

std::string EncodePlan(const StepPlan& plan);
// Errors: INVALID_ARGUMENT for a truncated or malformed message.
absl::StatusOr<StepPlan> DecodePlan(const std::string& bytes);

// The pool a group's leader plans with, agreed by every rank of `group` before the first
// plan (the leader's Engine::Create and RunFollower call it): each rank gathers every rank's
// pool and swap sizes. A tensor-parallel group plans with the smallest of each (a larger
// pool's extra blocks stay unused); the ranks of a context-parallel group must agree, since
// a block's rank follows from its id and the pool size. Every rank returns the same answer.
// Errors: INVALID_ARGUMENT naming --kv-cache-memory / --swap-space and the ranks that differ;
// UNAVAILABLE when the collective fails.
struct GroupPools {
  int32_t num_blocks = 0;
  int32_t num_swap_blocks = 0;
};
absl::StatusOr<GroupPools> AgreeOnPools(const Executor& executor, Communicator& group);

// A follower rank's loop: agrees on the pools (AgreeOnPools), then receives each plan from
// rank 0 and runs it on this rank's executor (its shard, pool and swap space), until kStop
// (OK) or a collective fails (UNAVAILABLE: the group is broken).
absl::Status RunFollower(Executor& executor, Communicator& comm);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_ENGINE_STEP_PLAN_H_
