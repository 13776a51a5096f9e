#include "model/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "model/jinja/unicode.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model::jinja {

Value Value::Undefined(std::string name) {
  Value v;
  if (!name.empty()) v.ptr_ = std::make_shared<const std::string>(std::move(name));
  return v;
}

Value::Value(std::string s) : kind_(Kind::kString) {
  ptr_ = std::make_shared<const std::string>(std::move(s));
}

Value::Value(std::string_view s) : kind_(Kind::kString) {
  ptr_ = std::make_shared<const std::string>(s);
}

namespace {

// A node count summed in 64 bits (no list or dict holds 2^32 elements), saturated to the field.
uint32_t SaturatedNodes(uint64_t n) {
  return static_cast<uint32_t>(std::min<uint64_t>(n, UINT32_MAX));
}

}  // namespace

Value::Value(List list) : kind_(Kind::kList) {
  int32_t d = 0;
  uint64_t n = 1;
  for (const Value& v : list) {
    d = std::max(d, v.depth_);
    n += v.nodes_;
  }
  depth_ = d + 1;
  nodes_ = SaturatedNodes(n);
  ptr_ = std::make_shared<const List>(std::move(list));
}

Value::Value(Dict dict) : kind_(Kind::kDict) {
  int32_t d = 0;
  uint64_t n = 1;
  for (const auto& [k, v] : dict) {
    d = std::max({d, k.depth_, v.depth_});
    n += uint64_t{k.nodes_} + v.nodes_;
  }
  depth_ = d + 1;
  nodes_ = SaturatedNodes(n);
  ptr_ = std::make_shared<Dict>(std::move(dict));
}

Value Value::Tuple(List items) {
  Value v(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::Group(Value grouper, List items) {
  Value v = Tuple({std::move(grouper), Value(std::move(items))});
  v.group_ = true;
  return v;
}

Value Value::Markup(std::string s) {
  Value v(std::move(s));
  v.tuple_ = true;
  return v;
}

Value Value::Namespace(Dict initial) {
  Value v(std::move(initial));
  v.kind_ = Kind::kNamespace;
  v.depth_ = 0;
  v.nodes_ = 1;
  return v;
}

Value Value::Iterator(IteratorState::Type type, List items, std::string repr) {
  Value v;
  v.kind_ = Kind::kIterator;
  auto state = std::make_shared<IteratorState>();
  state->type = type;
  int32_t d = 0;
  uint64_t n = 1;
  for (const Value& e : items) {
    d = std::max(d, e.depth_);
    n += e.nodes_;
  }
  v.depth_ = d + 1;
  v.nodes_ = SaturatedNodes(n);
  state->items = std::move(items);
  state->repr = std::move(repr);
  v.ptr_ = std::move(state);
  return v;
}

Value Value::Function(std::shared_ptr<const Callable> callable) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.ptr_ = std::move(callable);
  return v;
}

Value Value::Function(std::shared_ptr<const Callable> callable, const Value& held) {
  Value v = Function(std::move(callable));
  v.depth_ = held.depth_ + 1;
  v.nodes_ = SaturatedNodes(uint64_t{held.nodes_} + 1);
  return v;
}

const std::string& Value::undefined_name() const {
  static const std::string* const kEmpty = new std::string;
  if (kind_ != Kind::kUndefined || ptr_ == nullptr) return *kEmpty;
  return as_string();
}

namespace {

Value FromNlohmann(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value(j.get_ref<const std::string&>());
    case nlohmann::ordered_json::value_t::array: {
      List list;
      list.reserve(j.size());
      for (const auto& e : j) list.push_back(FromNlohmann(e));
      return Value(std::move(list));
    }
    case nlohmann::ordered_json::value_t::object: {
      // A JSON object may repeat a key; the last one wins, as in Python's json.
      DictBuilder b;
      for (const auto& [k, v] : j.items()) b.Set(k, FromNlohmann(v));
      return std::move(b).Build();
    }
    default:
      return Value::None();
  }
}

void AppendPyStringRepr(std::string_view s, std::string* out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out->push_back(quote);
  const std::u32string cps = DecodeUtf8(s);
  for (char32_t c : cps) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out->append("\\n");
    } else if (c == '\r') {
      out->append("\\r");
    } else if (c == '\t') {
      out->append("\\t");
    } else if (IsPyPrintable(c)) {
      AppendUtf8(c, out);
    } else {
      char buf[16];
      if (c < 0x100) {
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      }
      out->append(buf);
    }
  }
  out->push_back(quote);
}

// Python's repr (str at the top for a string), stopping once the text is longer than
// `max_bytes`. A list, dict or namespace met again inside itself prints as Python's recursion
// guard prints it: "[...]", "(...)", "{...}".
class ReprWriter {
 public:
  // Deeper than Python's recursion limit lets jinja2 print (lists are bounded shallower; only
  // namespaces holding namespaces reach it), written as "...".
  static constexpr size_t kMaxReprDepth = 1000;

  ReprWriter(std::string* out, int64_t max_bytes) : out_(out), max_bytes_(max_bytes) {}

  void WriteStr(const Value& v) {
    if (v.is_undefined()) return;
    if (v.is_string()) {
      out_->append(v.as_string());
      return;
    }
    Write(v);
  }

  void Write(const Value& v) {
    if (Full()) return;
    if (path_.size() > kMaxReprDepth) {
      out_->append("...");
      return;
    }
    switch (v.kind()) {
      case Value::Kind::kUndefined:
        out_->append("Undefined");
        return;
      case Value::Kind::kNone:
        out_->append("None");
        return;
      case Value::Kind::kBool:
        out_->append(v.as_bool() ? "True" : "False");
        return;
      case Value::Kind::kInt:
        absl::StrAppend(out_, v.as_int());
        return;
      case Value::Kind::kFloat:
        out_->append(FloatRepr(v.as_float()));
        return;
      case Value::Kind::kString:
        AppendPyStringRepr(v.as_string(), out_);
        return;
      case Value::Kind::kList: {
        const char open = v.is_tuple() ? '(' : '[';
        const char close = v.is_tuple() ? ')' : ']';
        if (OnPath(v)) {
          out_->push_back(open);
          out_->append("...");
          out_->push_back(close);
          return;
        }
        Enter(v);
        if (v.is_group()) {
          out_->append("_GroupTuple(grouper=");
          Write(v.as_list()[0]);
          out_->append(", list=");
          Write(v.as_list()[1]);
          out_->push_back(')');
        } else {
          out_->push_back(open);
          const List& l = v.as_list();
          for (size_t i = 0; i < l.size() && !Full(); ++i) {
            if (i > 0) out_->append(", ");
            Write(l[i]);
          }
          if (v.is_tuple() && l.size() == 1) out_->push_back(',');
          out_->push_back(close);
        }
        Leave(v);
        return;
      }
      case Value::Kind::kNamespace:
      case Value::Kind::kDict: {
        if (v.is_namespace()) out_->append("<Namespace ");
        if (OnPath(v)) {
          out_->append("{...}");
        } else {
          Enter(v);
          out_->push_back('{');
          bool first = true;
          for (const auto& [k, e] : v.as_dict()) {
            if (Full()) break;
            if (!first) out_->append(", ");
            first = false;
            Write(k);
            out_->append(": ");
            Write(e);
          }
          out_->push_back('}');
          Leave(v);
        }
        if (v.is_namespace()) out_->push_back('>');
        return;
      }
      case Value::Kind::kCallable:
        out_->append("<function>");
        return;
      case Value::Kind::kIterator: {
        const IteratorState& it = v.as_iterator();
        const char* view = nullptr;
        switch (it.type) {
          case IteratorState::Type::kGenerator: out_->append("<generator object>"); return;
          case IteratorState::Type::kReverseIterator: out_->append("<list_reverseiterator object>"); return;
          case IteratorState::Type::kRange: out_->append(it.repr); return;
          case IteratorState::Type::kDictKeys: view = "dict_keys("; break;
          case IteratorState::Type::kDictValues: view = "dict_values("; break;
          case IteratorState::Type::kDictItems: view = "dict_items("; break;
        }
        out_->append(view);
        Write(Value(it.items));
        out_->push_back(')');
        return;
      }
    }
  }

 private:
  [[nodiscard]] bool Full() const { return static_cast<int64_t>(out_->size()) > max_bytes_; }
  [[nodiscard]] bool OnPath(const Value& v) const { return path_.contains(v.identity()); }
  void Enter(const Value& v) { path_.insert(v.identity()); }
  void Leave(const Value& v) { path_.erase(v.identity()); }

  std::string* out_;
  int64_t max_bytes_;
  absl::flat_hash_set<const void*> path_;  // the lists, dicts and namespaces being written
};

}  // namespace

absl::StatusOr<Value> Value::FromJson(std::string_view json_text, std::string_view source) {
  if (absl::Status s = CheckJsonDepth(json_text, source); !s.ok()) return s;
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": malformed JSON: ", e.what()));
  }
  return FromNlohmann(j);
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0;
    case Kind::kString:
      return !as_string().empty();
    case Kind::kList:
      return !as_list().empty();
    case Kind::kDict:
      return !as_dict().empty();
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
    case Kind::kIterator: {
      const IteratorState& it = as_iterator();
      if (it.type == IteratorState::Type::kGenerator ||
          it.type == IteratorState::Type::kReverseIterator) {
        return true;
      }
      return !it.items.empty();
    }
  }
  return false;
}

bool Value::Equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (is_float() || o.is_float()) return as_float() == o.as_float();
    return int_ == o.int_;
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return as_string() == o.as_string();
    case Kind::kList: {
      if (is_tuple() != o.is_tuple()) return false;
      const List& a = as_list();
      const List& b = o.as_list();
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].Equals(b[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      const Dict& a = as_dict();
      const Dict& b = o.as_dict();
      if (a.size() != b.size()) return false;
      for (const auto& [k, v] : a) {
        const Value* other = o.Find(k);
        if (other == nullptr || !v.Equals(*other)) return false;
      }
      return true;
    }
    case Kind::kIterator:
      if (as_iterator().type == IteratorState::Type::kRange &&
          o.as_iterator().type == IteratorState::Type::kRange) {
        return Value(as_iterator().items).Equals(Value(o.as_iterator().items));
      }
      return ptr_ == o.ptr_;
    default:
      return ptr_ == o.ptr_;
  }
}

const Value* Value::Find(const Value& key) const {
  if (kind_ != Kind::kDict && kind_ != Kind::kNamespace) return nullptr;
  for (const auto& [k, v] : as_dict()) {
    if (k.Equals(key)) return &v;
  }
  return nullptr;
}

const Value* Value::Find(std::string_view key) const {
  if (kind_ != Kind::kDict && kind_ != Kind::kNamespace) return nullptr;
  for (const auto& [k, v] : as_dict()) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

std::string Value::Str(int64_t max_bytes) const {
  if (kind_ == Kind::kString) return as_string();
  std::string out;
  ReprWriter(&out, max_bytes).WriteStr(*this);
  return out;
}

std::string Value::Repr(int64_t max_bytes) const {
  if (kind_ == Kind::kUndefined) return "";
  std::string out;
  ReprWriter(&out, max_bytes).Write(*this);
  return out;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return is_tuple() ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return "function";
    case Kind::kIterator:
      switch (as_iterator().type) {
        case IteratorState::Type::kGenerator: return "generator";
        case IteratorState::Type::kReverseIterator: return "list_reverseiterator";
        case IteratorState::Type::kDictKeys: return "dict_keys";
        case IteratorState::Type::kDictValues: return "dict_values";
        case IteratorState::Type::kDictItems: return "dict_items";
        case IteratorState::Type::kRange: return "range";
      }
  }
  return "object";
}

DictBuilder& DictBuilder::Set(Value key, Value value) {
  for (auto& [k, v] : dict_) {
    if (k.Equals(key)) {
      v = std::move(value);
      return *this;
    }
  }
  dict_.emplace_back(std::move(key), std::move(value));
  return *this;
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  // Shortest round-trip digits in scientific form: "d.ddde[+-]x".
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));
  const size_t e = sci.find('e');
  std::string_view mant = sci.substr(0, e);
  const int exp = std::atoi(std::string(sci.substr(e + 1)).c_str());
  std::string sign;
  if (!mant.empty() && mant[0] == '-') {
    sign = "-";
    mant.remove_prefix(1);
  }
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits.push_back(c);
  }
  std::string out = sign;
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const size_t int_digits = static_cast<size_t>(exp) + 1;
      if (digits.size() <= int_digits) {
        out += digits + std::string(int_digits - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, int_digits) + "." + digits.substr(int_digits);
      }
    } else {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  out += ebuf;
  return out;
}

}  // namespace kvgrid::model::jinja
