#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"

namespace kvgrid::model {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
// Bounds on what a header may claim, well above any real model, so a lying count fails fast.
constexpr uint64_t kMaxDims = 4;

enum class ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// Reads little-endian values from [pos, end) and fails instead of running past the end.
class Cursor {
 public:
  Cursor(const std::byte* begin, size_t size) : p_(begin), base_(begin), end_(begin + size) {}
  template <typename T>
  bool Read(T* out) {
    if (static_cast<size_t>(end_ - p_) < sizeof(T)) return false;
    std::memcpy(out, p_, sizeof(T));
    p_ += sizeof(T);
    return true;
  }
  bool ReadString(std::string* out) {
    uint64_t n;
    if (!Read(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
    out->assign(reinterpret_cast<const char*>(p_), static_cast<size_t>(n));
    p_ += n;
    return true;
  }
  [[nodiscard]] size_t offset() const { return static_cast<size_t>(p_ - base_); }
  [[nodiscard]] size_t left() const { return static_cast<size_t>(end_ - p_); }
  [[nodiscard]] const std::byte* here() const { return p_; }
  // Steps over a length-prefixed string without copying it.
  bool SkipString() {
    uint64_t n;
    if (!Read(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
    p_ += n;
    return true;
  }
  bool Skip(size_t n) {
    if (left() < n) return false;
    p_ += n;
    return true;
  }

 private:
  const std::byte* p_;
  const std::byte* base_;
  const std::byte* end_;
};

size_t ScalarSize(ValueType t) {
  switch (t) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kBool: return 1;
    case ValueType::kU16: case ValueType::kI16: return 2;
    case ValueType::kU32: case ValueType::kI32: case ValueType::kF32: return 4;
    case ValueType::kU64: case ValueType::kI64: case ValueType::kF64: return 8;
    default: return 0;
  }
}

// One scalar of type `t` widened into `out` (int64_t, uint64_t, double or bool).
bool ReadScalar(Cursor& c, ValueType t, GgufValue* out) {
  switch (t) {
    case ValueType::kU8: { uint8_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kI8: { int8_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kU16: { uint16_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kI16: { int16_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kU32: { uint32_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kI32: { int32_t v; if (!c.Read(&v)) return false; *out = int64_t{v}; return true; }
    case ValueType::kI64: { int64_t v; if (!c.Read(&v)) return false; *out = v; return true; }
    case ValueType::kU64: {
      uint64_t v;
      if (!c.Read(&v)) return false;
      if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        *out = static_cast<int64_t>(v);
      } else {
        *out = v;
      }
      return true;
    }
    case ValueType::kF32: { float v; if (!c.Read(&v)) return false; *out = double{v}; return true; }
    case ValueType::kF64: { double v; if (!c.Read(&v)) return false; *out = v; return true; }
    case ValueType::kBool: {
      uint8_t v;
      if (!c.Read(&v) || v > 1) return false;
      *out = v == 1;
      return true;
    }
    default: return false;
  }
}

}  // namespace

std::string_view GgufStringArray::operator[](size_t i) const {
  uint64_t n;
  const std::byte* p = base_ + offsets_[i];
  std::memcpy(&n, p, sizeof(n));  // checked against the file when it was parsed
  return std::string_view(reinterpret_cast<const char*>(p + sizeof(n)), static_cast<size_t>(n));
}

std::vector<std::string> GgufStringArray::ToVector() const {
  std::vector<std::string> out;
  out.reserve(size());
  for (size_t i = 0; i < size(); ++i) out.emplace_back((*this)[i]);
  return out;
}

size_t GgufNumberArray::element_bytes() const { return ScalarSize(static_cast<ValueType>(type_)); }

int64_t GgufNumberArray::Int(size_t i) const {
  const size_t width = element_bytes();
  Cursor c(data_ + i * width, width);
  GgufValue x;
  ReadScalar(c, static_cast<ValueType>(type_), &x);  // checked when the file was parsed
  if (const auto* v = std::get_if<int64_t>(&x)) return *v;
  if (const auto* v = std::get_if<bool>(&x)) return *v ? 1 : 0;
  if (const auto* v = std::get_if<double>(&x)) return static_cast<int64_t>(*v);
  return 0;
}

double GgufNumberArray::Float(size_t i) const {
  const size_t width = element_bytes();
  Cursor c(data_ + i * width, width);
  GgufValue x;
  ReadScalar(c, static_cast<ValueType>(type_), &x);
  if (const auto* v = std::get_if<double>(&x)) return *v;
  if (const auto* v = std::get_if<int64_t>(&x)) return static_cast<double>(*v);
  if (const auto* v = std::get_if<bool>(&x)) return *v ? 1.0 : 0.0;
  return 0.0;
}

int64_t GgmlBlockElements(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16: return 1;
    case GgmlType::kQ4_0: case GgmlType::kQ4_1: case GgmlType::kQ5_0: case GgmlType::kQ5_1:
    case GgmlType::kQ8_0: case GgmlType::kIQ4_NL: return 32;
    case GgmlType::kQ2_K: case GgmlType::kQ3_K: case GgmlType::kQ4_K: case GgmlType::kQ5_K:
    case GgmlType::kQ6_K: return 256;
  }
  return 0;
}

int64_t GgmlBlockBytes(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return 4;
    case GgmlType::kF16: case GgmlType::kBF16: return 2;
    case GgmlType::kQ4_0: return 2 + 16;         // d, 32 nibbles
    case GgmlType::kQ4_1: return 4 + 16;         // d, m, 32 nibbles
    case GgmlType::kQ5_0: return 2 + 4 + 16;     // d, 32 high bits, 32 nibbles
    case GgmlType::kQ5_1: return 4 + 4 + 16;     // d, m, 32 high bits, 32 nibbles
    case GgmlType::kQ8_0: return 2 + 32;         // d, 32 int8
    case GgmlType::kIQ4_NL: return 2 + 16;       // d, 32 nibbles indexing a table
    case GgmlType::kQ2_K: return 16 + 64 + 4;    // scales/mins, 2-bit values, d, dmin
    case GgmlType::kQ3_K: return 32 + 64 + 12 + 2;  // high bits, 2-bit values, scales, d
    case GgmlType::kQ4_K: return 4 + 12 + 128;   // d, dmin, 6-bit scales/mins, nibbles
    case GgmlType::kQ5_K: return 4 + 12 + 32 + 128;  // as Q4_K plus 256 high bits
    case GgmlType::kQ6_K: return 128 + 64 + 16 + 2;  // low nibbles, high 2 bits, scales, d
  }
  return 0;
}

std::string GgmlTypeName(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return "F32";
    case GgmlType::kF16: return "F16";
    case GgmlType::kBF16: return "BF16";
    case GgmlType::kQ4_0: return "Q4_0";
    case GgmlType::kQ4_1: return "Q4_1";
    case GgmlType::kQ5_0: return "Q5_0";
    case GgmlType::kQ5_1: return "Q5_1";
    case GgmlType::kQ8_0: return "Q8_0";
    case GgmlType::kIQ4_NL: return "IQ4_NL";
    case GgmlType::kQ2_K: return "Q2_K";
    case GgmlType::kQ3_K: return "Q3_K";
    case GgmlType::kQ4_K: return "Q4_K";
    case GgmlType::kQ5_K: return "Q5_K";
    case GgmlType::kQ6_K: return "Q6_K";
  }
  return absl::StrCat("type ", static_cast<uint32_t>(type));
}

std::optional<int64_t> GgmlBytes(GgmlType type, int64_t n) {
  const int64_t per_block = GgmlBlockElements(type);
  if (n < 0 || per_block == 0 || n % per_block != 0) return std::nullopt;
  return n / per_block * GgmlBlockBytes(type);
}

int64_t GgufTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": not a regular file"));
  }
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->path_ = path;
  file->size_ = static_cast<size_t>(st.st_size);
  if (file->size_ > 0) {
    void* map = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path.string(), ": cannot map"));
    }
    file->map_ = map;
  }
  ::close(fd);
  if (absl::Status s = file->Parse(); !s.ok()) return s;
  return file;
}

GgufFile::~GgufFile() {
  if (map_ != nullptr) munmap(map_, size_);
}

absl::Status GgufFile::Parse() {
  auto bad = [this](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": ", parts...));
  };
  Cursor c(static_cast<const std::byte*>(map_), size_);
  uint32_t magic = 0;
  if (!c.Read(&magic) || magic != kMagic) return bad("not a GGUF file (bad magic)");
  if (!c.Read(&version_) || (version_ != 2 && version_ != 3)) {
    return bad("GGUF version ", version_, " is not supported (2 or 3)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  if (!c.Read(&n_tensors) || !c.Read(&n_kv)) return bad("truncated header");
  // Every metadata entry and tensor info takes at least 8 bytes of name length.
  if (n_tensors > c.left() / 8 || n_kv > c.left() / 8) {
    return bad("header claims ", n_tensors, " tensors and ", n_kv,
               " metadata entries, more than the file can hold");
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    uint32_t type = 0;
    if (!c.ReadString(&key) || !c.Read(&type)) return bad("metadata entry ", i, " is truncated");
    if (metadata_.contains(key)) return bad("metadata key '", key, "' appears twice");
    const auto t = static_cast<ValueType>(type);
    GgufValue value;
    if (t == ValueType::kString) {
      std::string s;
      if (!c.ReadString(&s)) return bad("metadata '", key, "': truncated string");
      value = std::move(s);
    } else if (t == ValueType::kArray) {
      uint32_t elem = 0;
      uint64_t count = 0;
      if (!c.Read(&elem) || !c.Read(&count)) return bad("metadata '", key, "': truncated array");
      const auto et = static_cast<ValueType>(elem);
      const size_t min_size = et == ValueType::kString ? 8 : ScalarSize(et);
      if (min_size == 0) {
        return bad("metadata '", key, "': arrays of type ", elem, " are not supported");
      }
      if (count > c.left() / min_size) {
        return bad("metadata '", key, "': ", count, " elements do not fit in the file");
      }
      if (et == ValueType::kString) {
        GgufStringArray v;
        v.base_ = static_cast<const std::byte*>(map_);
        // count * 8 bytes fit in the file (checked above): one allocation of that, no growth.
        v.offsets_.reserve(static_cast<size_t>(count));
        for (uint64_t j = 0; j < count; ++j) {
          v.offsets_.push_back(c.offset());
          if (!c.SkipString()) return bad("metadata '", key, "': truncated string array");
        }
        value = std::move(v);
      } else {
        // Numbers stay in the mapping at their width. Bools (0 or 1) and u64s (that must fit in
        // int64_t) are checked now, so reading an element later cannot fail.
        const std::byte* data = c.here();
        const bool checked = et == ValueType::kBool || et == ValueType::kU64;
        if (!checked && !c.Skip(static_cast<size_t>(count) * min_size)) {
          return bad("metadata '", key, "': truncated array");
        }
        for (uint64_t j = 0; checked && j < count; ++j) {
          GgufValue x;
          if (!ReadScalar(c, et, &x)) {
            return bad("metadata '", key, "': element ", j, " is out of range for its type");
          }
          if (std::holds_alternative<uint64_t>(x)) {
            return bad("metadata '", key, "': an array value does not fit in int64");
          }
        }
        value = GgufNumberArray(elem, static_cast<size_t>(count), data);
      }
    } else if (!ReadScalar(c, t, &value)) {
      return bad("metadata '", key, "': bad or truncated value of type ", type);
    }
    metadata_.emplace(std::move(key), std::move(value));
  }
  int64_t alignment = 32;
  if (auto it = metadata_.find("general.alignment"); it != metadata_.end()) {
    if (!std::holds_alternative<int64_t>(it->second)) return bad("general.alignment: not an integer");
    alignment = std::get<int64_t>(it->second);
    if (alignment <= 0 || alignment > (1 << 20) || (alignment & (alignment - 1)) != 0) {
      return bad("general.alignment: ", alignment, " is not a power of two up to 1 MiB");
    }
  }
  struct Info {
    GgufTensor t;
    uint64_t offset;
    int64_t bytes;
  };
  std::vector<Info> infos;
  infos.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Info info;
    uint32_t n_dims = 0, type = 0;
    if (!c.ReadString(&info.t.name) || !c.Read(&n_dims)) return bad("tensor info ", i, " is truncated");
    if (n_dims == 0 || n_dims > kMaxDims) {
      return bad("tensor '", info.t.name, "': ", n_dims, " dimensions (1 to 4 allowed)");
    }
    int64_t n = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      if (!c.Read(&dim)) return bad("tensor '", info.t.name, "': truncated dimensions");
      if (dim == 0 || dim > size_ * 2 || n > static_cast<int64_t>(size_ * 2 / dim)) {
        return bad("tensor '", info.t.name, "': dimension ", dim, " is larger than the file allows");
      }
      n *= static_cast<int64_t>(dim);
      info.t.ne.push_back(static_cast<int64_t>(dim));
    }
    if (!c.Read(&type) || !c.Read(&info.offset)) return bad("tensor '", info.t.name, "': truncated");
    info.t.type = static_cast<GgmlType>(type);
    const std::optional<int64_t> bytes = GgmlBytes(info.t.type, n);
    if (!bytes) {
      if (GgmlBlockElements(info.t.type) == 0) {
        return absl::UnimplementedError(absl::StrCat(
            path_.string(), ": tensor '", info.t.name, "' has ggml type ", type,
            "; kvgrid reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, "
            "Q4_K, Q5_K and Q6_K"));
      }
      return bad("tensor '", info.t.name, "': ", n, " elements are not whole blocks of ",
                 GgmlBlockElements(info.t.type), " (", GgmlTypeName(info.t.type), ")");
    }
    if (info.offset % static_cast<uint64_t>(alignment) != 0) {
      return bad("tensor '", info.t.name, "': offset ", info.offset, " is not aligned to ", alignment);
    }
    info.bytes = *bytes;
    infos.push_back(std::move(info));
  }
  // The data section starts at the next multiple of the alignment.
  const size_t header_end = c.offset();
  const size_t data_start =
      (header_end + static_cast<size_t>(alignment) - 1) / static_cast<size_t>(alignment) *
      static_cast<size_t>(alignment);
  // A file without tensors (a vocabulary-only GGUF) may end before the padding.
  if (data_start > size_ && !infos.empty()) {
    return bad("the data section starts past the end of the file");
  }
  const uint64_t data_size = data_start > size_ ? 0 : size_ - data_start;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (Info& info : infos) {
    if (info.offset > data_size || static_cast<uint64_t>(info.bytes) > data_size - info.offset) {
      return bad("tensor '", info.t.name, "': ", info.bytes, " bytes at offset ", info.offset,
                 " run past the end of the file (data section of ", data_size, " bytes)");
    }
    info.t.data = std::span<const std::byte>(
        static_cast<const std::byte*>(map_) + data_start + info.offset,
        static_cast<size_t>(info.bytes));
    ranges.emplace_back(info.offset, info.offset + static_cast<uint64_t>(info.bytes));
    const std::string name = info.t.name;
    if (!tensors_.emplace(name, std::move(info.t)).second) {
      return bad("tensor '", name, "' appears twice");
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return bad("tensor data overlaps");
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<int64_t>(&it->second)) return *v;
  return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": metadata '", key, "' is not an integer"));
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<double>(&it->second)) return *v;
  if (const auto* v = std::get_if<int64_t>(&it->second)) return static_cast<double>(*v);
  return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": metadata '", key, "' is not a number"));
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<std::string>(&it->second)) return *v;
  return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": metadata '", key, "' is not a string"));
}

absl::StatusOr<bool> GgufFile::GetBool(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<bool>(&it->second)) return *v;
  return absl::InvalidArgumentError(absl::StrCat(path_.string(), ": metadata '", key, "' is not a bool"));
}

absl::StatusOr<const GgufStringArray*> GgufFile::GetStringArray(
    const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<GgufStringArray>(&it->second)) return v;
  return absl::InvalidArgumentError(
      absl::StrCat(path_.string(), ": metadata '", key, "' is not an array of strings"));
}

absl::StatusOr<const GgufNumberArray*> GgufFile::GetIntArray(const std::string& key) const {
  KVGRID_ASSIGN_OR_RETURN(const GgufNumberArray* v, GetNumberArray(key));
  if (!v->is_float()) return v;
  return absl::InvalidArgumentError(
      absl::StrCat(path_.string(), ": metadata '", key, "' is not an array of integers"));
}

absl::StatusOr<const GgufNumberArray*> GgufFile::GetNumberArray(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return absl::NotFoundError(absl::StrCat(path_.string(), ": no metadata '", key, "'"));
  if (const auto* v = std::get_if<GgufNumberArray>(&it->second)) return v;
  return absl::InvalidArgumentError(
      absl::StrCat(path_.string(), ": metadata '", key, "' is not an array of numbers"));
}

absl::StatusOr<const GgufTensor*> GgufFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_.string(), ": no tensor '", name, "'"));
  }
  return &it->second;
}

}  // namespace kvgrid::model
