// Files found in a model directory must stay in it once links are followed: every loader that
// reads a file by its fixed name (config.json, generation_config.json, tokenizer.json,
// tokenizer_config.json, model.safetensors, the index and its shards) refuses a symbolic link
// that leaves the directory, naming the file, while links inside it and a Hugging Face cache
// snapshot's links into its repository's blobs/ keep working.
#include "model/model_dir.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/chat_template.h"
#include "model/generation_config.h"
#include "model/gguf_tokenizer.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace kvgrid::model {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kConfig[] = R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
  "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
  "max_position_embeddings": 64})";

// One F32 tensor "w" of a single element.
std::string TinySafetensors() {
  const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + std::string(4, '\0');
}

class ModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) /
            ("model_dir_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    dir_ = root_ / "model";
    outside_ = root_ / "outside";
    fs::create_directories(dir_);
    fs::create_directories(outside_);
  }
  void TearDown() override { fs::remove_all(root_); }

  static void Write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  // dir_/name -> outside_/name holding `text`.
  void LinkOutside(const std::string& name, const std::string& text) {
    Write(outside_ / name, text);
    fs::create_symlink(outside_ / name, dir_ / name);
  }

  fs::path root_, dir_, outside_;
};

TEST_F(ModelDirTest, ConfigLinkedOutsideIsRefusedNamingTheFile) {
  LinkOutside("config.json", kConfig);
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir_);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr((dir_ / "config.json").string()));
  EXPECT_THAT(c.status().message(), HasSubstr("outside the model directory"));
  // Named explicitly by the operator, the same file is read.
  EXPECT_TRUE(LoadModelConfig(dir_ / "config.json").ok());
}

TEST_F(ModelDirTest, LinksInsideTheDirectoryAreRead) {
  Write(dir_ / "real" / "config.json", kConfig);
  fs::create_symlink("real/config.json", dir_ / "config.json");
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir_);
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST_F(ModelDirTest, AModelDirectoryThatIsItselfALinkIsRead) {
  Write(dir_ / "config.json", kConfig);
  fs::create_symlink(dir_, root_ / "alias");
  absl::StatusOr<ModelConfig> c = LoadModelConfig(root_ / "alias");
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST_F(ModelDirTest, HuggingFaceSnapshotLinksIntoItsBlobsAreRead) {
  const fs::path repo = root_ / "hub" / "models--org--tiny";
  const fs::path snapshot = repo / "snapshots" / "0123abcd";
  Write(repo / "blobs" / "c0ffee", kConfig);
  Write(repo / "blobs" / "5afe", TinySafetensors());
  fs::create_directories(snapshot);
  fs::create_symlink("../../blobs/c0ffee", snapshot / "config.json");
  fs::create_symlink("../../blobs/5afe", snapshot / "model.safetensors");
  absl::StatusOr<ModelConfig> c = LoadModelConfig(snapshot);
  EXPECT_TRUE(c.ok()) << c.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(snapshot);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  // A snapshot link that leaves the cache repository is refused like any other.
  Write(root_ / "hub" / "models--org--other" / "blobs" / "beef", kConfig);
  fs::remove(snapshot / "config.json");
  fs::create_symlink("../../../models--org--other/blobs/beef", snapshot / "config.json");
  c = LoadModelConfig(snapshot);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("outside the model directory " + repo.string()));
}

TEST_F(ModelDirTest, SingleCheckpointLinkedOutsideIsRefused) {
  LinkOutside("model.safetensors", TinySafetensors());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors: a symbolic link to"));
}

TEST_F(ModelDirTest, ShardLinkedOutsideIsRefusedNamingTheShard) {
  Write(dir_ / "model.safetensors.index.json",
        R"({"weight_map": {"w": "model-00001-of-00001.safetensors"}})");
  LinkOutside("model-00001-of-00001.safetensors", TinySafetensors());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ckpt.status().message(),
              HasSubstr("weight_map: shard \"model-00001-of-00001.safetensors\""));
  EXPECT_THAT(ckpt.status().message(), HasSubstr("outside the model directory"));
  // The same shard as a file of the directory loads.
  fs::remove(dir_ / "model-00001-of-00001.safetensors");
  Write(dir_ / "model-00001-of-00001.safetensors", TinySafetensors());
  ckpt = Checkpoint::Open(dir_);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
}

TEST_F(ModelDirTest, IndexLinkedOutsideIsRefused) {
  LinkOutside("model.safetensors.index.json", R"({"weight_map": {}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(ckpt.status().message(), HasSubstr("model.safetensors.index.json: a symbolic link"));
}

TEST_F(ModelDirTest, TokenizerLinkedOutsideIsRefused) {
  LinkOutside("tokenizer.json", "{}");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = LoadModelTokenizer(dir_);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json: a symbolic link"));
  // Beside a .gguf, the directory is the file's.
  EXPECT_THAT(LoadModelTokenizer(dir_ / "model.gguf").status().message(),
              HasSubstr("tokenizer.json: a symbolic link"));
}

TEST_F(ModelDirTest, GenerationConfigLinkedOutsideIsRefused) {
  LinkOutside("generation_config.json", R"({"eos_token_id": 2})");
  absl::StatusOr<GenerationConfig> g = LoadGenerationConfig(dir_);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(g.status().message(), HasSubstr("generation_config.json: a symbolic link"));
}

TEST_F(ModelDirTest, TokenizerConfigLinkedOutsideIsRefused) {
  LinkOutside("tokenizer_config.json", R"({"chat_template": "{{ 'x' }}"})");
  absl::StatusOr<std::unique_ptr<ChatTemplate>> t = ChatTemplate::ForModel(dir_);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json: a symbolic link"));
}

TEST_F(ModelDirTest, MissingAndDanglingFilesAreLeftToTheLoader) {
  EXPECT_TRUE(CheckInsideModelDir(dir_, dir_ / "absent.json").ok());
  fs::create_symlink(outside_ / "gone.json", dir_ / "dangling.json");
  EXPECT_TRUE(CheckInsideModelDir(dir_, dir_ / "dangling.json").ok());
}

}  // namespace
}  // namespace kvgrid::model
