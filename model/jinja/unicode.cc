#include "model/jinja/unicode.h"

#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

namespace kvgrid::model::jinja {

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    }
    int len = 0;
    char32_t cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const unsigned char cc = s[i + k];
      if ((cc & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
               (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))) {
      ok = false;
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(c, &out);
  return out;
}

int64_t CodePointCount(std::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool IsPySpace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool IsPyPrintable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x80) return c > 0x20 && c < 0x7F;
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

bool IsPyAlpha(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return true;
    default:
      return false;
  }
}

bool IsPyDecimal(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return u_charType(static_cast<UChar32>(c)) == U_DECIMAL_DIGIT_NUMBER;
}

bool IsPyDigit(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const int32_t t = u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE);
  return t == U_NT_DECIMAL || t == U_NT_DIGIT;
}

bool IsPyAlnum(char32_t c) {
  if (IsPyAlpha(c) || IsPyDecimal(c) || IsPyDigit(c)) return true;
  return c >= 0x80 && u_getIntPropertyValue(static_cast<UChar32>(c), UCHAR_NUMERIC_TYPE) ==
                          U_NT_NUMERIC;
}

bool IsPyLower(char32_t c) {
  if (c < 0x80) return c >= 'a' && c <= 'z';
  return u_isULowercase(static_cast<UChar32>(c));
}

bool IsPyUpper(char32_t c) {
  if (c < 0x80) return c >= 'A' && c <= 'Z';
  return u_isUUppercase(static_cast<UChar32>(c));
}

bool IsPyTitle(char32_t c) {
  return c >= 0x80 && u_charType(static_cast<UChar32>(c)) == U_TITLECASE_LETTER;
}

bool IsPyCased(char32_t c) {
  if (c < 0x80) return IsPyLower(c) || IsPyUpper(c);
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_UPPERCASE_LETTER || t == U_LOWERCASE_LETTER || t == U_TITLECASE_LETTER ||
         u_isULowercase(static_cast<UChar32>(c)) || u_isUUppercase(static_cast<UChar32>(c));
}

namespace {

std::string ToUtf8(const icu::UnicodeString& u) {
  std::string out;
  u.toUTF8String(out);
  return out;
}

std::string CaseMap(std::string_view s, bool upper) {
  if (IsAscii(s)) {
    std::string out(s);
    for (char& c : out) {
      if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
      if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    }
    return out;
  }
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(),
                                                                       static_cast<int32_t>(s.size())));
  if (upper) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  return ToUtf8(u);
}

}  // namespace

std::string PyUpper(std::string_view s) { return CaseMap(s, true); }

std::string PyCaseFold(std::string_view s) {
  icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  u.foldCase();
  return ToUtf8(u);
}
std::string PyLower(std::string_view s) { return CaseMap(s, false); }

std::string PyTitleCase(char32_t c) {
  std::string out;
  if (c < 0x80) {
    AppendUtf8(c >= 'a' && c <= 'z' ? c - 32 : c, &out);
    return out;
  }
  icu::UnicodeString u(static_cast<UChar32>(c));
  // Title-casing a one-character string maps that character with its full title mapping.
  u.toTitle(nullptr, icu::Locale::getRoot(), U_TITLECASE_NO_LOWERCASE | U_TITLECASE_NO_BREAK_ADJUSTMENT);
  return ToUtf8(u);
}

std::string PyLowerCase(char32_t c) {
  std::string s;
  AppendUtf8(c, &s);
  return PyLower(s);
}

bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
         c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
}

}  // namespace kvgrid::model::jinja
