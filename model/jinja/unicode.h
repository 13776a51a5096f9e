// Code-point helpers for the Jinja interpreter, whose strings Python counts, slices, strips and
// changes the case of by code point, while kvgrid keeps them as UTF-8 (the tokenizer encodes
// with AppendUtf8 too).
#ifndef KVGRID_MODEL_JINJA_UNICODE_H_
#define KVGRID_MODEL_JINJA_UNICODE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvgrid::model::jinja {

// Code points of UTF-8 text; an ill-formed byte becomes U+FFFD.
std::u32string DecodeUtf8(std::string_view s);
void AppendUtf8(char32_t c, std::string* out);
std::string EncodeUtf8(std::u32string_view s);
// Number of code points.
int64_t CodePointCount(std::string_view s);
inline bool IsAscii(std::string_view s) {
  for (unsigned char c : s) {
    if (c >= 0x80) return false;
  }
  return true;
}

// str.isspace() for one code point.
bool IsPySpace(char32_t c);
// str.isprintable() for one code point (repr escapes the others).
bool IsPyPrintable(char32_t c);
bool IsPyAlpha(char32_t c);
bool IsPyDigit(char32_t c);  // str.isdigit
bool IsPyDecimal(char32_t c);
bool IsPyAlnum(char32_t c);
bool IsPyLower(char32_t c);
bool IsPyUpper(char32_t c);
bool IsPyCased(char32_t c);
bool IsPyTitle(char32_t c);  // a titlecase letter (Lt), as ǅ
// Full case mappings (ß -> SS), as str.upper() / lower() / title() do.
std::string PyUpper(std::string_view s);
std::string PyLower(std::string_view s);
std::string PyCaseFold(std::string_view s);  // str.casefold()
std::string PyTitleCase(char32_t c);  // the title-case mapping of one code point
std::string PyLowerCase(char32_t c);
// Whether `c` ends a line for str.splitlines().
bool IsLineBreak(char32_t c);

}  // namespace kvgrid::model::jinja

#endif  // KVGRID_MODEL_JINJA_UNICODE_H_
