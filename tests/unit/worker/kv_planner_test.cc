// KV capacity planning against hand-computed figures for real model shapes.
#include "worker/kv/kv_planner.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/model_config.h"

namespace kvgrid::worker {
namespace {

using kernels::KvDType;

// The architecture fields of the published config.json files.
constexpr char kLlama3_8B[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
  "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
  "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
  "torch_dtype": "bfloat16"})";

constexpr char kQwen2_7B[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
  "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "hidden_act": "silu", "sliding_window": 131072,
  "use_sliding_window": false, "torch_dtype": "bfloat16"})";

constexpr char kLlama3_70B[] = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
  "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
  "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "bfloat16"})";

// Mistral-7B v0.1: a 4096-token sliding window on every layer.
constexpr char kMistral7B[] = R"({
  "architectures": ["MistralForCausalLM"], "model_type": "mistral",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
  "sliding_window": 4096, "tie_word_embeddings": false, "hidden_act": "silu",
  "torch_dtype": "bfloat16"})";

constexpr int64_t kGiB = int64_t{1} << 30;

model::ModelConfig Parse(const char* text) {
  absl::StatusOr<model::ModelConfig> c = model::ParseModelConfig(text, "config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

const KvPlanRow& Row(const std::vector<KvPlanRow>& rows, const std::string& dtype) {
  for (const KvPlanRow& r : rows) {
    if (r.dtype == dtype) return r;
  }
  ADD_FAILURE() << "no row " << dtype;
  return rows.front();
}

WeightFootprint Bf16(const model::ModelConfig& c) { return *PlanWeights(c, "bf16"); }

TEST(KvPlannerTest, ParameterCountsMatchThePublishedModels) {
  // Llama-3-8B: per layer q 4096^2 + k,v 2*4096*1024 + o 4096^2 + mlp 3*4096*14336 + norms
  // 2*4096 = 218,112,000; x32 + final norm 4096 + embeddings and lm_head 2*128256*4096.
  EXPECT_EQ(CountParameters(Parse(kLlama3_8B)), 8'030'261'248);
  // Qwen2-7B: q/k/v biases 3584 + 2*512 per layer.
  EXPECT_EQ(CountParameters(Parse(kQwen2_7B)), 7'615'616'512);
  EXPECT_EQ(CountParameters(Parse(kLlama3_70B)), 70'553'706'496);
}

TEST(KvPlannerTest, BiasesAndTiedEmbeddingsChangeTheCount) {
  model::ModelConfig c = Parse(kLlama3_8B);
  const int64_t base = CountParameters(c);
  c.tie_word_embeddings = true;
  EXPECT_EQ(CountParameters(c), base - 128256LL * 4096);
  c.tie_word_embeddings = false;
  c.attention_bias = true;  // Llama: q, k, v and o biases
  EXPECT_EQ(CountParameters(c), base + 32LL * (4096 + 2 * 1024 + 4096));
  c.attention_bias = false;
  c.mlp_bias = true;
  EXPECT_EQ(CountParameters(c), base + 32LL * (2 * 14336 + 4096));
}

TEST(KvPlannerTest, BytesPerTokenOfLlama3_8B) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  // 32 layers x 8 KV heads x 128 channels x (K, V) x 2 bytes = 128 KiB.
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kF16, KvDType::kF16), 131072);
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kBF16, KvDType::kBF16), 131072);
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kF32, KvDType::kF32), 262144);
  // int8: 128 values + one fp16 scale per row.
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kInt8, KvDType::kInt8), 32 * 8 * 2 * 130);
  // int4: 64 bytes of nibbles + 4 groups x 2 bytes of scale/zero per row.
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kInt4, KvDType::kInt4), 32 * 8 * 2 * 72);
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kInt8, KvDType::kInt4), 32 * 8 * (130 + 72));
  // fp8_e4m3: one byte per channel + one fp16 scale per row, as int8.
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kFp8E4m3, KvDType::kFp8E4m3), 32 * 8 * 2 * 130);
}

TEST(KvPlannerTest, Llama3_8BOn24GiBAt8192) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  absl::StatusOr<std::vector<KvPlanRow>> rows = PlanKvCapacity(c, 24 * kGiB, 8192, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 7u);
  EXPECT_EQ((*rows)[0].dtype, "fp32");
  EXPECT_EQ((*rows)[5].dtype, "int8k-int4v");
  EXPECT_EQ(rows->back().dtype, "fp8_e4m3");

  const KvPlanRow& fp16 = Row(*rows, "fp16");
  EXPECT_EQ(fp16.weight_bytes, 2 * 8'030'261'248);
  const int64_t budget = 24 * kGiB - 2 * 8'030'261'248;  // 9,709,281,280 bytes
  EXPECT_EQ(fp16.kv_budget_bytes, budget);
  EXPECT_EQ(fp16.bytes_per_block, 16 * 131072);
  EXPECT_EQ(fp16.blocks, 4629);  // 9,709,281,280 / 2 MiB = 4629.75
  EXPECT_EQ(fp16.max_tokens, 4629 * 16);
  EXPECT_EQ(fp16.blocks_per_sequence, 512);
  EXPECT_EQ(fp16.max_sequences, 9);  // 4629 / 512

  const KvPlanRow& fp32 = Row(*rows, "fp32");
  EXPECT_EQ(fp32.blocks, budget / (16 * 262144));
  EXPECT_EQ(fp32.max_sequences, 4);

  const KvPlanRow& int4 = Row(*rows, "int4");
  EXPECT_EQ(int4.bytes_per_token, 36864);
  EXPECT_EQ(int4.blocks, 16461);      // budget / (16 * 36864)
  EXPECT_EQ(int4.max_sequences, 32);  // 16461 / 512
  // Whole blocks: max tokens never exceed the budget, and one more block would.
  for (const KvPlanRow& r : *rows) {
    EXPECT_LE(r.max_tokens * r.bytes_per_token, budget) << r.dtype;
    EXPECT_GT((r.blocks + 1) * r.bytes_per_block, budget) << r.dtype;
    EXPECT_EQ(r.max_tokens % 16, 0) << r.dtype;
  }
}

TEST(KvPlannerTest, ContextParallelGroupsHoldLongerSequences) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  auto one = PlanKvCapacity(c, 24 * kGiB, 8192, 16, Bf16(c));
  ASSERT_TRUE(one.ok());
  std::vector<KvPlanRow> group = *one;
  ApplyContextParallel(1, &group);
  EXPECT_EQ(Row(group, "fp16").blocks, Row(*one, "fp16").blocks);
  group = *one;
  ApplyContextParallel(3, &group);
  const KvPlanRow& fp16 = Row(group, "fp16");
  EXPECT_EQ(fp16.blocks, 3 * 4629);
  EXPECT_EQ(fp16.max_tokens, 3 * 4629 * 16);
  EXPECT_EQ(fp16.max_context, fp16.max_tokens);
  EXPECT_EQ(fp16.max_sequences, 4629 / 171);  // 512 blocks: 171 on rank 0 (positions 0, 3, ...)
  EXPECT_EQ(fp16.bytes_per_token, Row(*one, "fp16").bytes_per_token);  // a card's
  EXPECT_EQ(fp16.kv_budget_bytes, Row(*one, "fp16").kv_budget_bytes);
}

TEST(KvPlannerTest, Qwen2_7BOn80GB) {
  const model::ModelConfig c = Parse(kQwen2_7B);
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kF16, KvDType::kF16), 28 * 4 * 128 * 2 * 2);  // 57344
  absl::StatusOr<std::vector<KvPlanRow>> rows = PlanKvCapacity(c, 80'000'000'000, 32768, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  const KvPlanRow& bf16 = Row(*rows, "bf16");
  const int64_t budget = 80'000'000'000 - 2 * 7'615'616'512;
  EXPECT_EQ(bf16.kv_budget_bytes, budget);
  EXPECT_EQ(bf16.blocks, budget / (16 * 57344));
  EXPECT_EQ(bf16.blocks, 70592);
  EXPECT_EQ(bf16.max_sequences, 34);  // 70592 / 2048
}

TEST(KvPlannerTest, Llama3_70BNeedsMoreThanOneCardInBf16) {
  const model::ModelConfig c = Parse(kLlama3_70B);
  EXPECT_EQ(KvBytesPerToken(c, KvDType::kF16, KvDType::kF16), 80 * 8 * 128 * 4);  // 320 KiB
  absl::StatusOr<std::vector<KvPlanRow>> rows = PlanKvCapacity(c, 80 * kGiB, 8192, 16, Bf16(c));
  ASSERT_FALSE(rows.ok());
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument);
  // Both numbers are in the message.
  EXPECT_NE(rows.status().message().find("141107412992"), std::string::npos) << rows.status();
  EXPECT_NE(rows.status().message().find("85899345920"), std::string::npos) << rows.status();

  rows = PlanKvCapacity(c, 160 * kGiB, 8192, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  const KvPlanRow& fp16 = Row(*rows, "fp16");
  const int64_t budget = 160 * kGiB - 141'107'412'992;
  EXPECT_EQ(fp16.blocks, budget / (16 * 327680));
  EXPECT_EQ(fp16.max_sequences, fp16.blocks / 512);
}

TEST(KvPlannerTest, ContextRoundsUpToWholeBlocksAndMayNotFit) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  absl::StatusOr<std::vector<KvPlanRow>> rows = PlanKvCapacity(c, 24 * kGiB, 8193, 32, Bf16(c));
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(Row(*rows, "fp16").blocks_per_sequence, 257);
  // A context larger than the whole KV budget: zero sequences, not an error.
  rows = PlanKvCapacity(c, 17 * kGiB, 1 << 20, 16, Bf16(c));
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(Row(*rows, "fp16").max_sequences, 0);
  EXPECT_GT(Row(*rows, "fp16").max_tokens, 0);
}

// A model whose every layer slides holds window + one step's tokens per sequence: its
// concurrency is bounded by window-sized sequences, its context not by the KV at all.
TEST(KvPlannerTest, SlidingWindowBoundsSequencesByTheWindow) {
  const model::ModelConfig c = Parse(kMistral7B);
  ASSERT_EQ(c.KvWindow(), 4096);
  const int64_t budget = 24 * kGiB - 2 * CountParameters(c);
  for (auto [chunk, per_seq] : {std::pair<int64_t, int64_t>{8192, 769},  // ceil(12287/16) + 1
                                std::pair<int64_t, int64_t>{512, 289},   // ceil(4607/16) + 1
                                std::pair<int64_t, int64_t>{1, 257}}) {  // ceil(4096/16) + 1
    absl::StatusOr<std::vector<KvPlanRow>> rows =
        PlanKvCapacity(c, 24 * kGiB, 32768, 16, Bf16(c), chunk);
    ASSERT_TRUE(rows.ok()) << rows.status();
    const KvPlanRow& fp16 = Row(*rows, "fp16");
    EXPECT_EQ(fp16.kv_window, 4096);
    EXPECT_EQ(fp16.prefill_chunk, chunk);
    EXPECT_EQ(fp16.blocks, budget / (16 * 131072));
    EXPECT_EQ(fp16.blocks_per_sequence, per_seq) << chunk;
    EXPECT_EQ(fp16.max_sequences, fp16.blocks / per_seq) << chunk;
    EXPECT_EQ(fp16.max_context, 32768);  // not bounded by the KV
    EXPECT_EQ(SequenceBlocks(32768, 16, 4096, chunk), per_seq);
  }
  // The same model without the window: whole contexts, and the KV bounds the context.
  model::ModelConfig full = c;
  full.sliding_window = 0;
  full.sliding_layers.clear();
  absl::StatusOr<std::vector<KvPlanRow>> rows =
      PlanKvCapacity(full, 24 * kGiB, 32768, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(Row(*rows, "fp16").blocks_per_sequence, 2048);
  EXPECT_EQ(Row(*rows, "fp16").max_sequences, Row(*rows, "fp16").blocks / 2048);
  EXPECT_EQ(Row(*rows, "fp16").max_context, Row(*rows, "fp16").max_tokens);
  EXPECT_EQ(Row(*rows, "fp16").kv_window, 0);
  // A context shorter than the window is whole blocks as before.
  rows = PlanKvCapacity(c, 24 * kGiB, 1000, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(Row(*rows, "fp16").blocks_per_sequence, 63);
  // Only some layers sliding (Qwen2 with max_window_layers): planned as full attention.
  model::ModelConfig mixed = c;
  mixed.sliding_layers[0] = false;
  rows = PlanKvCapacity(mixed, 24 * kGiB, 32768, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(Row(*rows, "fp16").kv_window, 0);
  EXPECT_EQ(Row(*rows, "fp16").blocks_per_sequence, 2048);
  // Too small a budget for even one window: no sequence, no context.
  rows = PlanKvCapacity(c, 2 * CountParameters(c) + 100 * 16 * 131072, 32768, 16, Bf16(c));
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(Row(*rows, "fp16").max_sequences, 0);
  EXPECT_EQ(Row(*rows, "fp16").max_context, 0);
  // Eight such cards as a context-parallel group hold the window: 97 of its 769 blocks each.
  ApplyContextParallel(8, &*rows);
  EXPECT_EQ(Row(*rows, "fp16").max_sequences, 1);
  EXPECT_EQ(Row(*rows, "fp16").max_context, 32768);
  EXPECT_EQ(PlanKvCapacity(c, 24 * kGiB, 8192, 16, Bf16(c), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvPlannerTest, RejectsBadArguments) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  EXPECT_EQ(PlanKvCapacity(c, 0, 8192, 16, Bf16(c)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvCapacity(c, 24 * kGiB, 0, 16, Bf16(c)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvCapacity(c, 24 * kGiB, 8192, 12, Bf16(c)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanKvCapacity(c, 24 * kGiB, 8192, 16, WeightFootprint{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Weights exactly filling memory leave nothing for KV.
  EXPECT_EQ(PlanKvCapacity(c, 2 * 8'030'261'248, 8192, 16, Bf16(c)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(KvPlannerTest, WeightDTypeComesFromTheConfigForAuto) {
  model::ModelConfig c = Parse(kLlama3_8B);
  const int64_t n = 8'030'261'248;
  EXPECT_EQ(PlanWeights(c, "auto")->bytes, 2 * n);
  EXPECT_EQ(PlanWeights(c, "auto")->dtype, "bfloat16");
  EXPECT_EQ(PlanWeights(c, "fp32")->bytes, 4 * n);
  EXPECT_EQ(PlanWeights(c, "fp16")->bytes, 2 * n);
  c.torch_dtype = "";
  EXPECT_EQ(PlanWeights(c, "auto")->bytes, 4 * n);
  c.torch_dtype = "float32";
  EXPECT_EQ(PlanWeights(c, "auto")->bytes, 4 * n);
  c.torch_dtype = "float8_e4m3fn";
  EXPECT_EQ(PlanWeights(c, "auto").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanWeights(c, "int3").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvPlannerTest, QuantizedWeightsByHand) {
  // Llama-3-8B: per layer q/k/v 4096 x 6144, o 4096 x 4096, gate/up/down 3 x 4096 x 14336;
  // every input width is a multiple of 32.
  model::ModelConfig c = Parse(kLlama3_8B);
  const int64_t n = 8'030'261'248;
  const int64_t linear = 32ll * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336);  // 6,979,321,856
  const int64_t head = 128256ll * 4096;
  // Q4_0: linear weights at 18 bytes per 32, the head at 34 per 32, the rest at bf16.
  EXPECT_EQ(PlanWeights(c, "q4_0")->bytes,
            linear / 32 * 18 + head / 32 * 34 + (n - linear - head) * 2);
  EXPECT_EQ(PlanWeights(c, "q8_0")->bytes,
            linear / 32 * 34 + head / 32 * 34 + (n - linear - head) * 2);
  // A tied head (one vocabulary matrix fewer) keeps the embedding and adds a Q8_0 copy.
  model::ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(PlanWeights(tied, "q4_1")->bytes,
            linear / 32 * 20 + head / 32 * 34 + (n - head - linear) * 2);
  // An AWQ/GPTQ config: the linear weights in 20-byte blocks, nothing else quantized; fp16.
  c.quantization = {.method = model::QuantMethod::kGptq, .bits = 4, .group_size = 128};
  c.torch_dtype = "float16";
  absl::StatusOr<WeightFootprint> gptq = PlanWeights(c, "auto");
  ASSERT_TRUE(gptq.ok());
  EXPECT_EQ(gptq->dtype, "gptq");
  EXPECT_EQ(gptq->bytes, linear / 32 * 20 + (n - linear) * 2);
  // AWQ leaves layers whose input width is not a multiple of the group size unconverted.
  c.quantization.method = model::QuantMethod::kAwq;
  c.intermediate_size = 14336 + 64;  // down_proj's input: not a multiple of 128
  const int64_t n2 = CountParameters(c);
  // All but down_proj: q/k/v, o, gate/up.
  const int64_t rest_linear = 32ll * (4096 * 6144 + 4096 * 4096 + 2 * 4096 * 14400);
  EXPECT_EQ(PlanWeights(c, "auto")->bytes, rest_linear / 32 * 20 + (n2 - rest_linear) * 2);
  // Quantized weights leave more of a 24 GiB card to the KV cache.
  const model::ModelConfig plain = Parse(kLlama3_8B);
  const int64_t bf16_blocks =
      Row(*PlanKvCapacity(plain, 24 * kGiB, 8192, 16, *PlanWeights(plain, "bf16")), "fp16").blocks;
  const int64_t q4_blocks =
      Row(*PlanKvCapacity(plain, 24 * kGiB, 8192, 16, *PlanWeights(plain, "q4_0")), "fp16").blocks;
  EXPECT_GT(q4_blocks, 2 * bf16_blocks);
}

TEST(KvPlannerTest, StepWorkspaceOfLlama3_8BByHand) {
  const model::ModelConfig c = Parse(kLlama3_8B);
  // Per token: x, h (2 x 4096) + fused qkv and q/k/v (2 x 6144) + attention (4096) +
  // gate_up and act (3 x 14336) + cast copy (14336) = 81920 floats.
  const int64_t per_token = 2 * 4096 + 2 * 6144 + 4096 + 3 * 14336 + 14336;
  EXPECT_EQ(per_token, 81920);
  const int64_t rows = 64 * (4096 + 128256);
  EXPECT_EQ(StepWorkspaceBytes(c, 8192, 64), 4 * (8192 * per_token + rows) + (256ll << 20));
}

TEST(KvPlannerTest, GpuKvBudgetIsUtilizationMinusWhatIsInUse) {
  constexpr int64_t kGiB = 1ll << 30;
  // An 80 GiB card with 16 GiB in use (weights, context), 90%, a 2 GiB workspace.
  auto b = GpuKvBudget(80 * kGiB, 64 * kGiB, 0.9, 2 * kGiB);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, static_cast<int64_t>(0.9 * 80 * kGiB) - 16 * kGiB - 2 * kGiB);
  // Nothing left: the numbers are in the message.
  auto none = GpuKvBudget(80 * kGiB, 64 * kGiB, 0.2, 2 * kGiB);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(none.status().message()).find("--gpu-memory-utilization 0.2"),
            std::string::npos)
      << none.status();
  for (double bad : {0.0, -0.5, 1.5}) {
    EXPECT_EQ(GpuKvBudget(80 * kGiB, 64 * kGiB, bad, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace kvgrid::worker
