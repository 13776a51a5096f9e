// --load-format dummy: a model of config.json's shape with random weights, from a directory
// that holds no checkpoint; the same weights every load; on a device, a model with no weights
// at all, which refuses to run on the CPU.
#include "tools/kvgrid/model_setup.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tools/kvgrid/args.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::cli {
namespace {

namespace fs = std::filesystem;
using kernels::cpu::WeightDType;

const fs::path kKjvTiny = fs::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";

// A directory with kjv-tiny's config.json and tokenizer.json and no weights.
class DummyLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvgrid-dummy-" + std::to_string(getpid()));
    fs::create_directories(dir_);
    fs::copy_file(kKjvTiny / "config.json", dir_ / "config.json");
    fs::copy_file(kKjvTiny / "tokenizer.json", dir_ / "tokenizer.json");
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

absl::StatusOr<std::vector<float>> PromptLogits(worker::LlamaModel& model) {
  auto pool = worker::KvPool::Create(
      model.KvGeometryFor(16, kernels::KvDType::kF32, kernels::KvDType::kF32), 4 << 20);
  if (!pool.ok()) return pool.status();
  worker::BlockManager blocks((*pool)->num_blocks(), 16);
  std::vector<int32_t> prompt(20);
  std::iota(prompt.begin(), prompt.end(), 9);
  if (absl::Status s = blocks.Reserve(1, 20); !s.ok()) return s;
  std::vector<float> logits;
  if (absl::Status s = model.Forward(worker::SingleSequenceBatch(blocks, 1, 0, prompt), **pool,
                                     &logits);
      !s.ok()) {
    return s;
  }
  return logits;
}

TEST_F(DummyLoadTest, RandomWeightsOfTheConfigsShapeTheSameEveryLoad) {
  // The checkpoint is what the directory lacks.
  EXPECT_FALSE(LoadModelDir(dir_).ok());
  absl::StatusOr<LoadedModel> a = LoadModelDir(dir_, {}, WeightDType::kF32, LoadFormat::kDummy);
  ASSERT_TRUE(a.ok()) << a.status();
  const model::ModelConfig& c = a->model->config();
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_EQ(c.num_hidden_layers, 4);
  ASSERT_TRUE(a->tokenizer != nullptr);
  const worker::LlamaWeights& w = a->model->weights();
  ASSERT_EQ(w.layers.size(), 4u);
  EXPECT_EQ(static_cast<int64_t>(w.embed.size()), c.vocab_size * c.hidden_size);
  EXPECT_EQ(static_cast<int64_t>(w.lm_head.size()), c.vocab_size * c.hidden_size);

  absl::StatusOr<std::vector<float>> la = PromptLogits(*a->model);
  ASSERT_TRUE(la.ok()) << la.status();
  ASSERT_EQ(static_cast<int64_t>(la->size()), c.vocab_size);
  float spread = 0;
  for (float x : *la) {
    ASSERT_TRUE(std::isfinite(x));
    spread = std::max(spread, std::abs(x - la->front()));
  }
  EXPECT_GT(spread, 0.f);  // not all one value: the weights are not zeros

  absl::StatusOr<LoadedModel> b = LoadModelDir(dir_, {}, WeightDType::kF32, LoadFormat::kDummy);
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<std::vector<float>> lb = PromptLogits(*b->model);
  ASSERT_TRUE(lb.ok()) << lb.status();
  EXPECT_EQ(*la, *lb);
}

TEST_F(DummyLoadTest, QuantizesAsAsked) {
  absl::StatusOr<LoadedModel> q =
      LoadModelDir(dir_, {}, WeightDType::kQ8_0, LoadFormat::kDummy);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->model->weights().layers[0].qkv.empty());  // held in blocks instead
  EXPECT_FALSE(q->model->weights().layers[0].qkv_q.empty());
}

TEST_F(DummyLoadTest, OnADeviceTheModelHoldsNoWeightsAndDoesNotRun) {
  absl::StatusOr<LoadedModel> m =
      LoadModelDir(dir_, {}, WeightDType::kF32, LoadFormat::kDummyOnDevice);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->model->has_weights());
  EXPECT_EQ(m->model->WeightBytes(), 0);
  EXPECT_EQ(m->model->config().hidden_size, 256);
  EXPECT_EQ(PromptLogits(*m->model).status().code(), absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<LoadedModel> q =
      LoadModelDir(dir_, {}, WeightDType::kQ4_0, LoadFormat::kDummyOnDevice);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("--weight-dtype"), std::string::npos) << q.status();
}

TEST_F(DummyLoadTest, ErrorsNameWhatIsMissing) {
  fs::remove(dir_ / "config.json");
  absl::StatusOr<LoadedModel> m = LoadModelDir(dir_, {}, WeightDType::kF32, LoadFormat::kDummy);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("config.json"), std::string::npos) << m.status();

  const fs::path gguf = dir_ / "model.gguf";
  fs::copy_file(kKjvTiny / "tokenizer.json", gguf);  // a file; dummy reads no weights file
  m = LoadModelDir(gguf, {}, WeightDType::kF32, LoadFormat::kDummy);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("--load-format dummy"), std::string::npos) << m.status();
}

absl::StatusOr<LoadFormat> FormatOf(std::vector<std::string> argv, bool on_device) {
  std::vector<char*> ptrs;
  for (std::string& a : argv) ptrs.push_back(a.data());
  absl::StatusOr<Args> args = Args::Parse(static_cast<int>(ptrs.size()), ptrs.data(), 0);
  if (!args.ok()) return args.status();
  return LoadFormatFromArgs(*args, on_device);
}

TEST(LoadFormatTest, ParsesTheFlag) {
  EXPECT_EQ(*FormatOf({}, false), LoadFormat::kAuto);
  EXPECT_EQ(*FormatOf({"--load-format", "auto"}, true), LoadFormat::kAuto);
  EXPECT_EQ(*FormatOf({"--load-format", "dummy"}, false), LoadFormat::kDummy);
  EXPECT_EQ(*FormatOf({"--load-format", "dummy"}, true), LoadFormat::kDummyOnDevice);
  absl::StatusOr<LoadFormat> bad = FormatOf({"--load-format", "pt"}, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--load-format"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace kvgrid::cli
