// Stop strings over a stream of text deltas. Text that could still be the start of a stop
// string is held back, so a client never sees part of a stop string it did not ask for; when
// a stop string completes, the text before it (and, if asked, the stop string) is released
// and the stream ends. Not thread-safe; one per sequence; copyable (forks copy it).
#ifndef KVGRID_WORKER_ENGINE_STOP_STRINGS_H_
#define KVGRID_WORKER_ENGINE_STOP_STRINGS_H_

#include <string>
#include <string_view>
#include <vector>

namespace kvgrid::worker {

class StopStringMatcher {
 public:
  // `stops` must be non-empty strings (checked by the engine at AddRequest).
  StopStringMatcher(std::vector<std::string> stops, bool include_stop);

  struct Result {
    std::string emit;      // text safe to show now
    bool stopped = false;  // a stop string completed; nothing after it is emitted
  };
  // Adds `delta` to the stream. After a stop, further calls emit nothing. With `can_stop`
  // false (tokens inside min_tokens) the text is held back and released as usual but stops
  // nothing; a stop string that starts there and completes in a later delta pushed with
  // `can_stop` does stop (one that completed while it could not stop does not).
  Result Push(std::string_view delta, bool can_stop = true);
  // The held-back text, for when the stream ends for another reason.
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  bool include_stop_;
  bool stopped_ = false;
  std::string pending_;
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_ENGINE_STOP_STRINGS_H_
