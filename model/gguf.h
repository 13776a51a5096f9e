// A GGUF (version 2 or 3) file from llama.cpp: memory-mapped, with its metadata and tensor
// directory checked against the file before anything is exposed — every count, string length,
// dimension and offset is bounded by the file's size, and every tensor lies inside the data
// section at the file's alignment without overlapping another.
//
// Tensor dimensions are GGUF's: ne[0] is the innermost (a PyTorch [out, in] weight is
// ne = {in, out}). Block formats are exposed as bytes, in ggml's layouts, which
// kernels::cpu::QuantMatrix keeps as they are: blocks of 32 elements (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, IQ4_NL) or K-quant super-blocks of 256 (Q2_K..Q6_K) along ne[0].
//
// Thread-safety: immutable after Open.
#ifndef KVGRID_MODEL_GGUF_H_
#define KVGRID_MODEL_GGUF_H_

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::model {

// ggml tensor types kvgrid reads.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kIQ4_NL = 20,
  kBF16 = 30,
};

// "F32", "Q4_K", ...; "type N" for a value that is not a GgmlType.
std::string GgmlTypeName(GgmlType type);

// Elements per block (1 for F32/F16/BF16, 32, or 256 for the K-quants) and bytes per block, or
// 0 for a type kvgrid does not read.
int64_t GgmlBlockElements(GgmlType type);
int64_t GgmlBlockBytes(GgmlType type);

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> ne;             // GGUF order: ne[0] innermost
  std::span<const std::byte> data;     // inside the mapping
  [[nodiscard]] int64_t NumElements() const;
};

// A numeric metadata array held at its own element width: a view of its bytes inside the
// mapping, so a 64 MiB u8 array costs no memory beyond the mapped file. Elements are read (and
// widened) one at a time. Every element was checked when the file was opened: bools are 0 or
// 1, u64 values fit in int64_t.
class GgufNumberArray {
 public:
  // GGUF's element type codes (U8 = 0 ... F64 = 12).
  GgufNumberArray(uint32_t type, size_t count, const std::byte* data)
      : type_(type), count_(count), data_(data) {}
  [[nodiscard]] size_t size() const { return count_; }
  [[nodiscard]] bool empty() const { return count_ == 0; }
  // F32 or F64 elements.
  [[nodiscard]] bool is_float() const { return type_ == 6 || type_ == 12; }
  // Bytes per element (1, 2, 4 or 8).
  [[nodiscard]] size_t element_bytes() const;
  // Element `i` (< size()) widened: integers and bools to int64_t (floats truncated), or to
  // double.
  [[nodiscard]] int64_t Int(size_t i) const;
  [[nodiscard]] double Float(size_t i) const;

 private:
  uint32_t type_;
  size_t count_;
  const std::byte* data_;  // inside the mapping; count_ * element_bytes() bytes
};

// A string metadata array as views into the mapping: one 8-byte offset per element (what the
// file itself spends on each element's length), not a copy of every string.
class GgufStringArray {
 public:
  [[nodiscard]] size_t size() const { return offsets_.size(); }
  [[nodiscard]] bool empty() const { return offsets_.empty(); }
  // Element `i` (< size()), valid while the file lives.
  [[nodiscard]] std::string_view operator[](size_t i) const;
  // Copies of every element.
  [[nodiscard]] std::vector<std::string> ToVector() const;

 private:
  friend class GgufFile;
  const std::byte* base_ = nullptr;  // the mapping
  std::vector<uint64_t> offsets_;    // of each element's 8-byte length, from base_
};

// A metadata value: scalars widened (integers to int64_t, floats to double), strings, or
// arrays held in the mapping.
using GgufValue = std::variant<int64_t, uint64_t, double, bool, std::string, GgufNumberArray,
                               GgufStringArray>;

class GgufFile {
 public:
  // Errors: NOT_FOUND for a missing file; INVALID_ARGUMENT naming the file and what is wrong
  // (bad magic, unsupported version, a count, string, dimension or offset the file cannot hold,
  // overlapping tensors, duplicate names, an element count that is not whole blocks of its
  // type); UNIMPLEMENTED for tensor types other than GgmlType's (naming the tensor and type).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::filesystem::path& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] uint32_t version() const { return version_; }
  [[nodiscard]] const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  [[nodiscard]] const std::map<std::string, GgufTensor>& tensors() const { return tensors_; }

  // Typed metadata lookups. Errors: NOT_FOUND naming the key; INVALID_ARGUMENT when the value
  // has another type.
  absl::StatusOr<int64_t> GetInt(const std::string& key) const;
  absl::StatusOr<double> GetFloat(const std::string& key) const;  // integers convert
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<bool> GetBool(const std::string& key) const;
  // Array metadata, owned by the file (valid while it lives). Every element was read from the
  // file, so a length is bounded by the file's size. GetIntArray: integer arrays of any width
  // and bool arrays (as 0/1); GetNumberArray: those and float arrays. Errors as above;
  // INVALID_ARGUMENT also for an array of another element type.
  absl::StatusOr<const GgufStringArray*> GetStringArray(const std::string& key) const;
  absl::StatusOr<const GgufNumberArray*> GetIntArray(const std::string& key) const;
  absl::StatusOr<const GgufNumberArray*> GetNumberArray(const std::string& key) const;
  // Errors: NOT_FOUND naming the tensor and the file.
  absl::StatusOr<const GgufTensor*> Find(const std::string& name) const;

 private:
  GgufFile() = default;
  absl::Status Parse();

  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::map<std::string, GgufTensor> tensors_;
};

// Bytes of `n` elements of `type` (n a multiple of GgmlBlockElements(type)), or nullopt for an
// unsupported type or a count that is not whole blocks.
std::optional<int64_t> GgmlBytes(GgmlType type, int64_t n);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_GGUF_H_
