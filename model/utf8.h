// UTF-8 validity, as JSON and protobuf's proto3 strings define it.
#ifndef KVGRID_MODEL_UTF8_H_
#define KVGRID_MODEL_UTF8_H_

#include <string_view>

namespace kvgrid::model {

// True when `s` is well-formed UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF,
// no truncated sequence. Thread-safe.
bool IsValidUtf8(std::string_view s);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_UTF8_H_
