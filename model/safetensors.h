// Read-only access to safetensors checkpoints: one file, or a sharded set described by
// model.safetensors.index.json. Files are memory-mapped; tensors are views into the maps.
//
// Every length and offset is validated with overflow-safe arithmetic before any byte of
// tensor data is touched: header length <= 100 MB and inside the file, the header is a JSON
// object of {name: {dtype, shape, data_offsets}}, offsets lie inside the data section,
// element count x dtype size == byte length, and no two tensors overlap.
//
// Thread-safety: immutable after Open; all const methods may be called concurrently.
#ifndef KVGRID_MODEL_SAFETENSORS_H_
#define KVGRID_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/dtype.h"

namespace kvgrid::model {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull * 1000 * 1000;

// A tensor inside a mapped file. `data` stays valid while the owning reader lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
  std::filesystem::path file;  // for error messages

  int64_t NumElements() const;
};

// One memory-mapped .safetensors file (MAP_PRIVATE, read-only), unmapped by the destructor.
// Non-copyable and not movable: TensorViews point into the map, so it is held by unique_ptr.
// Truncating the file while it is mapped is undefined (SIGBUS on access), as for any mmap.
class SafetensorsFile {
 public:
  // Errors: NOT_FOUND (missing file), INVALID_ARGUMENT naming the file and the field or tensor
  // for every malformed header (see the file comment), UNIMPLEMENTED for dtypes other than
  // F32/F16/BF16/I8/U8/I32.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // The "__metadata__" string map, if any.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  // Validates the mapped header and fills tensors_ and metadata_.
  absl::Status ParseHeader();

  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards listed in
// model.safetensors.index.json (every shard must exist and hold every tensor the index assigns
// to it; as in transformers, a tensor a shard holds but the index does not list is not
// exposed). Non-copyable.
class Checkpoint {
 public:
  // `path` is a directory (model.safetensors.index.json is preferred over model.safetensors),
  // a .safetensors file, or an index .json file. Shard names in the index are resolved
  // relative to the index's directory and may not leave it.
  // Errors: NOT_FOUND when no checkpoint is there; INVALID_ARGUMENT naming the file and field
  // for malformed files or an index that disagrees with its shards (a missing shard file, a
  // listed tensor the shard lacks); UNIMPLEMENTED as SafetensorsFile::Open.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::filesystem::path& path);

  bool Contains(const std::string& name) const;
  // Errors: NOT_FOUND naming the tensor and the checkpoint.
  absl::StatusOr<const TensorView*> Find(const std::string& name) const;
  std::vector<std::string> Names() const;

  // Converts a F32/F16/BF16 tensor to fp32 into `out` (resized). `expected_shape` is
  // checked when non-empty (so a scalar's shape cannot be checked). Errors: NOT_FOUND,
  // INVALID_ARGUMENT (shape or dtype mismatch, naming the tensor, the expected and the actual
  // shape).
  absl::Status ReadF32(const std::string& name, std::span<const int64_t> expected_shape,
                       std::vector<float>* out) const;

  // A slice [begin, end) of dimension `dim` (0 or 1) of a tensor of at most 2 dimensions, as
  // fp32 in row-major order: rows of a [R, C] tensor for dim 0, columns for dim 1. Only the
  // slice's bytes are read, so a tensor-parallel rank touches only its part of the mapping.
  // `expected_shape` is the full tensor's. Errors: as ReadF32, plus INVALID_ARGUMENT for a
  // slice outside the tensor.
  struct Slice {
    int dim = 0;
    int64_t begin = 0;
    int64_t end = 0;
  };
  absl::Status ReadF32Slice(const std::string& name, std::span<const int64_t> expected_shape,
                            Slice slice, std::vector<float>* out) const;

 private:
  Checkpoint() = default;
  absl::Status LoadIndex(const std::filesystem::path& index_path);
  absl::Status LoadSingle(const std::filesystem::path& file_path);

  std::filesystem::path root_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;  // points into files_' tensor maps
};

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_SAFETENSORS_H_
