// Writes small GGUF v3 files for the model/ unit tests, byte by byte from the format's
// description (magic, version, counts, metadata, tensor directory, data at 32-byte alignment),
// independently of the reader under test.
#ifndef KVGRID_TESTS_UNIT_MODEL_GGUF_TEST_WRITER_H_
#define KVGRID_TESTS_UNIT_MODEL_GGUF_TEST_WRITER_H_

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::model::gguf_test {

class GgufTestWriter {
 public:
  void String(const std::string& key, const std::string& value) {
    Key(key, kString);
    Str(&kv_, value);
    ++n_kv_;
  }
  void U32(const std::string& key, uint32_t value) {
    Key(key, kU32);
    Put(&kv_, value);
    ++n_kv_;
  }
  void F32(const std::string& key, float value) {
    Key(key, kF32);
    Put(&kv_, value);
    ++n_kv_;
  }
  void Bool(const std::string& key, bool value) {
    Key(key, kBool);
    Put(&kv_, static_cast<uint8_t>(value ? 1 : 0));
    ++n_kv_;
  }
  void StringArray(const std::string& key, const std::vector<std::string>& values) {
    Key(key, kArray);
    Put(&kv_, kString);
    Put(&kv_, static_cast<uint64_t>(values.size()));
    for (const std::string& v : values) Str(&kv_, v);
    ++n_kv_;
  }
  void I32Array(const std::string& key, const std::vector<int32_t>& values) {
    Key(key, kArray);
    Put(&kv_, kI32);
    Put(&kv_, static_cast<uint64_t>(values.size()));
    for (int32_t v : values) Put(&kv_, v);
    ++n_kv_;
  }
  // A u8 array of `count` copies of `value` (large arrays without a vector of their own).
  void U8Array(const std::string& key, uint64_t count, uint8_t value) {
    Key(key, kArray);
    Put(&kv_, kU8);
    Put(&kv_, count);
    kv_.append(static_cast<size_t>(count), static_cast<char>(value));
    ++n_kv_;
  }
  // An array header claiming `count` elements of GGUF type `elem`, followed by `payload` only:
  // a count the file cannot hold.
  void LyingArray(const std::string& key, uint32_t elem, uint64_t count,
                  const std::string& payload) {
    Key(key, kArray);
    Put(&kv_, elem);
    Put(&kv_, count);
    kv_.append(payload);
    ++n_kv_;
  }
  // An F32 tensor; `ne` in GGUF order (ne[0] innermost).
  void F32Tensor(const std::string& name, const std::vector<uint64_t>& ne,
                 const std::vector<float>& values) {
    while (data_.size() % kAlignment != 0) data_.push_back('\0');
    Str(&infos_, name);
    Put(&infos_, static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) Put(&infos_, d);
    Put(&infos_, uint32_t{0});  // GGML_TYPE_F32
    Put(&infos_, static_cast<uint64_t>(data_.size()));
    for (float v : values) Put(&data_, v);
    ++n_tensors_;
  }

  // A directory of the running test's own under ::testing::TempDir(): ctest runs each test as
  // a process of its own, in parallel, and two tests writing one path would truncate a file the
  // other has mapped (SIGBUS).
  static std::filesystem::path TestDir() {
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::string name = info != nullptr ? std::string(info->test_suite_name()) + "." +
                                                   info->name()
                                             : "no_test";
    return std::filesystem::path(::testing::TempDir()) /
           ("gguf_" + name + "_" + std::to_string(::getpid()));
  }

  // Writes the file as TestDir()/<name> and returns its path.
  std::filesystem::path Write(const std::string& name) const {
    std::string out;
    Put(&out, uint32_t{0x46554747});  // "GGUF"
    Put(&out, uint32_t{3});
    Put(&out, n_tensors_);
    Put(&out, n_kv_);
    out += kv_;
    out += infos_;
    while (out.size() % kAlignment != 0) out.push_back('\0');
    out += data_;
    const std::filesystem::path path = TestDir() / name;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    EXPECT_TRUE(f.good()) << path;
    return path;
  }

 private:
  static constexpr uint32_t kU8 = 0, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kString = 8, kArray = 9;
  static constexpr size_t kAlignment = 32;

  template <typename T>
  static void Put(std::string* out, T value) {
    char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    out->append(bytes, sizeof(T));
  }
  static void Str(std::string* out, const std::string& s) {
    Put(out, static_cast<uint64_t>(s.size()));
    out->append(s);
  }
  void Key(const std::string& key, uint32_t type) {
    Str(&kv_, key);
    Put(&kv_, type);
  }

  std::string kv_, infos_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

}  // namespace kvgrid::model::gguf_test

#endif  // KVGRID_TESTS_UNIT_MODEL_GGUF_TEST_WRITER_H_
