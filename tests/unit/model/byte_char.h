// The byte-level BPE alphabet for tokenizer tests, derived independently of model/tokenizer.cc:
// printable Latin-1 bytes stand for themselves, the rest take U+0100 onwards in byte order.
#ifndef KVGRID_TESTS_UNIT_MODEL_BYTE_CHAR_H_
#define KVGRID_TESTS_UNIT_MODEL_BYTE_CHAR_H_

#include <string>

namespace kvgrid::model::testing {

// The UTF-8 text of the character that stands for byte `b` (0..255).
inline std::string ByteChar(int b) {
  const auto printable = [](int k) {
    return (k >= '!' && k <= '~') || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE;
  };
  int c = b;
  if (!printable(b)) {
    c = 256;
    for (int k = 0; k < b; ++k) {
      if (!printable(k)) ++c;
    }
  }
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else {
    s.push_back(static_cast<char>(0xC0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return s;
}

}  // namespace kvgrid::model::testing

#endif  // KVGRID_TESTS_UNIT_MODEL_BYTE_CHAR_H_
