// Timed decode steps for the group benchmarks (tp_bench, cp_bench): one rank's model decodes
// `batch` sequences from `context` tokens on, and the mean step and collective times come back.
#ifndef KVGRID_BENCH_DECODE_STEPS_H_
#define KVGRID_BENCH_DECODE_STEPS_H_

#include <chrono>
#include <cstdint>
#include <vector>

#include "bench/timed_communicator.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::bench {

struct StepTimes {
  double step_s = 0;        // mean wall time of a step
  double collective_s = 0;  // of which in `timed`'s collectives
};

// Reserves `context + steps` tokens for sequences 1..batch in `blocks` (all zeros in `pool`:
// decode cost does not depend on the values) and runs `steps` decode steps; the first warms
// caches and is not counted. `timed` is the communicator `model` was given (any, without a
// group). Returns zeros if a reservation or a step fails.
inline StepTimes TimeDecodeSteps(worker::LlamaModel& model, worker::KvPool& pool,
                                 worker::BlockManager& blocks, const TimedCommunicator& timed,
                                 int64_t batch, int64_t context, int64_t steps) {
  using Clock = std::chrono::steady_clock;
  std::vector<worker::SequenceId> seqs;
  for (int64_t s = 0; s < batch; ++s) {
    seqs.push_back(s + 1);
    if (!blocks.Reserve(s + 1, context + steps).ok()) return {};
  }
  std::vector<float> logits;
  StepTimes t;
  for (int64_t i = 0; i < steps; ++i) {
    std::vector<int32_t> tokens;
    for (int64_t s = 0; s < batch; ++s) {
      tokens.push_back(static_cast<int32_t>((s * 7919 + i) % model.config().vocab_size));
    }
    const worker::ForwardBatch b = worker::DecodeBatch(blocks, seqs, context + i, tokens);
    const double before = timed.seconds;
    const auto t0 = Clock::now();
    if (!model.Forward(b, pool, &logits).ok()) return {};
    if (i > 0) {
      t.step_s += std::chrono::duration<double>(Clock::now() - t0).count();
      t.collective_s += timed.seconds - before;
    }
  }
  t.step_s /= static_cast<double>(steps - 1);
  t.collective_s /= static_cast<double>(steps - 1);
  return t;
}

}  // namespace kvgrid::bench

#endif  // KVGRID_BENCH_DECODE_STEPS_H_
