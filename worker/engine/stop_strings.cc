#include "worker/engine/stop_strings.h"

#include <algorithm>
#include <utility>

namespace kvgrid::worker {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops, bool include_stop)
    : stops_(std::move(stops)), include_stop_(include_stop) {}

StopStringMatcher::Result StopStringMatcher::Push(std::string_view delta, bool can_stop) {
  Result r;
  if (stopped_) return r;
  std::string buf = pending_;
  const size_t held = buf.size();
  buf.append(delta);
  pending_.clear();
  // The earliest completed stop string wins (the longest among those starting there). Only
  // one completing in `delta` counts: one inside the held text completed while stopping was
  // not allowed (or it would have stopped then).
  size_t best = std::string::npos, best_len = 0;
  for (const std::string& s : stops_) {
    if (!can_stop) break;
    size_t pos = buf.find(s);
    while (pos != std::string::npos && pos + s.size() <= held) pos = buf.find(s, pos + 1);
    if (pos != std::string::npos && (pos < best || (pos == best && s.size() > best_len))) {
      best = pos;
      best_len = s.size();
    }
  }
  if (best != std::string::npos) {
    r.emit = buf.substr(0, include_stop_ ? best + best_len : best);
    r.stopped = stopped_ = true;
    return r;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    for (size_t len = std::min(buf.size(), s.size() - 1); len > hold; --len) {
      if (buf.compare(buf.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  pending_ = buf.substr(buf.size() - hold);
  r.emit = buf.substr(0, buf.size() - hold);
  return r;
}

std::string StopStringMatcher::Flush() {
  if (stopped_) return {};
  return std::exchange(pending_, {});
}

}  // namespace kvgrid::worker
