// Whole-model decode speed at a given context, for the benchmarks that compare KV and weight
// dtypes: the cache is filled directly with random K/V rows through KvWrite (quantized as the
// dtype requires) instead of prefilling thousands of tokens, since decode cost does not depend
// on what the cached values are.
#ifndef KVGRID_BENCH_DECODE_RATE_H_
#define KVGRID_BENCH_DECODE_RATE_H_

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/kv_write.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::bench {

using kernels::KvDType;
using Clock = std::chrono::steady_clock;

// Output tokens per second decoding `steps` tokens for each of `batch` sequences after a
// synthetic context of `context` tokens each.
inline double DecodeRate(worker::LlamaModel& model, KvDType dtype, int64_t context,
                  int64_t steps, int64_t batch) {
  const worker::KvGeometry g = model.KvGeometryFor(16, dtype, dtype);
  const int64_t tokens = context + steps;
  auto pool = worker::KvPool::Create(g, batch * (tokens / 16 + 2) * g.BytesPerBlock());
  if (!pool.ok()) return 0;
  worker::BlockManager blocks((*pool)->num_blocks(), 16);
  std::vector<worker::SequenceId> seqs;
  for (int64_t s = 1; s <= batch; ++s) {
    if (!blocks.Reserve(s, tokens).ok()) return 0;
    seqs.push_back(s);
  }

  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  const int64_t row = g.num_kv_heads * g.head_dim;
  std::vector<float> k(context * row), v(context * row);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  std::vector<int64_t> slots(context);
  for (int64_t seq = 1; seq <= batch; ++seq) {  // every sequence holds the same context
    for (int64_t p = 0; p < context; ++p) slots[p] = blocks.Slot(seq, p);
    for (int64_t layer = 0; layer < g.num_layers; ++layer) {
      auto s = kernels::cpu::KvWrite({.key = k.data(),
                                              .value = v.data(),
                                              .slots = slots.data(),
                                              .k_cache = (*pool)->k(layer),
                                              .v_cache = (*pool)->v(layer),
                                              .k_meta = (*pool)->k_meta(layer),
                                              .v_meta = (*pool)->v_meta(layer),
                                              .k_dtype = dtype,
                                              .v_dtype = dtype,
                                              .num_tokens = context,
                                              .num_blocks = (*pool)->num_blocks(),
                                              .num_kv_heads = g.num_kv_heads,
                                              .block_size = 16,
                                              .head_dim = g.head_dim});
      if (!s.ok()) return 0;
    }
  }
  std::vector<float> logits;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t pos = context + i;
    std::vector<int32_t> next;
    for (int64_t s = 1; s <= batch; ++s) {
      next.push_back(static_cast<int32_t>((pos * 7919 + s) % model.config().vocab_size));
    }
    const worker::ForwardBatch b = worker::DecodeBatch(blocks, seqs, pos, next);
    if (!model.Forward(b, **pool, &logits).ok()) return 0;
  }
  return static_cast<double>(steps * batch) /
         std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace kvgrid::bench

#endif  // KVGRID_BENCH_DECODE_RATE_H_
