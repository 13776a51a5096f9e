// Progress of loading a model's weights, reported layer by layer, and a reporter that shows it
// on a terminal.
//
// A large checkpoint takes minutes to read; without a sign of life a user cannot tell a slow
// disk from a hang. LlamaModel::Load and LoadGguf call the callback once the tensors outside
// the layers are read, then after each layer.
#ifndef KVGRID_WORKER_EXECUTOR_LOAD_PROGRESS_H_
#define KVGRID_WORKER_EXECUTOR_LOAD_PROGRESS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace kvgrid::worker {

struct LoadProgress {
  int64_t layers_done = 0;
  int64_t layers_total = 0;
  int64_t tensors_done = 0;  // the file's tensors read so far (of tensors_total)
  int64_t tensors_total = 0;
  int64_t bytes_done = 0;  // bytes of those tensors as stored in the file (of bytes_total)
  int64_t bytes_total = 0;
};

// Called on the loading thread; may be empty.
using LoadProgressFn = std::function<void(const LoadProgress&)>;

// Tallies a checkpoint's tensors by layer so the loader can say how much is read after each
// layer. A tensor belongs to layer i when its name starts with `layer_prefix` + i + "."
// ("model.layers." for Hugging Face, "blk." for GGUF); the rest count as read before layer 0.
class LoadTally {
 public:
  struct Tensor {
    std::string name;
    int64_t bytes = 0;
  };
  LoadTally(const std::vector<Tensor>& tensors, std::string_view layer_prefix,
            int64_t num_layers);

  // Progress once the tensors outside the layers and layers [0, layers_done) are read.
  [[nodiscard]] LoadProgress After(int64_t layers_done) const;

 private:
  struct Count {
    int64_t tensors = 0;
    int64_t bytes = 0;
  };
  Count outside_;
  std::vector<Count> layers_;
  Count total_;
};

// A reporter that rewrites one line on stderr ("<prefix>: loading weights: layer 12/32, 310/579
// tensors, 4.1/15.0 GB", MB below a GB), at most every 200 ms and always for the last layer, ending it with a
// newline; empty when stderr is not a terminal, so logs and tests see nothing.
LoadProgressFn TerminalLoadProgress(std::string prefix);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_EXECUTOR_LOAD_PROGRESS_H_
