// jinja2's filters, tests and globals, Python's str/list/dict methods, %-formatting and
// transformers' tojson, with the behaviour the reference implementations have (including
// for undefined values, which most filters treat as empty and a few refuse).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "model/jinja/interp.h"
#include "model/jinja/unicode.h"

namespace kvgrid::model::jinja {
namespace {

constexpr int64_t kMaxRange = 100000;  // jinja2.sandbox.MAX_RANGE

[[noreturn]] void TypeError(Interp& in, std::string m) { in.Fail("TypeError: " + m); }
std::string Q(std::string_view s) { return absl::StrCat("'", absl::string_view(s.data(), s.size()), "'"); }

bool IsIntLike(const Value& v) { return v.is_int() || v.is_bool(); }

Value Arg(CallArgs& a, size_t i, std::string_view name, const Value& dflt) {
  const Value* v = a.Get(i, name);
  return v != nullptr ? *v : dflt;
}

int64_t IntArg(Interp& in, CallArgs& a, size_t i, const char* name, int64_t dflt) {
  const Value* v = a.Get(i, name);
  if (v == nullptr || v->is_none()) return dflt;
  if (v->is_undefined()) in.FailUndefined(*v);
  if (!IsIntLike(*v)) TypeError(in, absl::StrCat(name, " must be an integer, not ", v->TypeName()));
  return v->as_int();
}

bool BoolArg(CallArgs& a, size_t i, std::string_view name, bool dflt) {
  const Value* v = a.Get(i, name);
  return v != nullptr ? v->Truthy() : dflt;
}

const std::string& StrArg(Interp& in, CallArgs& a, size_t i, const char* name,
                          const std::string& dflt) {
  const Value* v = a.Get(i, name);
  if (v == nullptr) return dflt;
  if (!v->is_string()) TypeError(in, absl::StrCat(name, " must be str, not ", v->TypeName()));
  return v->as_string();
}

const Value kNone = Value::None();

// What jinja2's generator filters return.
Value Gen(List items) { return Value::Iterator(IteratorState::Type::kGenerator, std::move(items)); }
bool SinglePass(const Value& v) {
  return v.is_iterator() && (v.as_iterator().type == IteratorState::Type::kGenerator ||
                             v.as_iterator().type == IteratorState::Type::kReverseIterator);
}
const std::string kEmpty;

// ---------------------------------------------------------------------------------------------
// Strings

bool IsAsciiSpace(char c) { return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F); }

// str.strip/lstrip/rstrip; `chars` null: whitespace.
std::string Strip(const std::string& s, const std::string* chars, bool left, bool right) {
  if (chars == nullptr && IsAscii(s)) {
    size_t b = 0, e = s.size();
    if (left) while (b < e && IsAsciiSpace(s[b])) ++b;
    if (right) while (e > b && IsAsciiSpace(s[e - 1])) --e;
    return s.substr(b, e - b);
  }
  if (chars != nullptr && IsAscii(*chars)) {
    // ASCII bytes never occur inside a multi-byte UTF-8 character, so bytes will do.
    size_t b = 0, e = s.size();
    if (left) while (b < e && chars->find(s[b]) != std::string::npos) ++b;
    if (right) while (e > b && chars->find(s[e - 1]) != std::string::npos) --e;
    return s.substr(b, e - b);
  }
  const std::u32string cps = DecodeUtf8(s);
  const std::u32string set = chars != nullptr ? DecodeUtf8(*chars) : std::u32string();
  const auto strip_it = [&](char32_t c) {
    return chars == nullptr ? IsPySpace(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strip_it(cps[b])) ++b;
  if (right) while (e > b && strip_it(cps[e - 1])) --e;
  return EncodeUtf8(std::u32string_view(cps).substr(b, e - b));
}

std::string Replace(Interp& in, const std::string& s, const std::string& old, const std::string& repl,
                    int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` between every character (and at both ends).
    const std::u32string cps = DecodeUtf8(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < cps.size()) AppendUtf8(cps[i], &out);
      in.CheckSize(out.size());
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += repl;
    pos = f + old.size();
    ++n;
    in.CheckSize(out.size());
  }
  out.append(s, pos, std::string::npos);
  in.CheckSize(out.size());
  return out;
}

List Split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  List out;
  if (sep.is_none() || sep.is_undefined()) {
    // Runs of whitespace separate; none are empty.
    const std::u32string cps = DecodeUtf8(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && IsPySpace(cps[i])) ++i;
      if (i >= cps.size()) break;
      size_t j = i;
      while (j < cps.size() && !IsPySpace(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit) {
      // Merge the words beyond maxsplit into one, keeping the original text between them.
      // The remainder runs to the end (or from the start) with its whitespace, as Python.
      if (!from_right) {
        std::vector<std::pair<size_t, size_t>> w(words.begin(), words.begin() + maxsplit);
        w.emplace_back(words[maxsplit].first, cps.size());
        words = w;
      } else {
        const size_t k = words.size() - static_cast<size_t>(maxsplit);
        std::vector<std::pair<size_t, size_t>> w;
        w.emplace_back(0, words[k - 1].second);
        w.insert(w.end(), words.begin() + static_cast<int64_t>(k), words.end());
        words = w;
      }
    }
    for (auto [b, e] : words) out.push_back(Value(EncodeUtf8(std::u32string_view(cps).substr(b, e - b))));
    return out;
  }
  const std::string& d = sep.as_string();
  std::vector<std::string> parts;
  if (!from_right) {
    size_t pos = 0;
    int64_t n = 0;
    while (maxsplit < 0 || n < maxsplit) {
      const size_t f = s.find(d, pos);
      if (f == std::string::npos) break;
      parts.push_back(s.substr(pos, f - pos));
      pos = f + d.size();
      ++n;
    }
    parts.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    int64_t n = 0;
    std::vector<std::string> rev;
    while (maxsplit < 0 || n < maxsplit) {
      if (end < d.size()) break;
      const size_t f = s.rfind(d, end - d.size());
      if (f == std::string::npos) break;
      rev.push_back(s.substr(f + d.size(), end - f - d.size()));
      end = f;
      ++n;
    }
    rev.push_back(s.substr(0, end));
    parts.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : parts) out.push_back(Value(std::move(p)));
  return out;
}

List SplitLines(const std::string& s, bool keepends) {
  List out;
  const std::u32string cps = DecodeUtf8(s);
  size_t start = 0, i = 0;
  while (i < cps.size()) {
    if (IsLineBreak(cps[i])) {
      size_t eol = i + 1;
      if (cps[i] == '\r' && eol < cps.size() && cps[eol] == '\n') ++eol;
      out.push_back(Value(EncodeUtf8(std::u32string_view(cps).substr(start, (keepends ? eol : i) - start))));
      start = i = eol;
    } else {
      ++i;
    }
  }
  if (start < cps.size()) out.push_back(Value(EncodeUtf8(std::u32string_view(cps).substr(start))));
  return out;
}

// str.islower()/isupper(): every cased character in that case, and at least one.
bool PyIsLower(const std::string& s) {
  bool cased = false;
  for (char32_t c : DecodeUtf8(s)) {
    if (IsPyCased(c) && !IsPyLower(c)) return false;
    cased = cased || IsPyCased(c);
  }
  return cased;
}

bool PyIsUpper(const std::string& s) {
  bool cased = false;
  for (char32_t c : DecodeUtf8(s)) {
    if (IsPyCased(c) && !IsPyUpper(c)) return false;
    cased = cased || IsPyCased(c);
  }
  return cased;
}

std::string Capitalize(const std::string& s) {
  const std::u32string cps = DecodeUtf8(s);
  if (cps.empty()) return "";
  std::string out = PyTitleCase(cps[0]);
  out += PyLower(EncodeUtf8(std::u32string_view(cps).substr(1)));
  return out;
}

// str.title(): a cased character after an uncased one starts a word.
std::string StrTitle(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : DecodeUtf8(s)) {
    if (prev_cased) {
      out += PyLowerCase(c);
    } else {
      out += PyTitleCase(c);
    }
    prev_cased = IsPyCased(c);
  }
  return out;
}

// jinja2's title filter: words start after whitespace and - ( { [ <.
std::string FilterTitle(const std::string& s) {
  std::string out;
  bool start = true;
  for (char32_t c : DecodeUtf8(s)) {
    const bool sep = IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      AppendUtf8(c, &out);
      start = true;
    } else if (start) {
      std::string one;
      AppendUtf8(c, &one);
      out += PyUpper(one);
      start = false;
    } else {
      out += PyLowerCase(c);
    }
  }
  return out;
}

int64_t Find(const std::string& s, const std::string& sub, bool reverse) {
  const size_t f = reverse ? s.rfind(sub) : s.find(sub);
  if (f == std::string::npos) return -1;
  return CodePointCount(std::string_view(s).substr(0, f));
}

int64_t CountSub(const std::string& s, const std::string& sub) {
  if (sub.empty()) return CodePointCount(s) + 1;
  int64_t n = 0;
  size_t pos = 0;
  while ((pos = s.find(sub, pos)) != std::string::npos) {
    ++n;
    pos += sub.size();
  }
  return n;
}

bool AllOf(const std::string& s, bool (*pred)(char32_t)) {
  const std::u32string cps = DecodeUtf8(s);
  if (cps.empty()) return false;
  for (char32_t c : cps) {
    if (!pred(c)) return false;
  }
  return true;
}

std::string Pad(Interp& in, const std::string& s, int64_t width, char align, const std::string& fill) {
  const int64_t len = CodePointCount(s);
  if (width <= len) return s;
  in.CheckSize(static_cast<size_t>(width - len) * std::max<size_t>(1, fill.size()) + s.size());
  const int64_t total = width - len;
  int64_t left = 0;
  if (align == '>') left = total;
  if (align == '^') left = total / 2 + (total & width & 1);  // Python's center rounding
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < total - left; ++i) out += fill;
  return out;
}

// textwrap.wrap(line, width, expand_tabs=False, replace_whitespace=False) for one paragraph:
// words and whitespace runs (words also split after a hyphen between letters) are filled
// greedily; whitespace is dropped at the line breaks after the first line.
std::vector<std::u32string> WrapLine(const std::u32string& text, int64_t width, bool break_long,
                                     bool break_on_hyphens) {
  std::vector<std::u32string> chunks;
  size_t i = 0;
  const auto letter = [](char32_t c) { return IsPyAlpha(c); };
  while (i < text.size()) {
    size_t j = i;
    if (IsPySpace(text[i])) {
      while (j < text.size() && IsPySpace(text[j])) ++j;
      chunks.push_back(text.substr(i, j - i));
      i = j;
      continue;
    }
    while (j < text.size() && !IsPySpace(text[j])) {
      const bool split_here = break_on_hyphens && text[j] == '-' && j >= i + 2 && letter(text[j - 1]) &&
                              letter(text[j - 2]) && j + 2 < text.size() + 1 && j + 1 < text.size() &&
                              letter(text[j + 1]) &&
                              (j + 2 < text.size() && (letter(text[j + 2]) ||
                                                       (text[j + 2] == '-' && j + 3 < text.size() && letter(text[j + 3]))));
      ++j;
      if (split_here) break;
    }
    chunks.push_back(text.substr(i, j - i));
    i = j;
  }
  std::vector<std::u32string> lines;
  std::reverse(chunks.begin(), chunks.end());
  const auto blank = [](const std::u32string& c) {
    return std::all_of(c.begin(), c.end(), [](char32_t x) { return IsPySpace(x); });
  };
  while (!chunks.empty()) {
    std::vector<std::u32string> cur;
    int64_t len = 0;
    if (!lines.empty() && blank(chunks.back())) chunks.pop_back();
    while (!chunks.empty()) {
      const int64_t l = static_cast<int64_t>(chunks.back().size());
      if (len + l > width) break;
      cur.push_back(chunks.back());
      chunks.pop_back();
      len += l;
    }
    if (!chunks.empty() && static_cast<int64_t>(chunks.back().size()) > width) {
      if (break_long) {
        const int64_t space_left = std::max<int64_t>(width - len, 1);
        cur.push_back(chunks.back().substr(0, static_cast<size_t>(space_left)));
        chunks.back() = chunks.back().substr(static_cast<size_t>(space_left));
      } else if (cur.empty()) {
        cur.push_back(chunks.back());
        chunks.pop_back();
      }
    }
    if (!cur.empty() && blank(cur.back())) cur.pop_back();
    if (!cur.empty()) {
      std::u32string line;
      for (const auto& c : cur) line += c;
      lines.push_back(std::move(line));
    }
  }
  return lines;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Numbers

// int(value) as jinja2's int filter: strings in `base` (with Python's prefixes and
// underscores), floats truncated; nullopt where Python raises.
std::optional<int64_t> ParseInt(const std::string& raw, int base) {
  std::string s = Strip(raw, nullptr, true, true);
  std::string t;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {
      if (i == 0 || i + 1 >= s.size() || s[i + 1] == '_') return std::nullopt;
      continue;
    }
    t.push_back(s[i]);
  }
  if (t.empty()) return std::nullopt;
  size_t i = 0;
  bool neg = false;
  if (t[0] == '+' || t[0] == '-') {
    neg = t[0] == '-';
    ++i;
  }
  if (i + 1 < t.size() && t[i] == '0') {
    const char p = static_cast<char>(std::tolower(static_cast<unsigned char>(t[i + 1])));
    const int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (pb != 0 && (base == pb || base == 0)) {
      base = pb;
      i += 2;
    }
  }
  if (base == 0) base = 10;
  if (i >= t.size()) return std::nullopt;
  int64_t v = 0;
  for (; i < t.size(); ++i) {
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(t[i])));
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'z' ? c - 'a' + 10 : 99;
    if (d >= base) return std::nullopt;
    if (__builtin_mul_overflow(v, base, &v) || __builtin_add_overflow(v, d, &v)) return std::nullopt;
  }
  return neg ? -v : v;
}

// Whether `raw` is a well-formed integer in `base` that does not fit 64 bits.
bool ParseIntOverflows(const std::string& raw, int base) {
  std::string s = Strip(raw, nullptr, true, true);
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s = s.substr(1);
  if (s.empty() || base != 10) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(s[i]))) continue;
    // An underscore only between two digits, as Python reads them.
    if (s[i] != '_' || i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
        !std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      return false;
    }
  }
  return true;  // ParseInt refused a well-formed digit string: it overflowed
}

std::optional<double> ParseFloat(const std::string& raw) {
  std::string s = Strip(raw, nullptr, true, true);
  std::string t;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '_') {
      t.push_back(s[i]);
      continue;
    }
    // Python's float() takes an underscore only between two digits.
    if (i == 0 || i + 1 >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
        !std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      return std::nullopt;
    }
  }
  if (t.empty()) return std::nullopt;
  std::string lower;
  for (char c : t) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  const std::string_view l = lower[0] == '+' || lower[0] == '-' ? std::string_view(lower).substr(1) : std::string_view(lower);
  const bool neg = lower[0] == '-';
  if (l == "inf" || l == "infinity") return neg ? -INFINITY : INFINITY;
  if (l == "nan") return NAN;
  for (char c : l) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == '+' || c == '-')) return std::nullopt;
  }
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  if (end == nullptr || *end != '\0') return std::nullopt;
  return d;
}

Value RoundValue(Interp& in, const Value& v, int64_t precision, const std::string& method) {
  if (v.is_undefined()) TypeError(in, "type Undefined doesn't define __round__ method");
  if (!v.is_number()) TypeError(in, absl::StrCat("type ", v.TypeName(), " doesn't define __round__ method"));
  const double x = v.as_float();
  if (method == "common") {
    if (IsIntLike(v)) {
      if (precision >= 0) return Value(v.as_int());
      const double p = std::pow(10.0, static_cast<double>(-precision));
      return Value(static_cast<int64_t>(std::nearbyint(x / p) * p));
    }
    if (!std::isfinite(x)) return Value(x);
    // Correctly rounded decimal text, ties to even on the exact binary value, as Python.
    if (precision >= 0 && precision < 300) {
      char buf[512];
      std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), x);
      return Value(std::strtod(buf, nullptr));
    }
    const double p = std::pow(10.0, static_cast<double>(-precision));
    return Value(std::nearbyint(x / p) * p);
  }
  const double p = std::pow(10.0, static_cast<double>(precision));
  // Python's math.ceil/floor return integers, so no negative zero survives.
  if (method == "ceil") return Value(std::ceil(x * p) / p + 0.0);
  if (method == "floor") return Value(std::floor(x * p) / p + 0.0);
  in.Fail("FilterArgumentError: method must be common, ceil or floor");
}

// ---------------------------------------------------------------------------------------------
// JSON

void JsonString(const std::string& s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  if (!ensure_ascii) {
    for (unsigned char c : s) {
      switch (c) {
        case '"': out->append("\\\""); break;
        case '\\': out->append("\\\\"); break;
        case '\n': out->append("\\n"); break;
        case '\r': out->append("\\r"); break;
        case '\t': out->append("\\t"); break;
        case '\b': out->append("\\b"); break;
        case '\f': out->append("\\f"); break;
        default:
          if (c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out->append(buf);
          } else {
            out->push_back(static_cast<char>(c));
          }
      }
    }
  } else {
    for (char32_t c : DecodeUtf8(s)) {
      if (c < 0x80) {
        std::string one(1, static_cast<char>(c));
        std::string tmp;
        JsonString(one, false, &tmp);
        out->append(tmp, 1, tmp.size() - 2);
      } else {
        char buf[16];
        if (c >= 0x10000) {
          const char32_t v = c - 0x10000;
          std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        } else {
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
        }
        out->append(buf);
      }
    }
  }
  out->push_back('"');
}

struct JsonOptions {
  bool ensure_ascii = false;
  bool indent = false;
  std::string indent_str;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

std::string JsonFloat(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return FloatRepr(d);
}

void JsonValue(Interp& in, const Value& v, const JsonOptions& o, int level, std::string* out) {
  if (level > 200) in.Fail("ValueError: Circular reference detected");
  in.CheckSize(out->size());
  const auto newline = [&](int lvl) {
    out->push_back('\n');
    for (int i = 0; i < lvl; ++i) out->append(o.indent_str);
  };
  switch (v.kind()) {
    case Value::Kind::kNone: out->append("null"); return;
    case Value::Kind::kBool: out->append(v.as_bool() ? "true" : "false"); return;
    case Value::Kind::kInt: absl::StrAppend(out, v.as_int()); return;
    case Value::Kind::kFloat: out->append(JsonFloat(v.as_float())); return;
    case Value::Kind::kString: JsonString(v.as_string(), o.ensure_ascii, out); return;
    case Value::Kind::kList: {
      const List& l = v.as_list();
      if (l.empty()) {
        out->append("[]");
        return;
      }
      out->push_back('[');
      if (o.indent) newline(level + 1);
      for (size_t i = 0; i < l.size(); ++i) {
        if (i > 0) {
          out->append(o.item_sep);
          if (o.indent) newline(level + 1);
        }
        JsonValue(in, l[i], o, level + 1, out);
      }
      if (o.indent) newline(level);
      out->push_back(']');
      return;
    }
    case Value::Kind::kDict: {
      const Dict& d = v.as_dict();
      if (d.empty()) {
        out->append("{}");
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      for (const auto& [k, e] : d) {
        std::string key;
        switch (k.kind()) {
          case Value::Kind::kString: key = k.as_string(); break;
          case Value::Kind::kBool: key = k.as_bool() ? "true" : "false"; break;
          case Value::Kind::kInt: key = absl::StrCat(k.as_int()); break;
          case Value::Kind::kFloat: key = JsonFloat(k.as_float()); break;
          case Value::Kind::kNone: key = "null"; break;
          default:
            TypeError(in, absl::StrCat("keys must be str, int, float, bool or None, not ", k.TypeName()));
        }
        items.emplace_back(std::move(key), &e);
      }
      if (o.sort_keys) {
        for (const auto& [k, e] : d) {
          if (!k.is_string()) TypeError(in, "'<' not supported between instances of mixed key types");
        }
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      out->push_back('{');
      if (o.indent) newline(level + 1);
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) {
          out->append(o.item_sep);
          if (o.indent) newline(level + 1);
        }
        JsonString(items[i].first, o.ensure_ascii, out);
        out->append(o.key_sep);
        JsonValue(in, *items[i].second, o, level + 1, out);
      }
      if (o.indent) newline(level);
      out->push_back('}');
      return;
    }
    case Value::Kind::kUndefined:
      TypeError(in, "Object of type Undefined is not JSON serializable");
    default:
      TypeError(in, absl::StrCat("Object of type ", v.TypeName(), " is not JSON serializable"));
  }
}

}  // namespace

std::string EscapeHtml(const std::string& s) { return HtmlEscape(s); }

namespace {

// json.dumps(v, ensure_ascii, indent, separators, sort_keys), as transformers' tojson calls it.
std::string ToJson(Interp& in, const Value& v, bool ensure_ascii, const Value& indent,
                   const Value& separators, bool sort_keys) {
  JsonOptions o;
  o.ensure_ascii = ensure_ascii;
  o.sort_keys = sort_keys;
  if (!indent.is_none() && !indent.is_undefined()) {
    o.indent = true;
    if (indent.is_string()) {
      o.indent_str = indent.as_string();
    } else if (IsIntLike(indent)) {
      o.indent_str = std::string(static_cast<size_t>(std::max<int64_t>(0, indent.as_int())), ' ');
    } else {
      TypeError(in, "indent must be an int or a str");
    }
    o.item_sep = ",";
  }
  if (!separators.is_none() && !separators.is_undefined()) {
    if (!separators.is_list() || separators.as_list().size() != 2 ||
        !separators.as_list()[0].is_string() || !separators.as_list()[1].is_string()) {
      in.Fail("ValueError: separators must be a pair of strings");
    }
    o.item_sep = separators.as_list()[0].as_string();
    o.key_sep = separators.as_list()[1].as_string();
  }
  std::string out;
  JsonValue(in, v, o, 0, &out);
  in.CheckSize(out.size());
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// %-formatting

namespace {

// A run of decimal digits as a number, saturating at 10^15 (past any output limit).
int64_t DigitsValue(const std::string& digits) {
  int64_t v = 0;
  for (char c : digits) v = std::min<int64_t>(v * 10 + (c - '0'), int64_t{1'000'000'000'000'000});
  return v;
}

// printf's output for one value, however long (the caller has bounded its width and
// precision by the output limit).
template <typename T>
std::string Printf(const std::string& spec, T value) {
  const int n = std::snprintf(nullptr, 0, spec.c_str(), value);
  if (n <= 0) return "";
  std::string out(static_cast<size_t>(n) + 1, '\0');
  std::snprintf(out.data(), out.size(), spec.c_str(), value);
  out.resize(static_cast<size_t>(n));
  return out;
}

}  // namespace

std::string PercentFormat(Interp& in, const std::string& fmt, const Value& args) {
  std::vector<Value> positional;
  const Value* mapping = nullptr;
  if (args.is_tuple()) {
    positional = args.as_list();
  } else {
    positional.push_back(args);
    if (args.is_dict()) mapping = &args;
  }
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out.push_back(fmt[i]);
      continue;
    }
    ++i;
    if (i >= fmt.size()) in.Fail("ValueError: incomplete format");
    const Value* arg = nullptr;
    if (fmt[i] == '(') {
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) in.Fail("ValueError: incomplete format key");
      if (mapping == nullptr) TypeError(in, "format requires a mapping");
      const std::string key = fmt.substr(i + 1, close - i - 1);
      arg = mapping->Find(key);
      if (arg == nullptr) in.Fail(absl::StrCat("KeyError: ", Q(key)));
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) flags.push_back(fmt[i++]);
    std::string width, precision;
    while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) width.push_back(fmt[i++]);
    bool has_precision = false;
    if (i < fmt.size() && fmt[i] == '.') {
      has_precision = true;
      ++i;
      while (i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i]))) precision.push_back(fmt[i++]);
    }
    while (i < fmt.size() && (fmt[i] == 'l' || fmt[i] == 'h' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) in.Fail("ValueError: incomplete format");
    const char conv = fmt[i];
    if (conv == '%') {
      out.push_back('%');
      continue;
    }
    if (arg == nullptr) {
      if (next >= positional.size()) TypeError(in, "not enough arguments for format string");
      arg = &positional[next++];
    }
    // Python pads to any width; here one past the output limit fails at once (the piece could
    // not fit), before printf spends time and memory on it. Numbers check their precision too.
    const int64_t w = DigitsValue(width);
    const int64_t prec = DigitsValue(precision);
    in.CheckSize(static_cast<size_t>(w));
    const bool left = flags.find('-') != std::string::npos;
    std::string piece;
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        piece = conv == 's' ? in.Str(*arg) : in.Repr(*arg);
        if (has_precision) {
          const std::u32string cps = DecodeUtf8(piece);
          if (static_cast<size_t>(prec) < cps.size()) piece = EncodeUtf8(std::u32string_view(cps).substr(0, static_cast<size_t>(prec)));
        }
        piece = Pad(in, piece, w, left ? '<' : '>', " ");
        break;
      }
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o':
      case 'c':
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G': {
        if (conv == 'c') {
          if (arg->is_string() && CodePointCount(arg->as_string()) == 1) {
            piece = arg->as_string();
          } else if (IsIntLike(*arg)) {
            AppendUtf8(static_cast<char32_t>(arg->as_int()), &piece);
          } else {
            TypeError(in, "%c requires int or char");
          }
          piece = Pad(in, piece, w, left ? '<' : '>', " ");
          break;
        }
        if (!arg->is_number()) {
          TypeError(in, absl::StrCat("%", std::string(1, conv), " format: a real number is required, not ",
                                     arg->TypeName()));
        }
        in.CheckSize(static_cast<size_t>(prec));
        std::string spec = "%" + flags + width;
        const bool integral = conv == 'd' || conv == 'i' || conv == 'u' || conv == 'x' || conv == 'X' || conv == 'o';
        if (integral) {
          if ((conv == 'x' || conv == 'X' || conv == 'o') && arg->is_float()) {
            TypeError(in, absl::StrCat("%", std::string(1, conv), " format: an integer is required, not float"));
          }
          const double f = arg->as_float();
          if (arg->is_float() && !std::isfinite(f)) in.Fail("OverflowError: cannot convert float infinity to integer");
          const long long v = arg->is_float() ? static_cast<long long>(std::trunc(f)) : arg->as_int();
          if (has_precision) spec += "." + precision;
          spec += "ll";
          spec.push_back(conv == 'i' || conv == 'u' ? 'd' : conv);
          if ((conv == 'x' || conv == 'X' || conv == 'o') && v < 0) {
            // Python prints the sign and the magnitude, C the two's complement.
            std::string f2 = "%" + flags;
            f2.erase(std::remove(f2.begin(), f2.end(), '-'), f2.end());
            f2.erase(std::remove(f2.begin(), f2.end(), '0'), f2.end());
            std::string digits = Printf(f2 + (has_precision ? "." + precision : "") + "ll" + std::string(1, conv), -v);
            if (conv != 'o' && flags.find('#') != std::string::npos) {}
            piece = "-" + digits;
            if (flags.find('0') != std::string::npos && !left && static_cast<int64_t>(piece.size()) < w) {
              piece = "-" + std::string(static_cast<size_t>(w) - piece.size(), '0') + digits;
            }
            piece = Pad(in, piece, w, left ? '<' : '>', " ");
            break;
          }
          if (conv == 'o' && flags.find('#') != std::string::npos) {
            // Python's alternate octal form is 0o17, C's is 017.
            std::string f2 = flags;
            f2.erase(std::remove(f2.begin(), f2.end(), '#'), f2.end());
            piece = (v < 0 ? "-0o" : "0o") + Printf("%" + f2 + "llo", v < 0 ? -v : v);
            piece = Pad(in, piece, w, left ? '<' : '>', " ");
            break;
          }
          piece = Printf(spec, v);
        } else {
          spec += "." + (has_precision ? precision : std::string("6"));
          spec.push_back(conv);
          piece = Printf(spec, arg->as_float());
        }
        break;
      }
      default:
        in.Fail(absl::StrCat("ValueError: unsupported format character ", Q(std::string(1, conv))));
    }
    out += piece;
    in.CheckSize(out.size());
  }
  if (mapping == nullptr && next < positional.size()) {
    TypeError(in, "not all arguments converted during string formatting");
  }
  return out;
}

namespace {

// str.format with auto and explicit fields, attribute/index access and the common format spec.
std::string FormatSpec(Interp& in, const Value& v, const std::string& spec) {
  // [[fill]align][sign][#][0][width][,][.precision][type]
  size_t i = 0;
  std::string fill = " ";
  char align = '\0';
  const std::u32string cps = DecodeUtf8(spec);
  std::string rest;
  if (cps.size() >= 2 && (cps[1] == '<' || cps[1] == '>' || cps[1] == '^' || cps[1] == '=')) {
    fill.clear();
    AppendUtf8(cps[0], &fill);
    align = static_cast<char>(cps[1]);
    rest = EncodeUtf8(std::u32string_view(cps).substr(2));
  } else if (!cps.empty() && (cps[0] == '<' || cps[0] == '>' || cps[0] == '^' || cps[0] == '=')) {
    align = static_cast<char>(cps[0]);
    rest = EncodeUtf8(std::u32string_view(cps).substr(1));
  } else {
    rest = spec;
  }
  std::string sign;
  if (i < rest.size() && (rest[i] == '+' || rest[i] == '-' || rest[i] == ' ')) sign = rest[i++];
  if (i < rest.size() && rest[i] == '#') ++i;  // the alternate form changes nothing here
  if (i < rest.size() && rest[i] == '0') {
    if (align == '\0') {
      fill = "0";
      align = '=';
    }
    ++i;
  }
  std::string width;
  while (i < rest.size() && std::isdigit(static_cast<unsigned char>(rest[i]))) width.push_back(rest[i++]);
  bool comma = false;
  if (i < rest.size() && (rest[i] == ',' || rest[i] == '_')) {
    comma = true;
    ++i;
  }
  std::string precision;
  bool has_precision = false;
  if (i < rest.size() && rest[i] == '.') {
    has_precision = true;
    ++i;
    while (i < rest.size() && std::isdigit(static_cast<unsigned char>(rest[i]))) precision.push_back(rest[i++]);
  }
  char type = '\0';
  if (i < rest.size()) type = rest[i++];
  if (i != rest.size()) in.Fail("ValueError: Invalid format specifier");
  if (v.is_undefined()) TypeError(in, "unsupported format string passed to Undefined.__format__");
  const char group = comma ? rest[rest.find_first_of(",_")] : '\0';
  std::string body;
  if (v.is_string() || type == 's') {
    if (!v.is_string()) in.Fail("ValueError: Unknown format code 's' for object of type " + std::string(v.TypeName()));
    body = v.as_string();
    if (has_precision) {
      const std::u32string c = DecodeUtf8(body);
      const size_t p = static_cast<size_t>(std::atoi(precision.c_str()));
      if (p < c.size()) body = EncodeUtf8(std::u32string_view(c).substr(0, p));
    }
    if (align == '\0') align = '<';
  } else if (v.is_number()) {
    char buf[512];
    if (type == '\0' && !has_precision) {
      body = v.is_bool() ? absl::StrCat(v.as_int()) : in.Str(v);
      if (v.is_bool() && spec.empty()) body = in.Str(v);
    } else if (type == 'd') {
      if (v.is_float()) in.Fail("ValueError: Unknown format code 'd' for object of type 'float'");
      body = absl::StrCat(v.as_int());
    } else if (type == 'x' || type == 'X' || type == 'o' || type == 'b') {
      if (v.is_float()) in.Fail("ValueError: Unknown format code for object of type 'float'");
      const int64_t x = v.as_int();
      uint64_t ux = static_cast<uint64_t>(x < 0 ? -x : x);
      std::string digits;
      const int base = type == 'o' ? 8 : type == 'b' ? 2 : 16;
      do {
        const int d = static_cast<int>(ux % base);
        digits.push_back(static_cast<char>(d < 10 ? '0' + d : (type == 'X' ? 'A' : 'a') + d - 10));
        ux /= base;
      } while (ux > 0);
      std::reverse(digits.begin(), digits.end());
      body = (x < 0 ? "-" : "") + digits;
    } else {
      const char t = type == '\0' ? 'g' : type;
      if (std::string_view("eEfFgG%").find(t) == std::string_view::npos) {
        in.Fail(absl::StrCat("ValueError: Unknown format code ", Q(std::string(1, t))));
      }
      const int p = has_precision ? std::atoi(precision.c_str()) : 6;
      if (t == '%') {
        std::snprintf(buf, sizeof buf, "%.*f%%", p, v.as_float() * 100);
      } else {
        const std::string f = absl::StrCat("%.", p, std::string(1, t));
        std::snprintf(buf, sizeof buf, f.c_str(), v.as_float());
      }
      body = buf;
    }
    if (group != '\0' && type != 'x' && type != 'X' && type != 'o' && type != 'b') {
      // Thousands separators in the integer part.
      size_t start = !body.empty() && body[0] == '-' ? 1 : 0;
      size_t end = start;
      while (end < body.size() && std::isdigit(static_cast<unsigned char>(body[end]))) ++end;
      std::string grouped;
      for (size_t k = start; k < end; ++k) {
        if (k > start && (end - k) % 3 == 0) grouped.push_back(group);
        grouped.push_back(body[k]);
      }
      body = body.substr(0, start) + grouped + body.substr(end);
    }
    if (sign == "+" && !body.empty() && body[0] != '-') body = "+" + body;
    if (sign == " " && !body.empty() && body[0] != '-') body = " " + body;
    if (align == '\0') align = '>';
  } else {
    body = in.Str(v);
    if (align == '\0') align = '<';
  }
  const int64_t w = width.empty() ? 0 : std::atoll(width.c_str());
  if (align == '=') {
    const int64_t len = CodePointCount(body);
    if (w > len) {
      size_t signlen = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
      std::string pad;
      for (int64_t k = 0; k < w - len; ++k) pad += fill;
      body = body.substr(0, signlen) + pad + body.substr(signlen);
    }
    return body;
  }
  return Pad(in, body, w, align, fill);
}

std::string StrFormat(Interp& in, const std::string& fmt, CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out.push_back('}');
        ++i;
        continue;
      }
      in.Fail("ValueError: Single '}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    const size_t close = fmt.find('}', i);
    if (close == std::string::npos) in.Fail("ValueError: Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close;
    std::string spec;
    char conversion = '\0';
    if (const size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      if (bang + 2 != field.size()) in.Fail("ValueError: expected ':' after conversion specifier");
      conversion = field[bang + 1];
      field = field.substr(0, bang);
    }
    // The first part names the argument; then .attr and [index] parts.
    size_t end = 0;
    while (end < field.size() && field[end] != '.' && field[end] != '[') ++end;
    const std::string head = field.substr(0, end);
    Value v;
    if (head.empty()) {
      if (auto_index >= args.positional.size()) in.Fail("IndexError: Replacement index out of range");
      v = args.positional[auto_index++];
    } else if (std::all_of(head.begin(), head.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
      const size_t k = static_cast<size_t>(std::atoll(head.c_str()));
      if (k >= args.positional.size()) in.Fail("IndexError: Replacement index out of range");
      v = args.positional[k];
    } else {
      const Value* kw = nullptr;
      for (auto& [name, val] : args.keywords) {
        if (name == head) kw = &val;
      }
      if (kw == nullptr) in.Fail(absl::StrCat("KeyError: ", Q(head)));
      v = *kw;
    }
    size_t p = end;
    while (p < field.size()) {
      if (field[p] == '.') {
        size_t q = p + 1;
        while (q < field.size() && field[q] != '.' && field[q] != '[') ++q;
        v = in.GetAttr(v, field.substr(p + 1, q - p - 1));
        p = q;
      } else {
        const size_t q = field.find(']', p);
        if (q == std::string::npos) in.Fail("ValueError: Missing ']' in format string");
        const std::string key = field.substr(p + 1, q - p - 1);
        const bool numeric = !key.empty() && std::all_of(key.begin(), key.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
        v = in.GetItem(v, numeric ? Value(static_cast<int64_t>(std::atoll(key.c_str()))) : Value(key));
        p = q + 1;
      }
    }
    if (conversion == 'r' || conversion == 'a') v = Value(in.Repr(v));
    if (conversion == 's') v = Value(in.Str(v));
    out += spec.empty() ? in.Str(v) : FormatSpec(in, v, spec);
    in.CheckSize(out.size());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Attribute paths, sorting

// jinja2's make_attrgetter: "a.b.0" walks attributes and indexes.
Value GetPath(Interp& in, const Value& item, const Value& attribute, const Value* dflt = nullptr) {
  if (!attribute.is_string()) {
    if (IsIntLike(attribute)) {
      Value v = in.GetItem(item, attribute);
      if (dflt != nullptr && v.is_undefined()) v = *dflt;
      return v;
    }
    return item;
  }
  Value v = item;
  const std::string& path = attribute.as_string();
  size_t p = 0;
  while (true) {
    const size_t dot = path.find('.', p);
    const std::string part = path.substr(p, dot == std::string::npos ? std::string::npos : dot - p);
    const auto idx = !part.empty() && std::all_of(part.begin(), part.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
    v = idx ? in.GetItem(v, Value(static_cast<int64_t>(std::atoll(part.c_str())))) : in.GetItem(v, Value(part));
    if (dflt != nullptr && v.is_undefined()) v = *dflt;
    if (dot == std::string::npos) break;
    p = dot + 1;
  }
  return v;
}

// TypeError for what Python cannot hash (lists, dicts, and tuples holding them).
void CheckHashable(Interp& in, const Value& v) {
  if ((v.is_list() && !v.is_tuple()) || v.is_dict() || v.is_namespace()) {
    TypeError(in, absl::StrCat("unhashable type: ", Q(v.TypeName())));
  }
  if (v.is_tuple()) {
    for (const Value& e : v.as_list()) CheckHashable(in, e);
  }
}

Value SortKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value(PyLower(v.as_string()));
  return v;
}

List SortList(Interp& in, List items, bool reverse, bool case_sensitive, const Value& attribute) {
  std::vector<std::pair<Value, Value>> keyed;
  keyed.reserve(items.size());
  // "a,b" sorts by a, then b (jinja2's multi-attribute getter).
  std::vector<Value> attrs;
  if (attribute.is_string() && attribute.as_string().find(',') != std::string::npos) {
    for (const Value& part : Split(attribute.as_string(), Value(","), -1, false)) attrs.push_back(part);
  }
  for (auto& it : items) {
    if (!attrs.empty()) {
      List k;
      for (const Value& a : attrs) k.push_back(SortKey(GetPath(in, it, a), case_sensitive));
      keyed.emplace_back(Value(std::move(k)), std::move(it));
      continue;
    }
    Value k = attribute.is_none() || attribute.is_undefined() ? it : GetPath(in, it, attribute);
    keyed.emplace_back(SortKey(k, case_sensitive), std::move(it));
  }
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? LessThan(in, b.first, a.first) : LessThan(in, a.first, b.first);
  });
  List out;
  for (auto& [k, v] : keyed) out.push_back(std::move(v));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tests

using TestFn = std::function<bool(Interp&, const Value&, CallArgs&)>;

const absl::flat_hash_map<std::string, TestFn>& Tests() {
  static const auto* const tests = new absl::flat_hash_map<std::string, TestFn>{
      {"defined", [](Interp&, const Value& v, CallArgs&) { return !v.is_undefined(); }},
      {"undefined", [](Interp&, const Value& v, CallArgs&) { return v.is_undefined(); }},
      {"none", [](Interp&, const Value& v, CallArgs&) { return v.is_none(); }},
      {"boolean", [](Interp&, const Value& v, CallArgs&) { return v.is_bool(); }},
      {"true", [](Interp&, const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }},
      {"false", [](Interp&, const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }},
      {"integer", [](Interp&, const Value& v, CallArgs&) { return v.is_int(); }},
      {"float", [](Interp&, const Value& v, CallArgs&) { return v.is_float(); }},
      {"number", [](Interp&, const Value& v, CallArgs&) { return v.is_number(); }},
      {"string", [](Interp&, const Value& v, CallArgs&) { return v.is_string(); }},
      {"mapping", [](Interp&, const Value& v, CallArgs&) { return v.is_dict(); }},
      {"iterable", [](Interp&, const Value& v, CallArgs&) {
         return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined() || v.is_iterator();
       }},
      {"sequence", [](Interp&, const Value& v, CallArgs&) {
         return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined() ||
                (v.is_iterator() && v.as_iterator().type == IteratorState::Type::kRange);
       }},
      {"callable", [](Interp&, const Value& v, CallArgs&) { return v.is_callable(); }},
      {"escaped", [](Interp&, const Value& v, CallArgs&) { return v.is_markup(); }},
      {"filter", [](Interp&, const Value& v, CallArgs&) {
         return v.is_string() && ResolveFilter(v.as_string()) != nullptr;
       }},
      {"test", [](Interp&, const Value& v, CallArgs&) {
         return v.is_string() && ResolveTest(v.as_string()) != nullptr;
       }},
      {"sameas", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& o = Arg(a, 0, "other", kNone);
         if (v.kind() != o.kind()) return false;
         if (v.is_none() || v.is_bool()) return v.Equals(o);
         if (v.is_int()) return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
         (void)in;
         return v.SameObject(o);
       }},
      {"in", [](Interp& in, const Value& v, CallArgs& a) {
         return Contains(in, Arg(a, 0, "seq", Value::Undefined()), v);
       }},
      {"odd", [](Interp& in, const Value& v, CallArgs&) {
         return BinaryOp(in, "%", v, Value(int64_t{2})).Equals(Value(int64_t{1}));
       }},
      {"even", [](Interp& in, const Value& v, CallArgs&) {
         return BinaryOp(in, "%", v, Value(int64_t{2})).Equals(Value(int64_t{0}));
       }},
      {"divisibleby", [](Interp& in, const Value& v, CallArgs& a) {
         const Value m = BinaryOp(in, "%", v, Arg(a, 0, "num", Value::Undefined()));
         return m.as_float() == 0;
       }},
      {"lower", [](Interp&, const Value& v, CallArgs&) { return v.is_string() && PyIsLower(v.as_string()); }},
      {"upper", [](Interp&, const Value& v, CallArgs&) { return v.is_string() && PyIsUpper(v.as_string()); }},
      {"eq", [](Interp&, const Value& v, CallArgs& a) { return v.Equals(Arg(a, 0, "other", kNone)); }},
      {"ne", [](Interp&, const Value& v, CallArgs& a) { return !v.Equals(Arg(a, 0, "other", kNone)); }},
      {"lt", [](Interp& in, const Value& v, CallArgs& a) { return LessThan(in, v, Arg(a, 0, "other", kNone)); }},
      {"gt", [](Interp& in, const Value& v, CallArgs& a) { return LessThan(in, Arg(a, 0, "other", kNone), v); }},
      {"le", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& o = Arg(a, 0, "other", kNone);
         return v.Equals(o) || LessThan(in, v, o);
       }},
      {"ge", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& o = Arg(a, 0, "other", kNone);
         return v.Equals(o) || LessThan(in, o, v);
       }},
  };
  return *tests;
}

const TestFn* FindTest(std::string_view name) {
  static const auto* const aliases = new absl::flat_hash_map<std::string, std::string>{
      {"equalto", "eq"}, {"==", "eq"}, {"!=", "ne"}, {"lessthan", "lt"}, {"<", "lt"},
      {"greaterthan", "gt"}, {">", "gt"}, {"<=", "le"}, {">=", "ge"}};
  std::string n(name);
  if (auto it = aliases->find(n); it != aliases->end()) n = it->second;
  const auto& t = Tests();
  auto it = t.find(n);
  return it == t.end() ? nullptr : &it->second;
}

// select/reject/selectattr/rejectattr: args after the attribute are a test name and its args.
List SelectOrReject(Interp& in, const Value& seq, CallArgs& a, bool by_attr, bool select) {
  size_t i = 0;
  Value attribute;
  if (by_attr) {
    if (a.positional.empty()) TypeError(in, "selectattr/rejectattr need an attribute");
    attribute = a.positional[0];
    i = 1;
  }
  const TestFn* test = nullptr;
  CallArgs test_args;
  if (i < a.positional.size()) {
    const Value& name = a.positional[i];
    if (!name.is_string()) TypeError(in, "the test name must be a string");
    test = FindTest(name.as_string());
    if (test == nullptr) in.Fail(absl::StrCat("TemplateRuntimeError: No test named ", Q(name.as_string()), "."));
    for (size_t k = i + 1; k < a.positional.size(); ++k) test_args.positional.push_back(a.positional[k]);
  }
  test_args.keywords = a.keywords;
  List out;
  if (!seq.Truthy()) return out;  // jinja2: `if seq:` before iterating
  for (const Value& item : in.Iterate(seq)) {
    in.Step();
    const Value v = by_attr ? GetPath(in, item, attribute) : item;
    CallArgs copy = test_args;
    const bool r = test != nullptr ? (*test)(in, v, copy) : v.Truthy();
    if (r == select) out.push_back(item);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Filters

using FilterFn = std::function<Value(Interp&, const Value&, CallArgs&)>;

const Value kUndef = Value::Undefined();

std::string SoftStr(Interp& in, const Value& v) { return in.Str(v); }

const absl::flat_hash_map<std::string, FilterFn>& Filters();

Value FilterList(Interp& in, const Value& v) { return Value(in.Iterate(v)); }

const absl::flat_hash_map<std::string, FilterFn>& Filters() {
  static const auto* const filters = new absl::flat_hash_map<std::string, FilterFn>{
      {"tojson", [](Interp& in, const Value& v, CallArgs& a) {
         const bool ensure_ascii = BoolArg(a, 0, "ensure_ascii", false);
         const Value& indent = Arg(a, 1, "indent", kNone);
         const Value& seps = Arg(a, 2, "separators", kNone);
         const bool sort_keys = BoolArg(a, 3, "sort_keys", false);
         a.CheckAllUsed(in, "tojson", 4);
         return Value(ToJson(in, v, ensure_ascii, indent, seps, sort_keys));
       }},
      {"trim", [](Interp& in, const Value& v, CallArgs& a) {
         const Value* chars = a.Get(0, "chars");
         a.CheckAllUsed(in, "trim", 1);
         std::string s = SoftStr(in, v);
         if (chars != nullptr && !chars->is_none()) {
           const std::string c = in.Str(*chars);
           return Value(Strip(s, &c, true, true));
         }
         return Value(Strip(s, nullptr, true, true));
       }},
      {"length", [](Interp& in, const Value& v, CallArgs&) -> Value {
         switch (v.kind()) {
           case Value::Kind::kString: return Value(CodePointCount(v.as_string()));
           case Value::Kind::kList: return Value(static_cast<int64_t>(v.as_list().size()));
           case Value::Kind::kDict: return Value(static_cast<int64_t>(v.as_dict().size()));
           case Value::Kind::kUndefined: return Value(int64_t{0});
           case Value::Kind::kIterator:
             if (!SinglePass(v)) return Value(static_cast<int64_t>(v.as_iterator().items.size()));
             [[fallthrough]];
           default: TypeError(in, absl::StrCat("object of type ", Q(v.TypeName()), " has no len()"));
         }
       }},
      {"default", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& d = Arg(a, 0, "default_value", Value(""));
         const bool boolean = BoolArg(a, 1, "boolean", false);
         a.CheckAllUsed(in, "default", 2);
         if (v.is_undefined() || (boolean && !v.Truthy())) return d;
         return v;
       }},
      {"first", [](Interp& in, const Value& v, CallArgs&) {
         const List items = in.Iterate(v);
         return items.empty() ? Value::Undefined() : items.front();
       }},
      {"last", [](Interp& in, const Value& v, CallArgs&) {
         if (SinglePass(v)) TypeError(in, absl::StrCat(Q(v.TypeName()), " object is not reversible"));
         const List items = in.Iterate(v);
         return items.empty() ? Value::Undefined() : items.back();
       }},
      {"join", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& d = Arg(a, 0, "d", Value(""));
         const Value& attribute = Arg(a, 1, "attribute", kNone);
         a.CheckAllUsed(in, "join", 2);
         std::string out;
         bool first = true;
         const std::string sep = in.Str(d);
         for (const Value& item : in.Iterate(v)) {
           if (!first) out += sep;
           first = false;
           out += in.Str(attribute.is_none() ? item : GetPath(in, item, attribute));
           in.CheckSize(out.size());
         }
         return Value(std::move(out));
       }},
      {"upper", [](Interp& in, const Value& v, CallArgs&) { return Value(PyUpper(SoftStr(in, v))); }},
      {"lower", [](Interp& in, const Value& v, CallArgs&) { return Value(PyLower(SoftStr(in, v))); }},
      {"capitalize", [](Interp& in, const Value& v, CallArgs&) { return Value(Capitalize(SoftStr(in, v))); }},
      {"title", [](Interp& in, const Value& v, CallArgs&) { return Value(FilterTitle(SoftStr(in, v))); }},
      {"replace", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& old = Arg(a, 0, "old", kUndef);
         const Value& repl = Arg(a, 1, "new", kUndef);
         const int64_t count = IntArg(in, a, 2, "count", -1);
         a.CheckAllUsed(in, "replace", 3);
         if (old.is_undefined() || repl.is_undefined()) TypeError(in, "replace() needs old and new");
         return Value(Replace(in, SoftStr(in, v), in.Str(old), in.Str(repl), count));
       }},
      {"string", [](Interp& in, const Value& v, CallArgs&) { return v.is_markup() ? v : Value(in.Str(v)); }},
      {"safe", [](Interp& in, const Value& v, CallArgs&) { return v.is_markup() ? v : Value::Markup(in.Str(v)); }},
      {"escape", [](Interp& in, const Value& v, CallArgs&) {
         return v.is_markup() ? v : Value::Markup(HtmlEscape(in.Str(v)));
       }},
      {"forceescape", [](Interp& in, const Value& v, CallArgs&) { return Value::Markup(HtmlEscape(in.Str(v))); }},
      {"int", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& d = Arg(a, 0, "default", Value(int64_t{0}));
         const int64_t base = IntArg(in, a, 1, "base", 10);
         a.CheckAllUsed(in, "int", 2);
         if (v.is_undefined()) in.FailUndefined(v);
         if (IsIntLike(v)) return Value(v.as_int());
         // Python's integers have no bound; here they are 64-bit, so a larger value fails
         // rather than wrapping.
         const auto to_int = [&in](double f) {
           const double t = std::trunc(f);
           if (!(t >= -9223372036854775808.0 && t < 9223372036854775808.0)) {
             in.Fail("integer overflow (integers are 64-bit here)");
           }
           return Value(static_cast<int64_t>(t));
         };
         if (v.is_float()) {
           if (!std::isfinite(v.as_float())) return d;
           return to_int(v.as_float());
         }
         if (v.is_string()) {
           if (auto i = ParseInt(v.as_string(), static_cast<int>(base))) return Value(*i);
           if (ParseIntOverflows(v.as_string(), static_cast<int>(base))) {
             in.Fail("integer overflow (integers are 64-bit here)");
           }
           if (auto f = ParseFloat(v.as_string()); f && std::isfinite(*f)) return to_int(*f);
         }
         return d;
       }},
      {"float", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& d = Arg(a, 0, "default", Value(0.0));
         a.CheckAllUsed(in, "float", 1);
         if (v.is_undefined()) in.FailUndefined(v);
         if (v.is_number()) return Value(v.as_float());
         if (v.is_string()) {
           if (auto f = ParseFloat(v.as_string())) return Value(*f);
         }
         return d;
       }},
      {"list", [](Interp& in, const Value& v, CallArgs&) { return FilterList(in, v); }},
      {"items", [](Interp& in, const Value& v, CallArgs&) -> Value {
         if (v.is_undefined()) return Gen({});
         if (!v.is_dict()) TypeError(in, absl::StrCat("can only get item pairs from a mapping, not ", v.TypeName()));
         List out;
         for (const auto& [k, e] : v.as_dict()) out.push_back(Value::Tuple({k, e}));
         return Gen(std::move(out));
       }},
      {"dictsort", [](Interp& in, const Value& v, CallArgs& a) -> Value {
         const bool case_sensitive = BoolArg(a, 0, "case_sensitive", false);
         const std::string by = StrArg(in, a, 1, "by", "key");
         const bool reverse = BoolArg(a, 2, "reverse", false);
         a.CheckAllUsed(in, "dictsort", 3);
         if (v.is_undefined()) in.FailUndefined(v);
         if (!v.is_dict()) TypeError(in, "dictsort needs a mapping");
         const int pos = by == "key" ? 0 : by == "value" ? 1 : -1;
         if (pos < 0) in.Fail("FilterArgumentError: You can only sort by either \"key\" or \"value\"");
         List items;
         for (const auto& [k, e] : v.as_dict()) items.push_back(Value::Tuple({k, e}));
         return Value(SortList(in, std::move(items), reverse, case_sensitive, Value(int64_t{pos})));
       }},
      {"selectattr", [](Interp& in, const Value& v, CallArgs& a) { return Gen(SelectOrReject(in, v, a, true, true)); }},
      {"rejectattr", [](Interp& in, const Value& v, CallArgs& a) { return Gen(SelectOrReject(in, v, a, true, false)); }},
      {"select", [](Interp& in, const Value& v, CallArgs& a) { return Gen(SelectOrReject(in, v, a, false, true)); }},
      {"reject", [](Interp& in, const Value& v, CallArgs& a) { return Gen(SelectOrReject(in, v, a, false, false)); }},
      {"map", [](Interp& in, const Value& v, CallArgs& a) {
         List out;
         if (!v.Truthy()) return Gen({});  // jinja2: `if value:` before iterating
         const Value* attribute = nullptr;
         for (size_t k = 0; k < a.keywords.size(); ++k) {
           if (a.keywords[k].first == "attribute") attribute = &a.keywords[k].second;
         }
         if (attribute != nullptr) {
           const Value* d = nullptr;
           for (auto& [name, val] : a.keywords) {
             if (name == "default") d = &val;
           }
           for (const Value& item : in.Iterate(v)) {
             in.Step();
             Value x = GetPath(in, item, *attribute, d);
             out.push_back(std::move(x));
           }
           return Gen(std::move(out));
         }
         if (a.positional.empty()) {
           // map() with no filter is the identity.
           return Gen(in.Iterate(v));
         }
         if (!a.positional[0].is_string()) TypeError(in, "map needs a filter name");
         const std::string name = a.positional[0].as_string();
         const auto& fs = Filters();
         auto it = fs.find(name == "d" ? "default" : name == "e" ? "escape" : name == "count" ? "length" : name);
         if (it == fs.end()) in.Fail(absl::StrCat("TemplateRuntimeError: No filter named ", Q(name), "."));
         for (const Value& item : in.Iterate(v)) {
           in.Step();
           CallArgs fa;
           fa.positional.assign(a.positional.begin() + 1, a.positional.end());
           fa.keywords = a.keywords;
           out.push_back(it->second(in, item, fa));
         }
         return Gen(std::move(out));
       }},
      {"unique", [](Interp& in, const Value& v, CallArgs& a) {
         const bool case_sensitive = BoolArg(a, 0, "case_sensitive", false);
         const Value& attribute = Arg(a, 1, "attribute", kNone);
         a.CheckAllUsed(in, "unique", 2);
         List out;
         List seen;
         for (const Value& item : in.Iterate(v)) {
           in.Step();
           Value key = SortKey(attribute.is_none() ? item : GetPath(in, item, attribute), case_sensitive);
           CheckHashable(in, key);
           bool dup = false;
           for (const Value& s : seen) {
             if (s.Equals(key)) {
               dup = true;
               break;
             }
           }
           if (!dup) {
             seen.push_back(std::move(key));
             out.push_back(item);
           }
         }
         return Gen(std::move(out));
       }},
      {"indent", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& width = Arg(a, 0, "width", Value(int64_t{4}));
         const bool first = BoolArg(a, 1, "first", false);
         const bool blank = BoolArg(a, 2, "blank", false);
         a.CheckAllUsed(in, "indent", 3);
         if (v.is_undefined()) in.FailUndefined(v);
         if (!v.is_string()) {
           TypeError(in, absl::StrCat("unsupported operand type(s) for +=: ", Q(v.TypeName()), " and 'str'"));
         }
         if (!width.is_string() && !IsIntLike(width)) TypeError(in, "indent width must be an int or a str");
         if (!width.is_string()) in.CheckSize(static_cast<size_t>(std::max<int64_t>(0, width.as_int())));
         const std::string ind = width.is_string() ? width.as_string()
                                                   : std::string(static_cast<size_t>(std::max<int64_t>(0, width.as_int())), ' ');
         std::string s = in.Str(v) + "\n";
         const List lines = SplitLines(s, false);
         std::string rv;
         if (blank) {
           for (size_t i = 0; i < lines.size(); ++i) {
             if (i > 0) rv += "\n" + ind;
             rv += lines[i].as_string();
           }
         } else {
           rv = lines.empty() ? "" : lines[0].as_string();
           for (size_t i = 1; i < lines.size(); ++i) {
             rv += "\n";
             if (!lines[i].as_string().empty()) rv += ind;
             rv += lines[i].as_string();
           }
         }
         if (first) rv = ind + rv;
         in.CheckSize(rv.size());
         return Value(std::move(rv));
       }},
      {"abs", [](Interp& in, const Value& v, CallArgs&) -> Value {
         if (IsIntLike(v)) {
           if (v.as_int() == INT64_MIN) in.Fail("integer overflow (integers are 64-bit here)");
           return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
         }
         if (v.is_float()) return Value(std::fabs(v.as_float()));
         TypeError(in, absl::StrCat("bad operand type for abs(): ", Q(v.TypeName())));
       }},
      {"round", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t precision = IntArg(in, a, 0, "precision", 0);
         const std::string method = StrArg(in, a, 1, "method", "common");
         a.CheckAllUsed(in, "round", 2);
         Value r = RoundValue(in, v, precision, method);
         if (IsIntLike(v) && method == "common") return r;
         return Value(r.as_float());
       }},
      {"sort", [](Interp& in, const Value& v, CallArgs& a) {
         const bool reverse = BoolArg(a, 0, "reverse", false);
         const bool case_sensitive = BoolArg(a, 1, "case_sensitive", false);
         const Value& attribute = Arg(a, 2, "attribute", kNone);
         a.CheckAllUsed(in, "sort", 3);
         return Value(SortList(in, in.Iterate(v), reverse, case_sensitive, attribute));
       }},
      {"reverse", [](Interp& in, const Value& v, CallArgs&) -> Value {
         if (v.is_string()) {
           std::u32string cps = DecodeUtf8(v.as_string());
           std::reverse(cps.begin(), cps.end());
           return Value(EncodeUtf8(cps));
         }
         // reversed() where Python has it (an iterator), else a reversed list, as jinja2.
         const bool reversible = v.is_list() || v.is_dict() || (v.is_iterator() && !SinglePass(v));
         List items = in.Iterate(v);
         std::reverse(items.begin(), items.end());
         if (reversible) return Value::Iterator(IteratorState::Type::kReverseIterator, std::move(items));
         return Value(std::move(items));
       }},
      {"sum", [](Interp& in, const Value& v, CallArgs& a) {
         const Value& attribute = Arg(a, 0, "attribute", kNone);
         Value total = Arg(a, 1, "start", Value(int64_t{0}));
         a.CheckAllUsed(in, "sum", 2);
         for (const Value& item : in.Iterate(v)) {
           in.Step();
           total = BinaryOp(in, "+", total, attribute.is_none() ? item : GetPath(in, item, attribute));
         }
         return total;
       }},
      {"min", [](Interp& in, const Value& v, CallArgs& a) {
         const bool case_sensitive = BoolArg(a, 0, "case_sensitive", false);
         const Value& attribute = Arg(a, 1, "attribute", kNone);
         a.CheckAllUsed(in, "min", 2);
         const List items = SortList(in, in.Iterate(v), false, case_sensitive, attribute);
         return items.empty() ? Value::Undefined() : items.front();
       }},
      {"max", [](Interp& in, const Value& v, CallArgs& a) {
         const bool case_sensitive = BoolArg(a, 0, "case_sensitive", false);
         const Value& attribute = Arg(a, 1, "attribute", kNone);
         a.CheckAllUsed(in, "max", 2);
         // The first of the largest, as Python's max().
         const List items = in.Iterate(v);
         if (items.empty()) return Value::Undefined();
         size_t best = 0;
         for (size_t i = 1; i < items.size(); ++i) {
           const Value ki = SortKey(attribute.is_none() ? items[i] : GetPath(in, items[i], attribute), case_sensitive);
           const Value kb = SortKey(attribute.is_none() ? items[best] : GetPath(in, items[best], attribute), case_sensitive);
           if (LessThan(in, kb, ki)) best = i;
         }
         return items[best];
       }},
      {"batch", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t n = IntArg(in, a, 0, "linecount", 0);
         const Value* fill = a.Get(1, "fill_with");
         a.CheckAllUsed(in, "batch", 2);
         if (n <= 0) in.Fail("ValueError: batch size must be positive");
         List out, cur;
         for (const Value& item : in.Iterate(v)) {
           cur.push_back(item);
           if (static_cast<int64_t>(cur.size()) == n) {
             out.push_back(Value(std::move(cur)));
             cur.clear();
           }
         }
         if (!cur.empty()) {
           if (fill != nullptr && !fill->is_none()) {
             while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*fill);
           }
           out.push_back(Value(std::move(cur)));
         }
         return Gen(std::move(out));
       }},
      {"wordcount", [](Interp& in, const Value& v, CallArgs&) {
         // Words as jinja2's \w+ finds them.
         int64_t n = 0;
         bool in_word = false;
         for (char32_t c : DecodeUtf8(in.Str(v))) {
           const bool w = IsPyAlnum(c) || c == '_';
           if (w && !in_word) ++n;
           in_word = w;
         }
         return Value(n);
       }},
      {"center", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t width = IntArg(in, a, 0, "width", 80);
         a.CheckAllUsed(in, "center", 1);
         in.CheckSize(static_cast<size_t>(std::max<int64_t>(0, width)));
         return Value(Pad(in, in.Str(v), width, '^', " "));
       }},
      {"truncate", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t length = IntArg(in, a, 0, "length", 255);
         const bool killwords = BoolArg(a, 1, "killwords", false);
         const std::string end = StrArg(in, a, 2, "end", "...");
         const int64_t leeway = IntArg(in, a, 3, "leeway", 5);
         a.CheckAllUsed(in, "truncate", 4);
         const int64_t endlen0 = CodePointCount(end);
         if (length < endlen0) in.Fail(absl::StrCat("AssertionError: expected length >= ", endlen0, ", got ", length));
         if (leeway < 0) in.Fail(absl::StrCat("AssertionError: expected leeway >= 0, got ", leeway));
         if (!v.is_string() && !v.is_undefined()) {
           // jinja2 measures len(s) first: what is short enough comes back unchanged.
           int64_t n = -1;
           if (v.is_list()) n = static_cast<int64_t>(v.as_list().size());
           if (v.is_dict()) n = static_cast<int64_t>(v.as_dict().size());
           if (v.is_iterator() && !SinglePass(v)) n = static_cast<int64_t>(v.as_iterator().items.size());
           if (n < 0) TypeError(in, absl::StrCat("object of type ", Q(v.TypeName()), " has no len()"));
           if (n <= length + leeway) return v;
           TypeError(in, absl::StrCat("truncate of a long ", v.TypeName(), " is not supported"));
         }
         const std::u32string s = DecodeUtf8(in.Str(v));
         const int64_t endlen = CodePointCount(end);
         if (length < endlen) in.Fail("AssertionError: expected length >= len(end)");
         if (leeway < 0) in.Fail("AssertionError: expected leeway >= 0");
         if (static_cast<int64_t>(s.size()) <= length + leeway) return Value(EncodeUtf8(s));
         std::u32string cut = s.substr(0, static_cast<size_t>(length - endlen));
         if (killwords) return Value(EncodeUtf8(cut) + end);
         const size_t sp = cut.rfind(U' ');
         if (sp != std::u32string::npos) cut = cut.substr(0, sp);
         return Value(EncodeUtf8(cut) + end);
       }},
      {"format", [](Interp& in, const Value& v, CallArgs& a) {
         if (!a.keywords.empty() && !a.positional.empty()) {
           in.Fail("FilterArgumentError: can't handle positional and keyword arguments at the same time");
         }
         if (!a.keywords.empty()) {
           Dict d;
           for (auto& [k, x] : a.keywords) d.emplace_back(Value(k), x);
           return Value(PercentFormat(in, in.Str(v), Value(std::move(d))));
         }
         return Value(PercentFormat(in, in.Str(v), Value::Tuple(a.positional)));
       }},
      {"attr", [](Interp& in, const Value& v, CallArgs& a) {
         const std::string name = StrArg(in, a, 0, "name", "");
         a.CheckAllUsed(in, "attr", 1);
         if (v.is_undefined()) in.FailUndefined(v);
         if (v.is_namespace()) return in.GetAttr(v, name);
         if (HasMethod(v, name)) return in.GetAttr(v, name);
         return Value::Undefined(name);
       }},
      {"striptags", [](Interp& in, const Value& v, CallArgs&) {
         std::string s = in.Str(v), out;
         bool tag = false;
         for (char c : s) {
           if (c == '<') tag = true;
           else if (c == '>' && tag) tag = false;
           else if (!tag) out.push_back(c);
         }
         // Collapse whitespace as jinja2 does.
         List words = Split(out, kNone, -1, false);
         std::string joined;
         for (size_t i = 0; i < words.size(); ++i) {
           if (i > 0) joined += " ";
           joined += words[i].as_string();
         }
         return Value(joined);
       }},
      {"slice", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t slices = IntArg(in, a, 0, "slices", 1);
         const Value* fill = a.Get(1, "fill_with");
         a.CheckAllUsed(in, "slice", 2);
         if (slices <= 0) in.Fail("ValueError: slices must be positive");
         const List seq = in.Iterate(v);
         const int64_t length = static_cast<int64_t>(seq.size());
         const int64_t per = length / slices;
         const int64_t extra = length % slices;
         int64_t offset = 0;
         List out;
         for (int64_t i = 0; i < slices; ++i) {
           const int64_t start = offset + i * per;
           if (i < extra) ++offset;
           const int64_t end = offset + (i + 1) * per;
           List part(seq.begin() + start, seq.begin() + end);
           if (fill != nullptr && !fill->is_none() && i >= extra && extra > 0) part.push_back(*fill);
           out.push_back(Value(std::move(part)));
         }
         return Gen(std::move(out));
       }},
      {"wordwrap", [](Interp& in, const Value& v, CallArgs& a) {
         const int64_t width = IntArg(in, a, 0, "width", 79);
         const bool break_long = BoolArg(a, 1, "break_long_words", true);
         const Value wrap = Arg(a, 2, "wrapstring", kNone);
         const bool hyphens = BoolArg(a, 3, "break_on_hyphens", true);
         a.CheckAllUsed(in, "wordwrap", 4);
         if (width <= 0) in.Fail(absl::StrCat("ValueError: invalid width ", width, " (must be > 0)"));
         const std::string sep = wrap.is_none() ? "\n" : in.Str(wrap);
         std::string out;
         bool first_paragraph = true;
         for (const Value& line : SplitLines(in.Str(v), false)) {
           if (!first_paragraph) out += sep;
           first_paragraph = false;
           bool first = true;
           for (const auto& l : WrapLine(DecodeUtf8(line.as_string()), width, break_long, hyphens)) {
             if (!first) out += sep;
             first = false;
             out += EncodeUtf8(l);
           }
           in.CheckSize(out.size());
         }
         return Value(std::move(out));
       }},
      {"groupby", [](Interp& in, const Value& v, CallArgs& a) {
         const Value attribute = Arg(a, 0, "attribute", kNone);
         const Value* dflt = a.Get(1, "default");
         const bool case_sensitive = BoolArg(a, 2, "case_sensitive", false);
         a.CheckAllUsed(in, "groupby", 3);
         // Sorted by the key, then grouped; a group's grouper is its first item's key as
         // given (not case-folded).
         std::vector<Value> raw_keys;
         List items = SortList(in, in.Iterate(v), false, case_sensitive, attribute);
         List out;
         for (const Value& item : items) {
           Value key = GetPath(in, item, attribute, dflt);
           const Value cmp = SortKey(key, case_sensitive);
           if (!out.empty() && SortKey(raw_keys.back(), case_sensitive).Equals(cmp)) {
             List grown = out.back().as_list()[1].as_list();
             grown.push_back(item);
             out.back() = Value::Group(raw_keys.back(), std::move(grown));
           } else {
             raw_keys.push_back(key);
             out.push_back(Value::Group(key, {item}));
           }
         }
         return Value(std::move(out));
       }},
      {"filesizeformat", [](Interp& in, const Value& v, CallArgs& a) {
         const bool binary = BoolArg(a, 0, "binary", false);
         a.CheckAllUsed(in, "filesizeformat", 1);
         double bytes;
         if (v.is_number()) {
           bytes = v.as_float();
         } else if (v.is_string() && ParseFloat(v.as_string())) {
           bytes = *ParseFloat(v.as_string());
         } else {
           in.Fail(absl::StrCat("ValueError: could not convert ", v.TypeName(), " to float"));
         }
         const double base = binary ? 1024 : 1000;
         static const char* const kDecimal[] = {"kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB"};
         static const char* const kBinary[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
         if (bytes == 1) return Value("1 Byte");
         if (bytes < base) return Value(absl::StrCat(static_cast<int64_t>(bytes), " Bytes"));
         double unit = base;
         for (int i = 0; i < 8; ++i) {
           unit = std::pow(base, i + 2);
           if (bytes < unit || i == 7) {
             char buf[64];
             std::snprintf(buf, sizeof buf, "%.1f %s", base * bytes / unit, binary ? kBinary[i] : kDecimal[i]);
             return Value(std::string(buf));
           }
         }
         return Value("");
       }},
      {"pprint", [](Interp& in, const Value& v, CallArgs&) { return Value(in.Repr(v)); }},
      {"urlencode", [](Interp& in, const Value& v, CallArgs&) {
         std::string out;
         for (unsigned char c : in.Str(v)) {
           if (std::isalnum(c) || c == '_' || c == '.' || c == '-' || c == '~' || c == '/') {
             out.push_back(static_cast<char>(c));
           } else {
             char buf[4];
             std::snprintf(buf, sizeof buf, "%%%02X", c);
             out += buf;
           }
         }
         return Value(out);
       }},
  };
  return *filters;
}

const FilterFn* FindFilter(std::string_view name) {
  if (name == "d") name = "default";
  if (name == "e") name = "escape";
  if (name == "count") name = "length";
  const auto& f = Filters();
  auto it = f.find(std::string(name));
  return it == f.end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------------------------
// Methods

// The methods of each type (the mutating ones are refused, as the sandbox does); every
// attribute of a dict (message.content) asks, hence sets.
using NameSet = absl::flat_hash_set<std::string_view>;

const NameSet& StrMethods() {
  static const auto* const m = new NameSet{
      "startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "upper", "lower",
      "replace", "title", "capitalize", "format", "find", "rfind", "index", "rindex", "count",
      "join", "splitlines", "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper",
      "isnumeric", "isdecimal", "istitle", "zfill", "center", "ljust", "rjust", "partition",
      "rpartition", "swapcase", "casefold", "removeprefix", "removesuffix", "expandtabs",
      "encode", "format_map", "isidentifier", "isprintable", "isascii"};
  return *m;
}

const NameSet& DictMethods() {
  static const auto* const m = new NameSet{"get", "items", "keys", "values", "copy", "pop",
                                           "popitem", "update", "setdefault", "clear", "fromkeys"};
  return *m;
}

const NameSet& ListMethods() {
  static const auto* const m = new NameSet{"index", "count", "copy", "append", "extend", "insert",
                                           "pop", "remove", "clear", "reverse", "sort"};
  return *m;
}

bool Unsafe(const Value& obj, std::string_view n) {
  // ImmutableSandboxedEnvironment refuses the methods that mutate lists and dicts.
  if (obj.is_list()) {
    return n == "append" || n == "extend" || n == "insert" || n == "pop" || n == "remove" ||
           n == "clear" || n == "reverse" || n == "sort";
  }
  if (obj.is_dict()) {
    return n == "pop" || n == "popitem" || n == "update" || n == "setdefault" || n == "clear";
  }
  return false;
}

// Python's prefix/suffix test with a str or a tuple of them, and optional start/end.
bool AffixTest(Interp& in, const std::string& s, CallArgs& a, bool prefix) {
  if (a.positional.empty()) TypeError(in, "startswith/endswith take at least 1 argument");
  std::string_view view = s;
  if (a.positional.size() > 1) {
    const std::u32string cps = DecodeUtf8(s);
    const int64_t n = static_cast<int64_t>(cps.size());
    const auto norm = [n](int64_t i) { return i < 0 ? std::max<int64_t>(0, i + n) : std::min(i, n); };
    const int64_t start = a.positional[1].is_none() ? 0 : norm(a.positional[1].as_int());
    const int64_t end = a.positional.size() > 2 && !a.positional[2].is_none() ? norm(a.positional[2].as_int()) : n;
    static thread_local std::string sub;
    sub = start < end ? EncodeUtf8(std::u32string_view(cps).substr(static_cast<size_t>(start), static_cast<size_t>(end - start))) : "";
    if (start > n) return false;
    view = sub;
  }
  const auto one = [&](const Value& x) {
    if (!x.is_string()) TypeError(in, absl::StrCat(prefix ? "startswith" : "endswith",
                                                   " first arg must be str or a tuple of str, not ", x.TypeName()));
    const std::string& t = x.as_string();
    return prefix ? view.substr(0, t.size()) == t
                  : view.size() >= t.size() && view.substr(view.size() - t.size()) == t;
  };
  const Value& arg = a.positional[0];
  if (arg.is_tuple()) {
    for (const Value& x : arg.as_list()) {
      if (one(x)) return true;
    }
    return false;
  }
  return one(arg);
}

Value StrMethod(Interp& in, const std::string& s, const std::string& name, CallArgs& a) {
  if (name == "startswith") return Value(AffixTest(in, s, a, true));
  if (name == "endswith") return Value(AffixTest(in, s, a, false));
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const Value* chars = a.Get(0, "chars");
    a.CheckAllUsed(in, name, 1);
    const bool l = name != "rstrip", r = name != "lstrip";
    if (chars != nullptr && !chars->is_none()) {
      if (!chars->is_string()) TypeError(in, absl::StrCat(name, " arg must be None or str"));
      return Value(Strip(s, &chars->as_string(), l, r));
    }
    return Value(Strip(s, nullptr, l, r));
  }
  if (name == "split" || name == "rsplit") {
    const Value& sep = Arg(a, 0, "sep", kNone);
    const int64_t maxsplit = IntArg(in, a, 1, "maxsplit", -1);
    a.CheckAllUsed(in, name, 2);
    if (!sep.is_none() && !sep.is_string()) TypeError(in, "must be str or None");
    if (sep.is_string() && sep.as_string().empty()) in.Fail("ValueError: empty separator");
    return Value(Split(s, sep, maxsplit, name == "rsplit"));
  }
  if (name == "upper") return Value(PyUpper(s));
  if (name == "lower") return Value(PyLower(s));
  if (name == "casefold") return Value(PyCaseFold(s));
  if (name == "title") return Value(StrTitle(s));
  if (name == "capitalize") return Value(Capitalize(s));
  if (name == "swapcase") {
    std::string out;
    for (char32_t c : DecodeUtf8(s)) {
      std::string one;
      AppendUtf8(c, &one);
      out += IsPyUpper(c) ? PyLower(one) : IsPyLower(c) ? PyUpper(one) : one;
    }
    return Value(out);
  }
  if (name == "replace") {
    if (a.positional.size() < 2 || !a.positional[0].is_string() || !a.positional[1].is_string()) {
      TypeError(in, "replace() takes two str arguments");
    }
    const int64_t count = IntArg(in, a, 2, "count", -1);
    return Value(Replace(in, s, a.positional[0].as_string(), a.positional[1].as_string(), count));
  }
  if (name == "format") return Value(StrFormat(in, s, a));
  if (name == "format_map") {
    if (a.positional.size() != 1 || !a.positional[0].is_dict()) TypeError(in, "format_map takes a mapping");
    CallArgs kw;
    for (const auto& [k, v] : a.positional[0].as_dict()) kw.keywords.emplace_back(in.Str(k), v);
    return Value(StrFormat(in, s, kw));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    if (a.positional.empty() || !a.positional[0].is_string()) TypeError(in, absl::StrCat(name, "() needs a str"));
    // Optional start and end, as slice indices over code points.
    std::string window = s;
    int64_t offset = 0;
    if (a.positional.size() > 1) {
      const std::u32string cps = DecodeUtf8(s);
      const int64_t n = static_cast<int64_t>(cps.size());
      const auto norm = [n](const Value& v, int64_t dflt) {
        if (v.is_none()) return dflt;
        int64_t i = v.as_int();
        if (i < 0) i = std::max<int64_t>(0, i + n);
        return std::min(i, n);
      };
      for (size_t k = 1; k < a.positional.size() && k < 3; ++k) {
        if (!a.positional[k].is_none() && !IsIntLike(a.positional[k])) TypeError(in, "slice indices must be integers or None");
      }
      const int64_t start = norm(a.positional[1], 0);
      const int64_t end = a.positional.size() > 2 ? norm(a.positional[2], n) : n;
      if (start > end) {
        if (name == "count") return Value(int64_t{0});
        if (name == "index" || name == "rindex") in.Fail("ValueError: substring not found");
        return Value(int64_t{-1});
      }
      window = EncodeUtf8(std::u32string_view(cps).substr(static_cast<size_t>(start), static_cast<size_t>(end - start)));
      offset = start;
    }
    if (name == "count") return Value(CountSub(window, a.positional[0].as_string()));
    const int64_t r = Find(window, a.positional[0].as_string(), name[0] == 'r');
    if (r < 0 && (name == "index" || name == "rindex")) in.Fail("ValueError: substring not found");
    return Value(r < 0 ? r : r + offset);
  }
  if (name == "join") {
    if (a.positional.size() != 1) TypeError(in, "join() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const Value& item : in.Iterate(a.positional[0])) {
      if (!item.is_string()) TypeError(in, absl::StrCat("sequence item: expected str instance, ", item.TypeName(), " found"));
      if (!first) out += s;
      first = false;
      out += item.as_string();
      in.CheckSize(out.size());
    }
    return Value(std::move(out));
  }
  if (name == "splitlines") return Value(SplitLines(s, BoolArg(a, 0, "keepends", false)));
  if (name == "isdigit") return Value(AllOf(s, IsPyDigit));
  if (name == "isdecimal") return Value(AllOf(s, IsPyDecimal));
  if (name == "isnumeric") return Value(AllOf(s, IsPyAlnum) && !AllOf(s, IsPyAlpha) && AllOf(s, [](char32_t c) { return !IsPyAlpha(c) && IsPyAlnum(c); }));
  if (name == "isalpha") return Value(AllOf(s, IsPyAlpha));
  if (name == "isalnum") return Value(AllOf(s, IsPyAlnum));
  if (name == "isspace") return Value(AllOf(s, IsPySpace));
  if (name == "isascii") return Value(IsAscii(s));
  if (name == "isprintable") return Value(s.empty() || AllOf(s, IsPyPrintable));
  if (name == "isidentifier") {
    const std::u32string c = DecodeUtf8(s);
    bool ok = !c.empty() && (IsPyAlpha(c[0]) || c[0] == '_');
    for (size_t i = 1; ok && i < c.size(); ++i) ok = IsPyAlnum(c[i]) || c[i] == '_';
    return Value(ok);
  }
  if (name == "islower" || name == "isupper") return Value(name == "islower" ? PyIsLower(s) : PyIsUpper(s));
  if (name == "istitle") {
    bool cased = false, previous_cased = false;
    for (char32_t c : DecodeUtf8(s)) {
      if (IsPyUpper(c) || IsPyTitle(c)) {
        if (previous_cased) return Value(false);
        previous_cased = cased = true;
      } else if (IsPyLower(c)) {
        if (!previous_cased) return Value(false);
        previous_cased = cased = true;
      } else {
        previous_cased = false;
      }
    }
    return Value(cased);
  }
  if (name == "zfill") {
    const int64_t width = IntArg(in, a, 0, "width", 0);
    const int64_t len = CodePointCount(s);
    if (width <= len) return Value(s);
    in.CheckSize(static_cast<size_t>(width));
    const bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
    return Value((sign ? s.substr(0, 1) : "") + std::string(static_cast<size_t>(width - len), '0') + (sign ? s.substr(1) : s));
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    const int64_t width = IntArg(in, a, 0, "width", 0);
    const std::string fill = StrArg(in, a, 1, "fillchar", " ");
    if (CodePointCount(fill) != 1) TypeError(in, "The fill character must be exactly one character long");
    in.CheckSize(static_cast<size_t>(std::max<int64_t>(0, width)) * fill.size());
    return Value(Pad(in, s, width, name == "center" ? '^' : name == "ljust" ? '<' : '>', fill));
  }
  if (name == "partition" || name == "rpartition") {
    if (a.positional.empty() || !a.positional[0].is_string()) TypeError(in, "partition() needs a str");
    const std::string& sep = a.positional[0].as_string();
    if (sep.empty()) in.Fail("ValueError: empty separator");
    const size_t f = name == "partition" ? s.find(sep) : s.rfind(sep);
    if (f == std::string::npos) {
      return name == "partition" ? Value::Tuple({Value(s), Value(""), Value("")})
                                 : Value::Tuple({Value(""), Value(""), Value(s)});
    }
    return Value::Tuple({Value(s.substr(0, f)), Value(sep), Value(s.substr(f + sep.size()))});
  }
  if (name == "removeprefix" || name == "removesuffix") {
    if (a.positional.empty() || !a.positional[0].is_string()) TypeError(in, absl::StrCat(name, "() needs a str"));
    const std::string& x = a.positional[0].as_string();
    if (name == "removeprefix") return Value(s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s);
    return Value(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0 ? s.substr(0, s.size() - x.size()) : s);
  }
  if (name == "expandtabs") {
    const int64_t tab = IntArg(in, a, 0, "tabsize", 8);
    std::string out;
    int64_t col = 0;
    for (char32_t c : DecodeUtf8(s)) {
      if (c == '\t') {
        const int64_t n = tab > 0 ? tab - col % tab : 0;
        out.append(static_cast<size_t>(n), ' ');
        col += n;
      } else {
        AppendUtf8(c, &out);
        col = (c == '\n' || c == '\r') ? 0 : col + 1;
      }
      in.CheckSize(out.size());
    }
    return Value(out);
  }
  in.Fail(absl::StrCat("SecurityError: access to str.", name, " is not supported"));
}

}  // namespace

const void* ResolveFilter(std::string_view name) { return FindFilter(name); }
const void* ResolveTest(std::string_view name) { return FindTest(name); }

Value ApplyResolvedFilter(Interp& in, const void* filter, const Value& v, CallArgs& args) {
  return (*static_cast<const FilterFn*>(filter))(in, v, args);
}

bool ApplyResolvedTest(Interp& in, const void* test, const Value& v, CallArgs& args) {
  return (*static_cast<const TestFn*>(test))(in, v, args);
}

Value ApplyFilter(Interp& in, const std::string& name, const Value& v, CallArgs& args) {
  const FilterFn* f = FindFilter(name);
  if (f == nullptr) in.Fail(absl::StrCat("no filter named ", Q(name)));
  return (*f)(in, v, args);
}

bool ApplyTest(Interp& in, const std::string& name, const Value& v, CallArgs& args) {
  const TestFn* t = FindTest(name);
  if (t == nullptr) in.Fail(absl::StrCat("no test named ", Q(name)));
  return (*t)(in, v, args);
}

bool HasMethod(const Value& obj, const std::string& name) {
  if (obj.is_string()) return StrMethods().contains(name);
  if (obj.is_dict()) return DictMethods().contains(name);
  if (obj.is_list()) return ListMethods().contains(name);
  return false;
}

bool CallMethod(Interp& in, const Value& obj, const std::string& name, CallArgs& a, Value* result) {
  if (!HasMethod(obj, name)) return false;
  if (Unsafe(obj, name)) {
    in.Fail(absl::StrCat("SecurityError: access to attribute ", Q(name), " of ", Q(obj.TypeName()),
                         " object is unsafe."));
  }
  if (obj.is_string()) {
    *result = StrMethod(in, obj.as_string(), name, a);
    return true;
  }
  if (obj.is_dict()) {
    if (name == "get") {
      if (a.positional.empty()) TypeError(in, "get expected at least 1 argument, got 0");
      const Value* v = obj.Find(a.positional[0]);
      *result = v != nullptr ? *v : (a.positional.size() > 1 ? a.positional[1] : Value::None());
      return true;
    }
    List out;
    for (const auto& [k, v] : obj.as_dict()) {
      if (name == "items") out.push_back(Value::Tuple({k, v}));
      if (name == "keys") out.push_back(k);
      if (name == "values") out.push_back(v);
    }
    if (name == "items" || name == "keys" || name == "values") {
      *result = Value::Iterator(name == "items"  ? IteratorState::Type::kDictItems
                                : name == "keys" ? IteratorState::Type::kDictKeys
                                                 : IteratorState::Type::kDictValues,
                                std::move(out));
      return true;
    }
    if (name == "copy") {
      *result = obj;
      return true;
    }
    if (name == "fromkeys") {
      DictBuilder b;
      for (const Value& k : in.Iterate(a.positional.empty() ? Value::Undefined() : a.positional[0])) {
        b.Set(k, a.positional.size() > 1 ? a.positional[1] : Value::None());
      }
      *result = std::move(b).Build();
      return true;
    }
    *result = Value(std::move(out));
    return true;
  }
  // list
  const List& l = obj.as_list();
  if (name == "index" || name == "count") {
    if (a.positional.empty()) TypeError(in, absl::StrCat(name, "() takes at least 1 argument"));
    int64_t n = 0;
    for (size_t i = 0; i < l.size(); ++i) {
      if (l[i].Equals(a.positional[0])) {
        if (name == "index") {
          *result = Value(static_cast<int64_t>(i));
          return true;
        }
        ++n;
      }
    }
    if (name == "index") in.Fail("ValueError: value is not in list");
    *result = Value(n);
    return true;
  }
  *result = obj;  // copy
  return true;
}

// ---------------------------------------------------------------------------------------------
// Globals

namespace {

Value MakeFunction(std::string name, std::function<Value(Interp&, CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  return Value::Function(std::move(c));
}

}  // namespace

const Value* BuiltinGlobal(const std::string& name) {
  static const auto* const globals = new absl::flat_hash_map<std::string, Value>{
      {"range", MakeFunction("range", [](Interp& in, CallArgs& a) {
         if (!a.keywords.empty()) TypeError(in, "range() takes no keyword arguments");
         if (a.positional.empty() || a.positional.size() > 3) TypeError(in, "range expected 1 to 3 arguments");
         for (const Value& v : a.positional) {
           if (v.is_undefined()) in.FailUndefined(v);
           if (!IsIntLike(v)) TypeError(in, absl::StrCat(Q(v.TypeName()), " object cannot be interpreted as an integer"));
         }
         int64_t start = 0, stop, step = 1;
         if (a.positional.size() == 1) {
           stop = a.positional[0].as_int();
         } else {
           start = a.positional[0].as_int();
           stop = a.positional[1].as_int();
           if (a.positional.size() == 3) step = a.positional[2].as_int();
         }
         if (step == 0) in.Fail("ValueError: range() arg 3 must not be zero");
         int64_t n = 0;
         if (step > 0 && stop > start) n = (stop - start + step - 1) / step;
         if (step < 0 && stop < start) n = (start - stop - step - 1) / (-step);
         if (n > kMaxRange) {
           in.Fail(absl::StrCat("OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE (",
                                kMaxRange, ")."));
         }
         List out;
         out.reserve(static_cast<size_t>(n));
         for (int64_t i = 0; i < n; ++i) out.push_back(Value(start + i * step));
         return Value::Iterator(IteratorState::Type::kRange, std::move(out),
                                step == 1 ? absl::StrCat("range(", start, ", ", stop, ")")
                                          : absl::StrCat("range(", start, ", ", stop, ", ", step, ")"));
       })},
      {"dict", MakeFunction("dict", [](Interp& in, CallArgs& a) {
         DictBuilder b;
         if (!a.positional.empty()) {
           const Value& src = a.positional[0];
           if (src.is_dict()) {
             for (const auto& [k, v] : src.as_dict()) b.Set(k, v);
           } else {
             for (const Value& pair : in.Iterate(src)) {
               if (!pair.is_list() || pair.as_list().size() != 2) in.Fail("ValueError: dictionary update sequence element has wrong length");
               b.Set(pair.as_list()[0], pair.as_list()[1]);
             }
           }
         }
         for (auto& [k, v] : a.keywords) b.Set(k, v);
         return std::move(b).Build();
       })},
      {"namespace", MakeFunction("namespace", [](Interp& in, CallArgs& a) {
         DictBuilder b;
         for (const Value& src : a.positional) {
           if (!src.is_dict()) TypeError(in, "namespace() takes mappings");
           for (const auto& [k, v] : src.as_dict()) b.Set(k, v);
         }
         for (auto& [k, v] : a.keywords) b.Set(k, v);
         Value d = std::move(b).Build();
         return in.NewNamespace(d.as_dict());
       })},
      {"raise_exception", MakeFunction("raise_exception", [](Interp& in, CallArgs& a) -> Value {
         const Value* m = a.Get(0, "message");
         in.Fail(absl::StrCat("raise_exception: ", m != nullptr ? in.Str(*m) : std::string()));
       })},
      {"strftime_now", MakeFunction("strftime_now", [](Interp& in, CallArgs& a) {
         const Value* f = a.Get(0, "format");
         if (f == nullptr || !f->is_string()) TypeError(in, "strftime_now() takes a format string");
         const std::time_t now = std::time(nullptr);
         std::tm tm{};
         localtime_r(&now, &tm);
         std::string out(256, '\0');
         size_t n = 0;
         for (int tries = 0; tries < 6 && !f->as_string().empty(); ++tries) {
           n = std::strftime(out.data(), out.size(), f->as_string().c_str(), &tm);
           if (n > 0) break;
           out.resize(out.size() * 4);
         }
         out.resize(n);
         return Value(out);
       })},
      {"lipsum", MakeFunction("lipsum", [](Interp& in, CallArgs&) -> Value {
         in.Fail("lipsum() is not supported: it generates random text");
       })},
      {"joiner", MakeFunction("joiner", [](Interp&, CallArgs& a) {
         const Value sep = a.positional.empty() ? Value(", ") : a.positional[0];
         auto used = std::make_shared<bool>(false);
         auto c = std::make_shared<Callable>();
         c->name = "joiner";
         c->fn = [sep, used](Interp&, CallArgs&) {
           if (!*used) {
             *used = true;
             return Value("");
           }
           return sep;
         };
         return Value::Function(std::move(c), sep);
       })},
      {"cycler", MakeFunction("cycler", [](Interp& in, CallArgs& a) {
         if (a.positional.empty()) TypeError(in, "cycler needs items");
         // A namespace whose `current` the methods keep up to date.
         auto items = std::make_shared<List>(a.positional);
         auto pos = std::make_shared<size_t>(0);
         Value ns = in.NewNamespace(Dict{{Value("items"), Value(*items)},
                                         {Value("current"), (*items)[0]}});
         Dict* state = &ns.mutable_namespace();
         const auto set_current = [state, items, pos]() {
           for (auto& [k, v] : *state) {
             if (k.as_string() == "current") v = (*items)[*pos];
           }
         };
         state->emplace_back(Value("next"), MakeFunction("next", [items, pos, set_current](Interp&, CallArgs&) {
           const Value v = (*items)[*pos];
           *pos = (*pos + 1) % items->size();
           set_current();
           return v;
         }));
         state->emplace_back(Value("reset"), MakeFunction("reset", [pos, set_current](Interp&, CallArgs&) {
           *pos = 0;
           set_current();
           return Value::None();
         }));
         return ns;
       })},
  };
  auto it = globals->find(name);
  return it == globals->end() ? nullptr : &it->second;
}

}  // namespace kvgrid::model::jinja
