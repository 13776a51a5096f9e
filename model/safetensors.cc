#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/json_util.h"
#include "model/model_dir.h"
#include "nlohmann/json.hpp"

// The format stores little-endian data and ReadF32 copies it as is.
static_assert(std::endian::native == std::endian::little,
              "safetensors reader assumes little-endian");

namespace kvgrid::model {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kHeaderLengthBytes = 8;
// Index files list a few thousand names; the cap only guards against a wrong path.
constexpr std::uintmax_t kMaxIndexBytes = 64ull << 20;

template <typename... Parts>
absl::Status Invalid(const fs::path& file, const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(file.string(), ": ", parts...));
}


std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::optional<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "I8") return DType::kI8;
  if (name == "U8") return DType::kU8;
  if (name == "I32") return DType::kI32;
  return std::nullopt;
}

// A JSON integer >= 0. Floats (even 2.0) are rejected: the format writes integers.
std::optional<uint64_t> AsCount(const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
  }
  return std::nullopt;
}

// fp16 -> fp32 by table: 256 KiB that stays in L2, and a load per element beats the branchy
// scalar conversion on the checkpoint load path without needing F16C.
const std::array<float, 65536>& F16Table() {
  static const std::array<float, 65536>* const table = [] {
    auto* t = new std::array<float, 65536>;
    for (uint32_t h = 0; h < 65536; ++h) (*t)[h] = F16ToF32(static_cast<uint16_t>(h));
    return t;
  }();
  return *table;
}

// A shard name from an index must stay inside the checkpoint directory: the index is data,
// and should not be able to point the server at arbitrary files.
bool IsPlainRelativePath(const std::string& name) {
  if (name.empty()) return false;
  const fs::path p(name);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) return false;
  for (const fs::path& part : p) {
    if (part == "..") return false;
  }
  return true;
}

}  // namespace

int64_t TensorView::NumElements() const {
  // Open checked that this product does not overflow.
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path.string()));
  // The mapping outlives the descriptor, so it is closed on every path out of here.
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};

  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot stat ", path.string()));
  }
  if (!S_ISREG(st.st_mode)) return Invalid(path, "not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  // Also rules out mmap of 0 bytes, which fails with EINVAL.
  if (file_size < kHeaderLengthBytes) {
    return Invalid(path, "file too small for the 8-byte header (", file_size, " bytes)");
  }
  if (file_size > std::numeric_limits<size_t>::max()) {
    return Invalid(path, "file of ", file_size, " bytes cannot be mapped");
  }

  void* map = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot mmap ", path.string()));
  }
  auto file = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  file->path_ = path;
  file->map_ = map;
  file->map_size_ = file_size;
  if (absl::Status s = file->ParseHeader(); !s.ok()) return s;
  return file;
}

absl::Status SafetensorsFile::ParseHeader() {
  const auto* bytes = static_cast<const unsigned char*>(map_);
  uint64_t header_len = 0;
  for (uint64_t i = 0; i < kHeaderLengthBytes; ++i) header_len |= uint64_t{bytes[i]} << (8 * i);

  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Invalid(path_, "header length ", header_len, " exceeds the limit of ",
                   kMaxSafetensorsHeaderBytes, " bytes");
  }
  const uint64_t after_length = map_size_ - kHeaderLengthBytes;  // map_size_ >= 8
  if (header_len > after_length) {
    return Invalid(path_, "header length ", header_len, " runs past the end of the file (",
                   map_size_, " bytes)");
  }
  const uint64_t data_begin = kHeaderLengthBytes + header_len;  // <= map_size_, no overflow
  const uint64_t data_size = map_size_ - data_begin;

  const char* header_text = reinterpret_cast<const char*>(bytes + kHeaderLengthBytes);
  if (absl::Status s = CheckJsonDepth(std::string_view(header_text, header_len),
                                     path_.string() + " (header)");
      !s.ok()) {
    return s;
  }
  Json header;
  try {
    header = Json::parse(header_text, header_text + header_len);
  } catch (const Json::exception& e) {
    return Invalid(path_, "header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) {
    return Invalid(path_, "header is not a JSON object (got ", header.type_name(), ")");
  }

  struct Range {
    uint64_t begin;
    uint64_t end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  ranges.reserve(header.size());

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_null()) continue;
      if (!entry.is_object()) {
        return Invalid(path_, "__metadata__: expected an object of strings, got ", DescribeJson(entry));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return Invalid(path_, "__metadata__: value of \"", key, "\" is not a string (got ",
                         DescribeJson(value), ")");
        }
        metadata_.emplace(key, value.get<std::string>());
      }
      continue;
    }

    const std::string where = absl::StrCat("tensor '", name, "'");
    if (!entry.is_object()) {
      return Invalid(path_, where, ": expected an object, got ", DescribeJson(entry));
    }

    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end()) return Invalid(path_, where, ": dtype: missing");
    if (!dtype_it->is_string()) {
      return Invalid(path_, where, ": dtype: expected a string, got ", DescribeJson(*dtype_it));
    }
    const std::string dtype_name = dtype_it->get<std::string>();
    const std::optional<DType> dtype = ParseDType(dtype_name);
    if (!dtype.has_value()) {
      return absl::UnimplementedError(
          absl::StrCat(path_.string(), ": ", where, ": dtype \"", dtype_name,
                       "\" is not supported (supported: F32, F16, BF16, I8, U8, I32)"));
    }

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end()) return Invalid(path_, where, ": shape: missing");
    if (!shape_it->is_array()) {
      return Invalid(path_, where, ": shape: expected a list of integers, got ",
                     DescribeJson(*shape_it));
    }
    std::vector<int64_t> shape;
    shape.reserve(shape_it->size());
    uint64_t num_elements = 1;
    for (const Json& dim_json : *shape_it) {
      const std::optional<uint64_t> dim = AsCount(dim_json);
      if (!dim.has_value()) {
        return Invalid(path_, where, ": shape: dimension ", shape.size(), " is ",
                       DescribeJson(dim_json), ", not a non-negative integer");
      }
      if (*dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(num_elements, *dim, &num_elements) ||
          num_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Invalid(path_, where, ": shape: element count of ", shape_it->dump(),
                       " overflows 63 bits");
      }
      shape.push_back(static_cast<int64_t>(*dim));
    }

    const auto offsets_it = entry.find("data_offsets");
    if (offsets_it == entry.end()) return Invalid(path_, where, ": data_offsets: missing");
    std::optional<uint64_t> begin;
    std::optional<uint64_t> end;
    if (offsets_it->is_array() && offsets_it->size() == 2) {
      begin = AsCount((*offsets_it)[0]);
      end = AsCount((*offsets_it)[1]);
    }
    if (!begin.has_value() || !end.has_value()) {
      return Invalid(path_, where,
                     ": data_offsets: expected [begin, end] with non-negative integers, got ",
                     DescribeJson(*offsets_it));
    }
    if (*begin > *end) {
      return Invalid(path_, where, ": data_offsets: begin ", *begin, " is after end ", *end);
    }
    if (*end > data_size) {
      return Invalid(path_, where, ": data_offsets: end ", *end, " is beyond the data section of ",
                     data_size, " bytes");
    }
    uint64_t num_bytes = 0;
    if (__builtin_mul_overflow(num_elements, uint64_t{DTypeSize(*dtype)}, &num_bytes)) {
      return Invalid(path_, where, ": shape: byte size of ", ShapeString(shape), " x ", dtype_name,
                     " overflows 64 bits");
    }
    if (*end - *begin != num_bytes) {
      return Invalid(path_, where, ": data_offsets: [", *begin, ", ", *end, "] holds ",
                     *end - *begin, " bytes, but shape ", ShapeString(shape), " x ", dtype_name,
                     " needs ", num_bytes);
    }

    TensorView view;
    view.name = name;
    view.dtype = *dtype;
    view.shape = std::move(shape);
    view.data = std::span<const std::byte>(
        reinterpret_cast<const std::byte*>(bytes + data_begin + *begin), num_bytes);
    view.file = path_;
    auto [it, inserted] = tensors_.emplace(name, std::move(view));
    // Empty tensors occupy no bytes and cannot overlap anything.
    if (num_bytes > 0) ranges.push_back(Range{*begin, *end, &it->first});
  }

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return Invalid(path_, "data_offsets of tensor '", *ranges[i - 1].name, "' [",
                     ranges[i - 1].begin, ", ", ranges[i - 1].end, ") and tensor '",
                     *ranges[i].name, "' [", ranges[i].begin, ", ", ranges[i].end, ") overlap");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at ", path.string()));
  }
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->root_ = path;
  absl::Status loaded;
  if (fs::is_directory(status)) {
    const fs::path index = path / "model.safetensors.index.json";
    const fs::path single = path / "model.safetensors";
    if (fs::exists(index, ec)) {
      loaded = CheckInsideModelDir(path, index);
      if (loaded.ok()) loaded = checkpoint->LoadIndex(index);
    } else if (fs::exists(single, ec)) {
      loaded = CheckInsideModelDir(path, single);
      if (loaded.ok()) loaded = checkpoint->LoadSingle(single);
    } else {
      return absl::NotFoundError(
          absl::StrCat("no model.safetensors or model.safetensors.index.json in ", path.string()));
    }
  } else if (path.extension() == ".json") {
    loaded = checkpoint->LoadIndex(path);
  } else {
    loaded = checkpoint->LoadSingle(path);
  }
  if (!loaded.ok()) return loaded;
  return checkpoint;
}

absl::Status Checkpoint::LoadSingle(const fs::path& file_path) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(file_path);
  if (!file.ok()) return file.status();
  for (const auto& [name, view] : (*file)->tensors()) index_.emplace(name, &view);
  files_.push_back(*std::move(file));
  return absl::OkStatus();
}

absl::Status Checkpoint::LoadIndex(const fs::path& index_path) {
  absl::StatusOr<std::string> text = ReadSmallFile(index_path, kMaxIndexBytes);
  if (!text.ok()) return text.status();
  absl::StatusOr<Json> parsed = ParseJsonObject(*text, index_path.string());
  if (!parsed.ok()) return parsed.status();
  const Json& index = *parsed;
  const auto map_it = index.find("weight_map");
  if (map_it == index.end()) return Invalid(index_path, "weight_map: missing");
  if (!map_it->is_object()) {
    return Invalid(index_path, "weight_map: expected an object, got ", DescribeJson(*map_it));
  }

  // shard file name -> tensor names the index assigns to it.
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [name, shard] : map_it->items()) {
    if (!shard.is_string()) {
      return Invalid(index_path, "weight_map: tensor '", name,
                     "': expected a shard file name, got ", DescribeJson(shard));
    }
    const std::string shard_name = shard.get<std::string>();
    if (!IsPlainRelativePath(shard_name)) {
      return Invalid(index_path, "weight_map: tensor '", name, "': shard \"", shard_name,
                     "\" must be a relative path inside the checkpoint directory");
    }
    shards[shard_name].push_back(name);
  }

  const fs::path dir = index_path.parent_path();
  for (const auto& [shard_name, names] : shards) {
    const fs::path shard_path = dir / shard_name;
    if (absl::Status inside = CheckInsideModelDir(dir, shard_path); !inside.ok()) {
      return Invalid(index_path, "weight_map: shard \"", shard_name, "\" (holding tensor '",
                     names.front(), "'): ", inside.message());
    }
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(shard_path);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status())) {
        return Invalid(index_path, "weight_map: shard ", shard_path.string(), " (holding tensor '",
                       names.front(), "'",
                       names.size() > 1 ? absl::StrCat(" and ", names.size() - 1, " more") : "",
                       ") is missing: ", file.status().message());
      }
      return file.status();
    }
    const auto& tensors = (*file)->tensors();
    for (const std::string& name : names) {
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        return Invalid(index_path, "weight_map: tensor '", name, "' is assigned to shard ",
                       shard_path.string(), ", which does not contain it");
      }
      index_.emplace(name, &it->second);
    }
    files_.push_back(*std::move(file));
  }
  return absl::OkStatus();
}

bool Checkpoint::Contains(const std::string& name) const { return index_.contains(name); }

absl::StatusOr<const TensorView*> Checkpoint::Find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' not found in checkpoint ", root_.string()));
  }
  return it->second;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, view] : index_) names.push_back(name);
  return names;
}

namespace {

// Converts `count` elements of `dtype` at `src` to fp32 at `dst`.
void ConvertRun(DType dtype, const std::byte* src, size_t count, float* dst) {
  // Tensor data sits at whatever offset the header gave it, so elements are read with memcpy
  // rather than through a possibly misaligned typed pointer.
  switch (dtype) {
    case DType::kF32:
      if (count > 0) std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kF16: {
      const std::array<float, 65536>& table = F16Table();
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, sizeof(h));
        dst[i] = table[h];
      }
      return;
    }
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, sizeof(h));
        dst[i] = BF16ToF32(h);
      }
      return;
    default:
      return;
  }
}

size_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

}  // namespace

absl::Status Checkpoint::ReadF32(const std::string& name, std::span<const int64_t> expected_shape,
                                 std::vector<float>* out) const {
  return ReadF32Slice(name, expected_shape, Slice{.dim = -1}, out);
}

absl::Status Checkpoint::ReadF32Slice(const std::string& name,
                                      std::span<const int64_t> expected_shape, Slice slice,
                                      std::vector<float>* out) const {
  absl::StatusOr<const TensorView*> found = Find(name);
  if (!found.ok()) return found.status();
  const TensorView& view = **found;
  if (!expected_shape.empty() && !std::equal(expected_shape.begin(), expected_shape.end(),
                                             view.shape.begin(), view.shape.end())) {
    return Invalid(view.file, "tensor '", name, "' has shape ", ShapeString(view.shape),
                   ", expected ", ShapeString(expected_shape));
  }
  if (view.dtype != DType::kF32 && view.dtype != DType::kF16 && view.dtype != DType::kBF16) {
    return Invalid(view.file, "tensor '", name, "' has dtype ",
                   std::string(DTypeName(view.dtype)), "; only f32, f16 and bf16 convert to f32");
  }
  const std::byte* src = view.data.data();
  const size_t esize = ElementBytes(view.dtype);
  if (slice.dim < 0) {  // the whole tensor
    const size_t n = static_cast<size_t>(view.NumElements());
    out->resize(n);
    ConvertRun(view.dtype, src, n, out->data());
    return absl::OkStatus();
  }
  const int64_t rank = static_cast<int64_t>(view.shape.size());
  if (rank < 1 || rank > 2 || slice.dim >= rank || slice.begin < 0 ||
      slice.end < slice.begin || slice.end > view.shape[slice.dim]) {
    return Invalid(view.file, "tensor '", name, "' of shape ", ShapeString(view.shape),
                   " has no slice [", slice.begin, ", ", slice.end, ") of dimension ", slice.dim);
  }
  const int64_t rows = view.shape[0];
  const int64_t cols = rank == 2 ? view.shape[1] : 1;
  const int64_t width = slice.end - slice.begin;
  if (slice.dim == 0) {
    out->resize(static_cast<size_t>(width * cols));
    ConvertRun(view.dtype, src + slice.begin * cols * esize, out->size(), out->data());
    return absl::OkStatus();
  }
  out->resize(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    ConvertRun(view.dtype, src + (r * cols + slice.begin) * esize, static_cast<size_t>(width),
               out->data() + r * width);
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::model
