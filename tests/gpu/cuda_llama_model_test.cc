// The whole forward pass on the GPU (worker/executor/cuda_llama_model.h) against the CPU model
// on the same weights and the same batches: a prefill and greedy decode steps through paged
// KV, for fp32 weights (logits to fp32 noise, greedy tokens equal), every KV dtype, the
// quantized weight formats, and bf16 weights (looser: activations are rounded to bf16 before
// each GEMM). Models: a random Qwen2-like one (q/k/v bias, tied head) built in memory, and the
// trained models/kjv-tiny (Llama, untied) when the repository is at $KVGRID_SOURCE_DIR or the
// build's source directory. Skipped, with a message, where no GPU is visible.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"
#include "kernels/cpu/quant_linear.h"
#include "tests/gpu/device_buffer.h"
#include "tests/gpu/test_models.h"
#include "worker/executor/cuda_llama_model.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::worker {
namespace {

using kernels::KvDType;
using kernels::cpu::WeightDType;
using ::kvgrid::testing::HaveGpu;
using ::kvgrid::testing::KjvTiny;
using ::kvgrid::testing::TinyQwen;

struct Run {
  std::vector<std::vector<float>> logits;  // per step: the last position's logits
  std::vector<int32_t> tokens;             // greedy choices
};

int32_t ArgMax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// A 37-token prefill, then `steps` greedy decode steps, through `forward` (CPU or GPU).
template <typename Forward>
Run Generate(Forward forward, BlockManager& blocks, int64_t vocab, int steps) {
  Run run;
  std::vector<int32_t> prompt(37);
  for (int i = 0; i < 37; ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 11) % vocab);
  EXPECT_TRUE(blocks.Reserve(1, 37 + steps).ok());
  std::vector<float> logits;
  EXPECT_TRUE(forward(SingleSequenceBatch(blocks, 1, 0, prompt), &logits).ok());
  run.logits.push_back(logits);
  int64_t pos = 37;
  for (int s = 0; s < steps; ++s) {
    const int32_t next = ArgMax(logits);
    run.tokens.push_back(next);
    const std::vector<int32_t> one = {next};
    EXPECT_TRUE(forward(SingleSequenceBatch(blocks, 1, pos++, one), &logits).ok());
    run.logits.push_back(logits);
  }
  run.tokens.push_back(ArgMax(logits));
  return run;
}

// CPU and GPU runs of the same weights; the GPU's dense weights in `dense` on the device.
void Compare(const model::ModelConfig& config, LlamaModel& cpu_model, model::DType dense,
             KvDType kv, double tolerance, bool tokens_equal, const std::string& what) {
  SCOPED_TRACE(what);
  // The device kernels decode int8 K/V to fp32: compare with the CPU doing the same.
  cpu_model.SetAttentionPrecision(kernels::cpu::KvKernelPrecision::kExact);
  // And the quantized linear layers take fp32 inputs, as the device kernels do.
  cpu_model.SetLinearPrecision(kernels::cpu::LinearPrecision::kExact);
  const KvGeometry g = cpu_model.KvGeometryFor(16, kv, kv);
  const int64_t budget = 256 * g.BytesPerBlock();
  auto cpu_pool = KvPool::Create(g, budget);
  ASSERT_TRUE(cpu_pool.ok()) << cpu_pool.status();
  auto gpu_pool = CudaKvPool::Create(g, budget);
  ASSERT_TRUE(gpu_pool.ok()) << gpu_pool.status();
  ASSERT_EQ((*cpu_pool)->num_blocks(), (*gpu_pool)->num_blocks());
  auto gpu_model = CudaLlamaModel::FromWeights(config, cpu_model.weights(), dense);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();

  BlockManager cpu_blocks((*cpu_pool)->num_blocks(), 16);
  BlockManager gpu_blocks((*gpu_pool)->num_blocks(), 16);
  const Run want = Generate(
      [&](const ForwardBatch& b, std::vector<float>* l) {
        return cpu_model.Forward(b, **cpu_pool, l);
      },
      cpu_blocks, config.vocab_size, 6);
  const Run got = Generate(
      [&](const ForwardBatch& b, std::vector<float>* l) {
        return (*gpu_model)->Forward(b, **gpu_pool, l);
      },
      gpu_blocks, config.vocab_size, 6);
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t s = 0; s < want.logits.size(); ++s) {
    ASSERT_EQ(got.logits[s].size(), want.logits[s].size());
    double worst = 0, magnitude = 0;
    for (size_t i = 0; i < want.logits[s].size(); ++i) {
      worst = std::max(worst, std::fabs(double{got.logits[s][i]} - want.logits[s][i]));
      magnitude = std::max(magnitude, std::fabs(double{want.logits[s][i]}));
    }
    EXPECT_LE(worst, tolerance * std::max(1.0, magnitude)) << "step " << s;
    if (!tokens_equal) break;  // later steps follow different tokens
  }
  if (tokens_equal) {
    EXPECT_EQ(got.tokens, want.tokens);
  }
}

TEST(CudaLlamaModelTest, Fp32WeightsMatchTheCpuModelForEveryKvDType) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  auto cpu_model = LlamaModel::FromWeights(config, LlamaModel::RandomWeights(config, 7));
  ASSERT_TRUE(cpu_model.ok());
  // fp32 weights and pedantic SGEMM: only the order of fp32 sums differs (1e-4 of the largest
  // logit leaves a wide margin over the ~1e-6 seen in the op tests); the KV bytes are
  // identical for every dtype, since the device encoders reproduce the CPU's exactly.
  for (KvDType kv : {KvDType::kF32, KvDType::kF16, KvDType::kBF16, KvDType::kInt8,
                     KvDType::kInt4, KvDType::kFp8E4m3}) {
    Compare(config, **cpu_model, model::DType::kF32, kv, 1e-4, true,
            std::string("random qwen2, KV ") + std::string(kernels::KvDTypeName(kv)));
  }
}

// Qwen3's per-head q/k norms (weights away from 1, so a skipped or misplaced norm shows),
// head_dim 64 over hidden 128 with 4 heads (q is 256 wide), and YaRN frequencies with their
// attention factor.
TEST(CudaLlamaModelTest, Qwen3WithYarnMatchesTheCpuModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  model::ModelConfig config = TinyQwen();
  config.model_type = "qwen3";
  config.attention_bias = false;
  config.qk_norm = true;
  config.rope_scaling.type = model::RopeScalingType::kYarn;
  config.rope_scaling.factor = 4.0;
  config.rope_scaling.original_max_position_embeddings = 64;
  LlamaWeights w = LlamaModel::RandomWeights(config, 11);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    for (size_t i = 0; i < w.layers[l].q_norm.size(); ++i) {
      w.layers[l].q_norm[i] = 1.f + 0.3f * std::sin(static_cast<float>(3 * i + l));
      w.layers[l].k_norm[i] = 1.f + 0.3f * std::cos(static_cast<float>(5 * i + l));
    }
  }
  auto cpu_model = LlamaModel::FromWeights(config, std::move(w));
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  for (KvDType kv : {KvDType::kF32, KvDType::kF16}) {
    Compare(config, **cpu_model, model::DType::kF32, kv, 1e-4, true,
            std::string("random qwen3 with yarn, KV ") + std::string(kernels::KvDTypeName(kv)));
  }
}

// Sliding windows on the GPU against the CPU model, over a chunked prefill and decode steps
// past the window: a window of 16 on every layer, with the blocks before each next query's
// window released after every step (holes in the tables, which neither side may read), and
// a window on the second layer only (nothing released: one block id indexes both layers).
TEST(CudaLlamaModelTest, SlidingWindowMatchesTheCpuModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  for (bool every_layer : {true, false}) {
    SCOPED_TRACE(every_layer ? "window on every layer" : "window on layer 1");
    model::ModelConfig config = TinyQwen();
    config.sliding_window = 16;
    config.sliding_layers = {every_layer, true};
    ASSERT_EQ(config.KvWindow(), every_layer ? 16 : 0);
    auto cpu_model = LlamaModel::FromWeights(config, LlamaModel::RandomWeights(config, 13));
    ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
    const KvGeometry g = (*cpu_model)->KvGeometryFor(16, KvDType::kF32, KvDType::kF32);
    auto cpu_pool = KvPool::Create(g, 64 * g.BytesPerBlock());
    ASSERT_TRUE(cpu_pool.ok()) << cpu_pool.status();
    auto gpu_pool = CudaKvPool::Create(g, 64 * g.BytesPerBlock());
    ASSERT_TRUE(gpu_pool.ok()) << gpu_pool.status();
    auto gpu_model =
        CudaLlamaModel::FromWeights(config, (*cpu_model)->weights(), model::DType::kF32);
    ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
    BlockManager cpu_blocks((*cpu_pool)->num_blocks(), 16);
    BlockManager gpu_blocks((*gpu_pool)->num_blocks(), 16);
    // 45 prompt tokens in chunks of 9, then 12 single tokens: 57 positions.
    std::vector<int32_t> tokens(57);
    for (int i = 0; i < 57; ++i) tokens[i] = static_cast<int32_t>((i * 7919 + 5) % 512);
    ASSERT_TRUE(cpu_blocks.Reserve(1, 57).ok());
    ASSERT_TRUE(gpu_blocks.Reserve(1, 57).ok());
    int64_t pos = 0;
    int holes = 0;
    while (pos < 57) {
      const int64_t n = pos < 45 ? 9 : 1;
      const std::span<const int32_t> step(tokens.data() + pos, n);
      std::vector<float> want, got;
      ASSERT_TRUE(
          (*cpu_model)->Forward(SingleSequenceBatch(cpu_blocks, 1, pos, step), **cpu_pool, &want)
              .ok());
      const absl::Status st = (*gpu_model)->Forward(SingleSequenceBatch(gpu_blocks, 1, pos, step),
                                                    **gpu_pool, &got);
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_EQ(got.size(), want.size());
      double worst = 0, magnitude = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        worst = std::max(worst, std::fabs(double{got[i]} - want[i]));
        magnitude = std::max(magnitude, std::fabs(double{want[i]}));
      }
      EXPECT_LE(worst, 1e-4 * std::max(1.0, magnitude)) << "position " << pos;
      pos += n;
      if (config.KvWindow() > 0) {
        cpu_blocks.ReleaseBefore(1, pos - config.KvWindow() + 1);
        gpu_blocks.ReleaseBefore(1, pos - config.KvWindow() + 1);
        holes = static_cast<int>(gpu_blocks.NumHoles(1));
      }
    }
    EXPECT_EQ(holes, every_layer ? 2 : 0);  // 57 - 16 + 1 = 42: blocks 0 and 1 released
  }
}

TEST(CudaLlamaModelTest, TrainedModelGreedyEqualsTheCpuModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  if (!std::filesystem::exists(KjvTiny() / "model.safetensors")) {
    GTEST_SKIP() << KjvTiny() << " not found (set KVGRID_SOURCE_DIR to the repository)";
  }
  auto cpu_model = LlamaModel::Load(KjvTiny());
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  Compare((*cpu_model)->config(), **cpu_model, model::DType::kF32, KvDType::kF32, 1e-4, true,
          "kjv-tiny fp32");
  // int8 rounds each K/V value to one of 255 levels per row. The device's fp32 sums run in
  // another order than the CPU's, so a value within an ulp of a rounding boundary can land on
  // the neighbouring level: one level of one channel moves this model's logits by up to ~3e-3
  // of the largest after six steps (measured on the CUDA emulator). The tokens stay equal.
  Compare((*cpu_model)->config(), **cpu_model, model::DType::kF32, KvDType::kInt8, 1e-2, true,
          "kjv-tiny fp32, int8 KV");
}

TEST(CudaLlamaModelTest, QuantizedWeightsMatchTheCpuKernels) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  for (WeightDType dtype : {WeightDType::kQ8_0, WeightDType::kQ4_0, WeightDType::kQ4_1,
                            WeightDType::kQ4_Z}) {
    auto cpu_model = LlamaModel::FromWeights(config, LlamaModel::RandomWeights(config, 7));
    ASSERT_TRUE(cpu_model.ok());
    ASSERT_TRUE((*cpu_model)->QuantizeWeights(dtype).ok());
    // Both decode every block to the same floats (quant_linear.cuh); sums differ in order.
    Compare(config, **cpu_model, model::DType::kF32, KvDType::kF16, 1e-4, true,
            std::string("weights ") + std::string(kernels::cpu::WeightDTypeName(dtype)));
  }
}

// A GGUF layer whose q/k and v (gate and up) are of different types is held as parts
// (LayerWeights::qkv_parts): the GPU runs each part into its columns of the fused output; and
// an embedding in blocks (LlamaWeights::embed_q), looked up and used as the tied head.
TEST(CudaLlamaModelTest, MixedTypePartsMatchTheCpuModel) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  LlamaWeights w = LlamaModel::RandomWeights(config, 7);
  const int64_t hidden = config.hidden_size, hd = config.head_dim;
  const int64_t q_dim = config.num_attention_heads * hd, kv_dim = config.num_key_value_heads * hd;
  const auto split = [&](std::vector<float>& fused, std::vector<int64_t> rows,
                         std::vector<WeightDType> dtypes,
                         std::vector<kernels::cpu::QuantMatrix>* out) {
    int64_t row = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      auto q = kernels::cpu::QuantizeMatrix(fused.data() + row * hidden, rows[i], hidden,
                                            dtypes[i]);
      ASSERT_TRUE(q.ok()) << q.status();
      out->push_back(*std::move(q));
      row += rows[i];
    }
    std::vector<float>().swap(fused);
  };
  for (LayerWeights& l : w.layers) {
    split(l.qkv, {q_dim, kv_dim, kv_dim}, {WeightDType::kQ4_0, WeightDType::kQ4_0,
          WeightDType::kQ8_0}, &l.qkv_parts);
    split(l.gate_up, {config.intermediate_size, config.intermediate_size},
          {WeightDType::kQ4_1, WeightDType::kQ8_0}, &l.gate_up_parts);
  }
  {
    auto cpu_model = LlamaModel::FromWeights(config, w);
    ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
    // q/k/v bias (TinyQwen) lands on each part's rows too.
    Compare(config, **cpu_model, model::DType::kF32, KvDType::kF16, 1e-4, true, "mixed parts");
  }
  // The embedding in blocks too (a GGUF token_embd kept as stored): the lookup decodes its
  // rows and the tied head (TinyQwen's) multiplies the same blocks.
  auto embed = kernels::cpu::QuantizeMatrix(w.embed.data(), config.vocab_size, hidden,
                                            WeightDType::kQ8_0);
  ASSERT_TRUE(embed.ok()) << embed.status();
  w.embed_q = *std::move(embed);
  std::vector<float>().swap(w.embed);
  auto cpu_model = LlamaModel::FromWeights(config, std::move(w));
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  Compare(config, **cpu_model, model::DType::kF32, KvDType::kF16, 1e-4, true,
          "mixed parts, Q8_0 embedding and tied head");
}

TEST(CudaLlamaModelTest, Bf16WeightsStayClose) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  LlamaWeights w = LlamaModel::RandomWeights(config, 7);
  // The CPU side gets the same bf16-rounded weights; what remains is the GPU rounding its
  // activations to bf16 (8 bits of mantissa, ~0.4% per GEMM input) before each GEMM.
  const auto round = [](std::vector<float>& v) {
    for (float& x : v) x = model::BF16ToF32(model::F32ToBF16(x));
  };
  round(w.embed);
  for (LayerWeights& l : w.layers) {
    for (std::vector<float>* m : {&l.qkv, &l.o, &l.gate_up, &l.down}) round(*m);
  }
  auto cpu_model = LlamaModel::FromWeights(config, w);
  ASSERT_TRUE(cpu_model.ok());
  Compare(config, **cpu_model, model::DType::kBF16, KvDType::kF16, 0.05, false, "bf16 weights");
}

TEST(CudaLlamaModelTest, BadTokenIdIsAnErrorAfterTheStep) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  auto gpu_model = CudaLlamaModel::FromWeights(config, LlamaModel::RandomWeights(config, 7),
                                               model::DType::kBF16);
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  const KvGeometry g = (*gpu_model)->KvGeometryFor(16, KvDType::kF16, KvDType::kF16);
  auto pool = CudaKvPool::Create(g, 16 * g.BytesPerBlock());
  ASSERT_TRUE(pool.ok());
  BlockManager blocks((*pool)->num_blocks(), 16);
  ASSERT_TRUE(blocks.Reserve(1, 3).ok());
  const std::vector<int32_t> bad = {1, 100000, 2};
  std::vector<float> logits;
  const absl::Status s = (*gpu_model)->Forward(SingleSequenceBatch(blocks, 1, 0, bad), **pool,
                                               &logits);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // The flag is cleared: a good step afterwards succeeds.
  const std::vector<int32_t> good = {1, 2, 3};
  EXPECT_TRUE((*gpu_model)->Forward(SingleSequenceBatch(blocks, 1, 0, good), **pool, &logits).ok());
  EXPECT_EQ(logits.size(), static_cast<size_t>(config.vocab_size));
}


// Host logic of the decode graphs; runs without a device.
TEST(CudaLlamaModelTest, DecodeGraphPaddingRunsEverywhere) {
  std::vector<int64_t> buckets;
  for (int64_t n : {1, 2, 3, 4, 5, 8, 9, 16, 17, 255, 256}) {
    buckets.push_back(CudaLlamaModel::DecodeGraphBatch(n));
  }
  EXPECT_EQ(buckets, (std::vector<int64_t>{1, 2, 4, 4, 8, 8, 16, 16, 24, 256, 256}));

  // Three sequences at 5, 40 and 17 tokens with blocks of 16; the host table holds 4 columns.
  BlockManager blocks(64, 16);
  const std::vector<SequenceId> seqs = {1, 2, 3};
  const std::vector<int64_t> lens = {5, 40, 17};
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_TRUE(blocks.Reserve(seqs[i], lens[i] + 20).ok());  // 2, 4 and 3 blocks
  }
  const ForwardBatch b = DecodeBatch(blocks, seqs, std::vector<int64_t>{4, 39, 16},
                                     std::vector<int32_t>{7, 8, 9});
  ASSERT_EQ(b.max_blocks_per_seq, 4);
  ForwardBatch p;
  CudaLlamaModel::PadDecodeBatch(b, 40, 16, &p);
  EXPECT_TRUE(p.ValidateSizes().ok());
  EXPECT_EQ(p.token_ids, (std::vector<int32_t>{7, 8, 9, 0}));
  EXPECT_EQ(p.positions, (std::vector<int32_t>{4, 39, 16, 0}));
  EXPECT_EQ(p.slots, (std::vector<int64_t>{b.slots[0], b.slots[1], b.slots[2], -1}));
  EXPECT_EQ(p.query_start, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(p.seq_lens, (std::vector<int32_t>{5, 40, 17, 0}));
  EXPECT_EQ(p.logit_rows, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(p.max_blocks_per_seq, 4);  // 40 tokens need 3 blocks: bound 4
  for (int64_t s = 0; s < 3; ++s) {
    const std::vector<int32_t>& table = blocks.BlockTable(seqs[s]);
    for (int64_t i = 0; i < 4; ++i) {
      const int32_t want = i < static_cast<int64_t>(table.size()) ? table[i] : 0;
      EXPECT_EQ(p.block_tables[s * 4 + i], want) << s << " " << i;
    }
  }
  // A longer context widens the table past the host's; a shorter one narrows it.
  CudaLlamaModel::PadDecodeBatch(b, 65, 16, &p);
  EXPECT_EQ(p.max_blocks_per_seq, 8);
  EXPECT_EQ(p.block_tables.size(), 4u * 8);
  EXPECT_EQ(p.block_tables[8 + 3], blocks.BlockTable(2)[3]);
  EXPECT_EQ(p.block_tables[8 + 4], 0);
  CudaLlamaModel::PadDecodeBatch(b, 16, 16, &p);
  EXPECT_EQ(p.max_blocks_per_seq, 1);
  EXPECT_EQ(p.block_tables[1], blocks.BlockTable(2)[0]);
}

// The same calls on two models, one eager and one with decode graphs: prefills of different
// lengths, decode steps of 5 sequences (bucket 8) whose contexts cross power-of-two block
// bounds (new graphs), then a long prefill that grows the step buffers (stale graphs dropped
// and captured again) and decodes of 6 sequences. Every graph-side step is taken twice: the
// repeat rewrites the same K/V and replays the graph, and must give the first call's logits bit
// for bit (on a new shape that first call was the eager padded step). Against the eager model,
// which runs the unpadded step (other GEMM row counts), logits agree to fp32 noise with fp16 KV;
// with fp8 KV a one-ulp difference can move a code by a whole E4M3 step, so only the replays
// are compared there. Padding rows write no KV, so blocks no sequence holds stay zero.
TEST(CudaLlamaModelTest, DecodeGraphsMatchEagerSteps) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: the gpu-labelled tests need one";
  const model::ModelConfig config = TinyQwen();
  auto cpu_model = LlamaModel::FromWeights(config, LlamaModel::RandomWeights(config, 9));
  ASSERT_TRUE(cpu_model.ok());
  for (KvDType kv : {KvDType::kF16, KvDType::kFp8E4m3}) {
    SCOPED_TRACE(std::string(kernels::KvDTypeName(kv)));
    const KvGeometry g = (*cpu_model)->KvGeometryFor(16, kv, kv);
    struct Side {
      std::unique_ptr<CudaLlamaModel> model;
      std::unique_ptr<CudaKvPool> pool;
      std::unique_ptr<BlockManager> blocks;
    };
    Side sides[2];
    for (Side& side : sides) {
      auto m = CudaLlamaModel::FromWeights(config, (*cpu_model)->weights(), model::DType::kF32);
      ASSERT_TRUE(m.ok()) << m.status();
      auto pool = CudaKvPool::Create(g, 128 * g.BytesPerBlock());
      ASSERT_TRUE(pool.ok()) << pool.status();
      side.model = *std::move(m);
      side.pool = *std::move(pool);
      side.blocks = std::make_unique<BlockManager>(side.pool->num_blocks(), 16);
    }
    sides[1].model->SetDecodeGraphs(true);

    std::vector<SequenceId> seqs;
    std::vector<int64_t> positions;
    std::vector<int32_t> next;
    std::vector<std::vector<float>> last(2);
    // Prefills `len` tokens of a new sequence on both sides.
    auto prefill = [&](SequenceId seq, int64_t len) {
      std::vector<int32_t> prompt(len);
      for (int64_t i = 0; i < len; ++i) prompt[i] = static_cast<int32_t>((i * 31 + seq) % 512);
      for (int side = 0; side < 2; ++side) {
        ASSERT_TRUE(sides[side].blocks->Reserve(seq, len + 40).ok());
        ASSERT_TRUE(sides[side]
                        .model->Forward(SingleSequenceBatch(*sides[side].blocks, seq, 0, prompt),
                                        *sides[side].pool, &last[side])
                        .ok());
      }
      seqs.push_back(seq);
      positions.push_back(len);
      next.push_back(ArgMax(last[0]));
    };
    auto decode = [&](int steps) {
      for (int step = 0; step < steps; ++step) {
        for (int side = 0; side < 2; ++side) {
          const ForwardBatch b = DecodeBatch(*sides[side].blocks, seqs, positions, next);
          ASSERT_TRUE(sides[side].model->Forward(b, *sides[side].pool, &last[side]).ok());
          if (side == 1) {
            std::vector<float> again;
            ASSERT_TRUE(sides[1].model->Forward(b, *sides[1].pool, &again).ok());
            ASSERT_EQ(again, last[1]) << "replay of step " << step;
          }
        }
        ASSERT_EQ(last[0].size(), last[1].size());
        if (kv == KvDType::kF16) {
          double worst = 0, magnitude = 0;
          for (size_t i = 0; i < last[0].size(); ++i) {
            worst = std::max(worst, std::fabs(double{last[0][i]} - last[1][i]));
            magnitude = std::max(magnitude, std::fabs(double{last[0][i]}));
          }
          ASSERT_LE(worst, 1e-4 * std::max(1.0, magnitude)) << "step " << step;
        }
        // Both sides follow the eager side's greedy tokens (a random model's logits are too
        // flat for its argmax to be compared across GEMM shapes).
        for (size_t s = 0; s < seqs.size(); ++s) {
          next[s] = ArgMax(std::vector<float>(last[0].begin() + s * config.vocab_size,
                                              last[0].begin() + (s + 1) * config.vocab_size));
          ++positions[s];
        }
      }
    };
    for (auto [seq, len] : {std::pair{1, 3}, std::pair{2, 17}, std::pair{3, 30}, std::pair{4, 9},
                            std::pair{5, 62}}) {
      prefill(seq, len);
    }
    decode(24);  // the longest context goes from 63 to 86 tokens: 4, then 8 blocks
    prefill(6, 300);  // grows the step buffers: the graphs are captured again
    decode(8);

    const CudaLlamaModel::DecodeGraphStats& stats = sides[1].model->decode_graph_stats();
    EXPECT_EQ(stats.disabled_by, "");
    EXPECT_EQ(stats.captures, 3);  // bounds 4 and 8 blocks, then 32 after the buffers grew
    EXPECT_EQ(stats.captures + stats.replays, 64);  // every decode call took the graph path
    EXPECT_EQ(sides[0].model->decode_graph_stats().replays, 0);

    // Blocks no sequence holds were never written by the graph side (pools start zeroed).
    std::vector<bool> held(sides[1].pool->num_blocks(), false);
    for (SequenceId seq : seqs) {
      for (int32_t block : sides[1].blocks->BlockTable(seq)) held[block] = true;
    }
    const int64_t block_bytes = g.num_kv_heads * g.block_size *
                                kernels::KvRowLayoutFor(kv, g.head_dim).value_bytes;
    std::vector<uint8_t> plane(sides[1].pool->num_blocks() * block_bytes);
    ASSERT_EQ(cudaMemcpy(plane.data(), sides[1].pool->k(0), plane.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int32_t block = 0; block < sides[1].pool->num_blocks(); ++block) {
      if (held[block]) continue;
      const auto begin = plane.begin() + block * block_bytes;
      EXPECT_TRUE(std::all_of(begin, begin + block_bytes, [](uint8_t v) { return v == 0; }))
          << "block " << block << " written by a padding row";
    }
  }
}

}  // namespace
}  // namespace kvgrid::worker
