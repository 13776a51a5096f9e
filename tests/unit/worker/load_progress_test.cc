// Loading progress: the tally by layer, and the calls LlamaModel::Load and LoadGguf make.
#include "worker/executor/load_progress.h"

#include <filesystem>
#include <vector>

#include "gtest/gtest.h"
#include "worker/executor/llama_model.h"

namespace kvgrid::worker {
namespace {

TEST(LoadTallyTest, CountsTensorsOutsideLayersFirstThenEachLayer) {
  const LoadTally tally({{"model.embed_tokens.weight", 100},
                         {"model.layers.0.mlp.up_proj.weight", 10},
                         {"model.layers.1.mlp.up_proj.weight", 20},
                         {"model.layers.1.input_layernorm.weight", 1},
                         {"model.layers.10.extra", 7},  // beyond num_layers: outside
                         {"model.layersX.0.odd", 3},    // no index: outside
                         {"model.norm.weight", 2}},
                        "model.layers.", 2);
  const LoadProgress none = tally.After(0);
  EXPECT_EQ(none.layers_done, 0);
  EXPECT_EQ(none.layers_total, 2);
  EXPECT_EQ(none.tensors_done, 4);
  EXPECT_EQ(none.bytes_done, 112);
  EXPECT_EQ(none.tensors_total, 7);
  EXPECT_EQ(none.bytes_total, 143);
  EXPECT_EQ(tally.After(1).bytes_done, 122);
  const LoadProgress all = tally.After(2);
  EXPECT_EQ(all.tensors_done, all.tensors_total);
  EXPECT_EQ(all.bytes_done, all.bytes_total);
  EXPECT_EQ(tally.After(5).layers_done, 2);  // clamped
}

// Every call moves forward, the first comes before any layer and the last covers every tensor.
void ExpectWholeRun(const std::vector<LoadProgress>& calls, int64_t layers) {
  ASSERT_EQ(static_cast<int64_t>(calls.size()), layers + 1);
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].layers_done, static_cast<int64_t>(i));
    EXPECT_EQ(calls[i].layers_total, layers);
    if (i > 0) EXPECT_GT(calls[i].bytes_done, calls[i - 1].bytes_done);
  }
  EXPECT_GT(calls.front().bytes_done, 0);  // the embedding
  EXPECT_EQ(calls.back().tensors_done, calls.back().tensors_total);
  EXPECT_EQ(calls.back().bytes_done, calls.back().bytes_total);
}

TEST(LoadProgressTest, SafetensorsLoadReportsEveryLayer) {
  const auto dir = std::filesystem::path(KVGRID_SOURCE_DIR) / "models" / "kjv-tiny";
  std::vector<LoadProgress> calls;
  auto model = LlamaModel::Load(dir, {}, [&](const LoadProgress& p) { calls.push_back(p); });
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectWholeRun(calls, (*model)->config().num_hidden_layers);
  EXPECT_GT(calls.back().bytes_total, 1000);
}

}  // namespace
}  // namespace kvgrid::worker
