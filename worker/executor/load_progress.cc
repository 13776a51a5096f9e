#include "worker/executor/load_progress.h"

#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <memory>


namespace kvgrid::worker {

LoadTally::LoadTally(const std::vector<Tensor>& tensors, std::string_view layer_prefix,
                     int64_t num_layers)
    : layers_(static_cast<size_t>(num_layers > 0 ? num_layers : 0)) {
  for (const Tensor& t : tensors) {
    Count* into = &outside_;
    std::string_view name = t.name;
    if (name.substr(0, layer_prefix.size()) == layer_prefix) {
      std::string_view rest = name.substr(layer_prefix.size());
      const size_t dot = rest.find('.');
      int64_t layer = -1;
      const char* end = rest.data() + (dot == std::string_view::npos ? 0 : dot);
      const auto [ptr, ec] = std::from_chars(rest.data(), end, layer);
      if (dot != std::string_view::npos && dot > 0 && ec == std::errc() && ptr == end &&
          layer >= 0 && layer < num_layers) {
        into = &layers_[static_cast<size_t>(layer)];
      }
    }
    into->tensors += 1;
    into->bytes += t.bytes;
    total_.tensors += 1;
    total_.bytes += t.bytes;
  }
}

LoadProgress LoadTally::After(int64_t layers_done) const {
  LoadProgress p;
  p.layers_total = static_cast<int64_t>(layers_.size());
  p.layers_done = layers_done < 0 ? 0 : (layers_done > p.layers_total ? p.layers_total : layers_done);
  p.tensors_done = outside_.tensors;
  p.bytes_done = outside_.bytes;
  for (int64_t i = 0; i < p.layers_done; ++i) {
    p.tensors_done += layers_[static_cast<size_t>(i)].tensors;
    p.bytes_done += layers_[static_cast<size_t>(i)].bytes;
  }
  p.tensors_total = total_.tensors;
  p.bytes_total = total_.bytes;
  return p;
}

LoadProgressFn TerminalLoadProgress(std::string prefix) {
  if (isatty(STDERR_FILENO) != 1) return {};
  using Clock = std::chrono::steady_clock;
  auto last = std::make_shared<Clock::time_point>();
  return [prefix = std::move(prefix), last](const LoadProgress& p) {
    const bool done = p.layers_done == p.layers_total;
    const Clock::time_point now = Clock::now();
    if (!done && *last != Clock::time_point() && now - *last < std::chrono::milliseconds(200)) {
      return;
    }
    *last = now;
    const bool gb = p.bytes_total >= 1000000000;
    const double unit = gb ? 1e9 : 1e6;
    std::fprintf(stderr, "\r%s: loading weights: layer %lld/%lld, %lld/%lld tensors, %.2f/%.2f %s%s",
                 prefix.c_str(), static_cast<long long>(p.layers_done),
                 static_cast<long long>(p.layers_total), static_cast<long long>(p.tensors_done),
                 static_cast<long long>(p.tensors_total), static_cast<double>(p.bytes_done) / unit,
                 static_cast<double>(p.bytes_total) / unit, gb ? "GB" : "MB", done ? "\n" : "");
    std::fflush(stderr);
  };
}

}  // namespace kvgrid::worker
