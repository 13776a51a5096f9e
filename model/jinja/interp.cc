#include "model/jinja/interp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "model/jinja/unicode.h"

namespace kvgrid::model::jinja {
namespace {

// Eval recursion bound: expressions are bounded by the parser, but macro bodies re-enter.
constexpr int kMaxEvalDepth = 3000;
// Nesting of lists and dicts a template may build (JSON input is bounded before it arrives).
constexpr int kMaxValueDepth = 512;

struct DepthGuard {
  DepthGuard(Interp& in, int* depth, int max, const char* what) : depth(depth) {
    if (++*depth > max) {
      --*depth;
      in.Fail(absl::StrCat("the template nested ", what, " deeper than ", max));
    }
  }
  ~DepthGuard() { --*depth; }
  int* depth;
};

[[noreturn]] void TypeError(Interp& in, std::string message) { in.Fail("TypeError: " + message); }

std::string Quoted(std::string_view s) { return absl::StrCat("'", absl::string_view(s.data(), s.size()), "'"); }

int64_t CheckedInt(Interp& in, bool overflow, int64_t v) {
  if (overflow) in.Fail("integer overflow (integers are 64-bit here)");
  return v;
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t FloorMod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

// Python's float divmod.
void FloatDivMod(double vx, double wx, double* div, double* mod) {
  double m = std::fmod(vx, wx);
  double d = (vx - m) / wx;
  if (m != 0) {
    if ((wx < 0) != (m < 0)) {
      m += wx;
      d -= 1.0;
    }
  } else {
    m = std::copysign(0.0, wx);
  }
  double floordiv;
  if (d != 0) {
    floordiv = std::floor(d);
    if (d - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, vx / wx);
  }
  *div = floordiv;
  *mod = m;
}

Value RepeatSeq(Interp& in, const Value& seq, int64_t n) {
  if (n < 0) n = 0;
  // Checked before anything is built: n may be huge. A list item counts as 16 bytes.
  const size_t unit = seq.is_string() ? seq.as_string().size() : 16 * seq.as_list().size();
  if (unit > 0 && static_cast<uint64_t>(n) > static_cast<uint64_t>(in.limits().max_output_bytes) / unit) {
    in.CheckSize(static_cast<size_t>(in.limits().max_output_bytes) + 1);
  }
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    std::string out;
    out.reserve(s.size() * static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out += s;
    return Value(std::move(out));
  }
  const List& l = seq.as_list();
  List out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), l.begin(), l.end());
  return seq.is_tuple() ? Value::Tuple(std::move(out)) : Value(std::move(out));
}

bool IsIntLike(const Value& v) { return v.is_int() || v.is_bool(); }

}  // namespace

const Value* CallArgs::Get(size_t index, std::string_view name) {
  if (index < positional.size()) return &positional[index];
  if (used.size() < keywords.size()) used.resize(keywords.size(), false);
  for (size_t i = 0; i < keywords.size(); ++i) {
    if (keywords[i].first == name) {
      used[i] = true;
      return &keywords[i].second;
    }
  }
  return nullptr;
}

void CallArgs::CheckAllUsed(Interp& in, std::string_view fn, size_t max_positional) const {
  const absl::string_view function(fn.data(), fn.size());
  if (positional.size() > max_positional) {
    TypeError(in, absl::StrCat(function, "() takes at most ", max_positional, " positional arguments (",
                               positional.size(), " given)"));
  }
  for (size_t i = 0; i < keywords.size(); ++i) {
    if (i >= used.size() || !used[i]) {
      TypeError(in, absl::StrCat(function, "() got an unexpected keyword argument ",
                                 Quoted(keywords[i].first)));
    }
  }
}

Interp::~Interp() {
  // Every namespace and memory is still held here, so emptying one frees none of the others.
  for (const Value& ns : namespaces_) {
    Dict attributes;
    attributes.swap(ns.mutable_namespace());
  }
  for (const auto& memory : changed_memories_) {
    std::optional<List> seen;
    seen.swap(*memory);
  }
}

Value Interp::NewNamespace(Dict initial) {
  Value ns = Value::Namespace(std::move(initial));
  namespaces_.push_back(ns);
  return ns;
}

std::shared_ptr<std::optional<List>> Interp::NewChangedMemory() {
  auto memory = std::make_shared<std::optional<List>>();
  changed_memories_.push_back(memory);
  return memory;
}

void Interp::CheckDepth(const Value& v) const {
  if (v.depth() > kMaxValueDepth) {
    Fail(absl::StrCat("the template nested lists or dicts deeper than ", kMaxValueDepth));
  }
  if (v.nodes() > limits_.max_output_bytes) {
    Fail("the template built a list or dict larger than its size limit");
  }
}

void Interp::FailUndefined(const Value& v) const {
  if (!v.undefined_name().empty()) Fail(absl::StrCat("UndefinedError: ", Quoted(v.undefined_name()), " is undefined"));
  Fail("UndefinedError: an undefined value was used");
}

// ---------------------------------------------------------------------------------------------
// Operators

Value BinaryOp(Interp& in, std::string_view op, const Value& a, const Value& b) {
  const absl::string_view op_name(op.data(), op.size());
  if (op == "~") {
    std::string s = in.Str(a);
    s += in.Str(b);
    in.CheckSize(s.size());
    return Value(std::move(s));
  }
  // str % x formats x with str(), which an undefined value allows.
  if (op == "%" && a.is_string()) return Value(PercentFormat(in, a.as_string(), b));
  if (a.is_undefined()) in.FailUndefined(a);
  if (b.is_undefined()) in.FailUndefined(b);
  const bool nums = a.is_number() && b.is_number();
  const bool ints = IsIntLike(a) && IsIntLike(b);
  if (op == "+") {
    if (ints) {
      int64_t r;
      const bool overflow = __builtin_add_overflow(a.as_int(), b.as_int(), &r);
      return Value(CheckedInt(in, overflow, r));
    }
    if (nums) return Value(a.as_float() + b.as_float());
    if (a.is_string() && b.is_string()) {
      in.CheckSize(a.as_string().size() + b.as_string().size());
      // Markup escapes what is added to it.
      if (a.is_markup() || b.is_markup()) {
        return Value::Markup((a.is_markup() ? a.as_string() : EscapeHtml(a.as_string())) +
                             (b.is_markup() ? b.as_string() : EscapeHtml(b.as_string())));
      }
      return Value(a.as_string() + b.as_string());
    }
    if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
      List out = a.as_list();
      out.insert(out.end(), b.as_list().begin(), b.as_list().end());
      in.CheckSize(out.size() * 16);
      return a.is_tuple() ? Value::Tuple(std::move(out)) : Value(std::move(out));
    }
  } else if (op == "-") {
    if (ints) {
      int64_t r;
      const bool overflow = __builtin_sub_overflow(a.as_int(), b.as_int(), &r);
      return Value(CheckedInt(in, overflow, r));
    }
    if (nums) return Value(a.as_float() - b.as_float());
  } else if (op == "*") {
    if (ints) {
      int64_t r;
      const bool overflow = __builtin_mul_overflow(a.as_int(), b.as_int(), &r);
      return Value(CheckedInt(in, overflow, r));
    }
    if (nums) return Value(a.as_float() * b.as_float());
    if ((a.is_string() || a.is_list()) && IsIntLike(b)) return RepeatSeq(in, a, b.as_int());
    if ((b.is_string() || b.is_list()) && IsIntLike(a)) return RepeatSeq(in, b, a.as_int());
  } else if (op == "/") {
    if (nums) {
      if (b.as_float() == 0) in.Fail("ZeroDivisionError: division by zero");
      return Value(a.as_float() / b.as_float());
    }
  } else if (op == "//") {
    if (ints) {
      if (b.as_int() == 0) in.Fail("ZeroDivisionError: integer division or modulo by zero");
      if (a.as_int() == INT64_MIN && b.as_int() == -1) CheckedInt(in, true, 0);
      return Value(FloorDiv(a.as_int(), b.as_int()));
    }
    if (nums) {
      if (b.as_float() == 0) in.Fail("ZeroDivisionError: float floor division by zero");
      double d, m;
      FloatDivMod(a.as_float(), b.as_float(), &d, &m);
      return Value(d);
    }
  } else if (op == "%") {
    if (a.is_string()) return Value(PercentFormat(in, a.as_string(), b));
    if (ints) {
      if (b.as_int() == 0) in.Fail("ZeroDivisionError: integer division or modulo by zero");
      if (b.as_int() == -1) return Value(int64_t{0});
      return Value(FloorMod(a.as_int(), b.as_int()));
    }
    if (nums) {
      if (b.as_float() == 0) in.Fail("ZeroDivisionError: float modulo");
      double d, m;
      FloatDivMod(a.as_float(), b.as_float(), &d, &m);
      return Value(m);
    }
  } else if (op == "**") {
    if (ints && b.as_int() >= 0) {
      int64_t base = a.as_int(), e = b.as_int(), r = 1;
      while (e > 0) {
        if ((e & 1) && __builtin_mul_overflow(r, base, &r)) CheckedInt(in, true, 0);
        e >>= 1;
        if (e > 0 && __builtin_mul_overflow(base, base, &base)) CheckedInt(in, true, 0);
      }
      return Value(r);
    }
    if (nums) {
      if (a.as_float() == 0 && b.as_float() < 0) {
        in.Fail("ZeroDivisionError: 0.0 cannot be raised to a negative power");
      }
      const double r = std::pow(a.as_float(), b.as_float());
      if (std::isnan(r) && !std::isnan(a.as_float()) && !std::isnan(b.as_float())) {
        TypeError(in, "a negative number raised to a fractional power is complex");
      }
      if (std::isinf(r) && std::isfinite(a.as_float()) && std::isfinite(b.as_float())) {
        in.Fail("OverflowError: (34, 'Numerical result out of range')");
      }
      return Value(r);
    }
  }
  TypeError(in, absl::StrCat("unsupported operand type(s) for ", op_name, ": ", Quoted(a.TypeName()),
                             " and ", Quoted(b.TypeName())));
}

bool LessThan(Interp& in, const Value& a, const Value& b) {
  if (a.is_undefined()) in.FailUndefined(a);
  if (b.is_undefined()) in.FailUndefined(b);
  if (a.is_number() && b.is_number()) {
    if (IsIntLike(a) && IsIntLike(b)) return a.as_int() < b.as_int();
    return a.as_float() < b.as_float();
  }
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list() && a.is_tuple() == b.is_tuple()) {
    const List& x = a.as_list();
    const List& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!x[i].Equals(y[i])) return LessThan(in, x[i], y[i]);
    }
    return x.size() < y.size();
  }
  TypeError(in, absl::StrCat("'<' not supported between instances of ", Quoted(a.TypeName()),
                             " and ", Quoted(b.TypeName())));
}

bool Contains(Interp& in, const Value& c, const Value& item) {
  switch (c.kind()) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        TypeError(in, absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
      }
      return c.as_string().find(item.as_string()) != std::string::npos;
    case Value::Kind::kList:
      for (const Value& v : c.as_list()) {
        if (v.Equals(item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return c.Find(item) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kIterator:
      for (const Value& v : c.as_iterator().items) {
        if (v.Equals(item)) return true;
      }
      return false;
    default:
      TypeError(in, absl::StrCat("argument of type ", Quoted(c.TypeName()), " is not iterable"));
  }
}

// ---------------------------------------------------------------------------------------------
// Lookups

Value Interp::GetAttr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      FailUndefined(obj);
    case Value::Kind::kDict:
    case Value::Kind::kString:
    case Value::Kind::kList:
      if (obj.is_group() && (name == "grouper" || name == "list")) {
        return obj.as_list()[name == "grouper" ? 0 : 1];
      }
      if (HasMethod(obj, name)) {
        auto c = std::make_shared<Callable>();
        c->name = name;
        c->fn = [obj, name](Interp& in, CallArgs& args) {
          Value r;
          CallMethod(in, obj, name, args, &r);
          return r;
        };
        return Value::Function(std::move(c), obj);
      }
      if (obj.is_dict()) {
        if (const Value* v = obj.Find(name)) return *v;
      }
      return Value::Undefined(name);
    case Value::Kind::kNamespace:
      if (const Value* v = obj.Find(name)) return *v;
      return Value::Undefined(name);
    case Value::Kind::kInt:
    case Value::Kind::kBool:
    case Value::Kind::kFloat:
      if (name == "real") return obj.is_float() ? obj : Value(obj.as_int());
      if (name == "imag") return obj.is_float() ? Value(0.0) : Value(int64_t{0});
      if (!obj.is_float() && name == "numerator") return Value(obj.as_int());
      if (!obj.is_float() && name == "denominator") return Value(int64_t{1});
      return Value::Undefined(name);
    default:
      return Value::Undefined(name);
  }
}

Value Interp::GetItem(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      FailUndefined(obj);
    case Value::Kind::kDict:
      if (const Value* v = obj.Find(key)) return *v;
      break;
    case Value::Kind::kNamespace:
      if (key.is_string()) return GetAttr(obj, key.as_string());
      return Value::Undefined();
    case Value::Kind::kList:
      if (IsIntLike(key)) {
        const List& l = obj.as_list();
        int64_t i = key.as_int();
        if (i < 0) i += static_cast<int64_t>(l.size());
        if (i >= 0 && i < static_cast<int64_t>(l.size())) return l[static_cast<size_t>(i)];
        return Value::Undefined();
      }
      break;
    case Value::Kind::kIterator:
      if (IsIntLike(key) && obj.as_iterator().type == IteratorState::Type::kRange) {
        return GetItem(Value(obj.as_iterator().items), key);
      }
      return Value::Undefined();
    case Value::Kind::kString:
      if (IsIntLike(key)) {
        const std::string& s = obj.as_string();
        int64_t i = key.as_int();
        if (IsAscii(s)) {
          if (i < 0) i += static_cast<int64_t>(s.size());
          if (i >= 0 && i < static_cast<int64_t>(s.size())) return Value(s.substr(static_cast<size_t>(i), 1));
          return Value::Undefined();
        }
        const std::u32string cps = DecodeUtf8(s);
        if (i < 0) i += static_cast<int64_t>(cps.size());
        if (i >= 0 && i < static_cast<int64_t>(cps.size())) {
          std::string out;
          AppendUtf8(cps[static_cast<size_t>(i)], &out);
          return Value(std::move(out));
        }
        return Value::Undefined();
      }
      break;
    default:
      break;
  }
  if (key.is_string()) return GetAttr(obj, key.as_string());
  return Value::Undefined();
}

List Interp::Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kList:
      return v.as_list();
    case Value::Kind::kDict: {
      List keys;
      keys.reserve(v.as_dict().size());
      for (const auto& kv : v.as_dict()) keys.push_back(kv.first);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      const std::string& s = v.as_string();
      if (IsAscii(s)) {
        for (char c : s) chars.push_back(Value(std::string(1, c)));
      } else {
        for (char32_t c : DecodeUtf8(s)) {
          std::string one;
          AppendUtf8(c, &one);
          chars.push_back(Value(std::move(one)));
        }
      }
      return chars;
    }
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kIterator: {
      IteratorState& it = v.as_iterator();
      const bool single_pass = it.type == IteratorState::Type::kGenerator ||
                               it.type == IteratorState::Type::kReverseIterator;
      if (!single_pass) return it.items;
      if (it.consumed) return {};
      it.consumed = true;
      return it.items;
    }
    default:
      TypeError(*this, absl::StrCat(Quoted(v.TypeName()), " object is not iterable"));
  }
}

Value Interp::Lookup(const std::string& name) {
  for (Scope* s = scope_; s != nullptr; s = s->parent) {
    for (auto it = s->vars.rbegin(); it != s->vars.rend(); ++it) {
      if (it->first == name) return it->second;
    }
  }
  if (const Value* v = globals_.Find(name)) return *v;
  if (const Value* v = BuiltinGlobal(name)) return *v;
  return Value::Undefined(name);
}

void Interp::SetVar(const std::string& name, Value v) {
  for (auto& [k, old] : scope_->vars) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  scope_->vars.emplace_back(name, std::move(v));
}

void Interp::Assign(const Target& t, const Value& v) {
  if (t.is_tuple) {
    if (!v.is_list() && !v.is_string() && !v.is_dict() && !v.is_iterator()) {
      TypeError(*this, absl::StrCat("cannot unpack non-iterable ", v.TypeName(), " object"));
    }
    const List items = Iterate(v);
    if (items.size() != t.items.size()) {
      Fail(absl::StrCat("ValueError: ", items.size() < t.items.size() ? "not enough" : "too many",
                        " values to unpack (expected ", t.items.size(), ", got ", items.size(), ")"));
    }
    for (size_t i = 0; i < items.size(); ++i) Assign(t.items[i], items[i]);
    return;
  }
  if (!t.attr.empty()) {
    const Value ns = Lookup(t.name);
    if (!ns.is_namespace()) {
      pos_ = t.pos;
      Fail("TemplateRuntimeError: cannot assign attribute on non-namespace object");
    }
    pos_ = t.pos;
    CheckDepth(v);
    Dict& d = ns.mutable_namespace();
    for (auto& [k, old] : d) {
      if (k.is_string() && k.as_string() == t.attr) {
        old = v;
        return;
      }
    }
    d.emplace_back(Value(t.attr), v);
    return;
  }
  SetVar(t.name, v);
}

// ---------------------------------------------------------------------------------------------
// Expressions

void Interp::EvalArgs(const Expr& e, size_t first, CallArgs* args) {
  const size_t n = e.items.size();
  const size_t nkw = e.kwnames.size();
  for (size_t i = first; i + nkw < n; ++i) args->positional.push_back(Eval(*e.items[i]));
  for (size_t k = 0; k < nkw; ++k) {
    args->keywords.emplace_back(e.kwnames[k], Eval(*e.items[n - nkw + k]));
  }
}

Value Interp::CallValue(const Value& callee, CallArgs& args) {
  Step();
  if (callee.is_callable()) return callee.as_callable().fn(*this, args);
  if (callee.is_dict()) {
    if (const Value* call = callee.Find("__call__"); call != nullptr && call->is_callable()) {
      return call->as_callable().fn(*this, args);
    }
  }
  if (callee.is_undefined()) FailUndefined(callee);
  TypeError(*this, absl::StrCat(Quoted(callee.TypeName()), " object is not callable"));
}

Value Interp::EvalCall(const Expr& e) {
  const Expr& callee = *e.items[0];
  if (callee.kind == ExprKind::kGetAttr) {
    const Value obj = Eval(*callee.items[0]);
    CallArgs args;
    EvalArgs(e, 1, &args);
    pos_ = e.pos;
    Value result;
    if ((obj.is_string() || obj.is_list() || obj.is_dict()) &&
        CallMethod(*this, obj, callee.name, args, &result)) {
      Step();
      return result;
    }
    pos_ = callee.pos;
    const Value f = GetAttr(obj, callee.name);
    pos_ = e.pos;
    return CallValue(f, args);
  }
  const Value f = Eval(callee);
  CallArgs args;
  EvalArgs(e, 1, &args);
  pos_ = e.pos;
  return CallValue(f, args);
}

Value Interp::EvalFilter(const Expr& e, const Value* operand) {
  Value v = operand != nullptr ? *operand : Eval(*e.items[0]);
  CallArgs args;
  EvalArgs(e, 1, &args);
  pos_ = e.pos;
  Step();
  return ApplyResolvedFilter(*this, e.builtin, v, args);
}

bool Interp::EvalTest(const Expr& e) {
  // An undefined x is a value here (`x is defined`); an attribute of one fails in Eval.
  const Value v = Eval(*e.items[0]);
  CallArgs args;
  EvalArgs(e, 1, &args);
  pos_ = e.pos;
  Step();
  const bool r = ApplyResolvedTest(*this, e.builtin, v, args);
  return e.negated ? !r : r;
}

namespace {

// Python's slice indices for a sequence of `len` items.
std::vector<int64_t> SliceIndices(Interp& in, int64_t len, const Value& start, const Value& stop,
                                  const Value& step) {
  const auto as_index = [&](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) {
      if (v.is_undefined() && !v.undefined_name().empty()) in.FailUndefined(v);
      return std::nullopt;
    }
    if (!IsIntLike(v)) {
      TypeError(in, absl::StrCat("slice indices must be integers or None (", what, " is ", v.TypeName(), ")"));
    }
    return v.as_int();
  };
  int64_t st = 1;
  if (auto s = as_index(step, "step")) st = *s;
  if (st == 0) in.Fail("ValueError: slice step cannot be zero");
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v;
    if (x < 0) {
      x += len;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= len) {
      x = st < 0 ? len - 1 : len;
    }
    return x;
  };
  const int64_t lo = clamp(as_index(start, "start"), st < 0 ? len - 1 : 0);
  const int64_t hi = clamp(as_index(stop, "stop"), st < 0 ? -1 : len);
  std::vector<int64_t> idx;
  if (st > 0) {
    for (int64_t i = lo; i < hi; i += st) idx.push_back(i);
  } else {
    for (int64_t i = lo; i > hi; i += st) idx.push_back(i);
  }
  return idx;
}

}  // namespace

Value Interp::Bounded(Value v, const Expr& e) {
  if (v.nodes() > limits_.max_output_bytes) [[unlikely]] {
    pos_ = e.pos;
    CheckDepth(v);
  }
  // What building the value cost: a loop that copies a long string (or list) each time
  // through is bounded by the steps, not only by the size of one copy.
  const size_t size = v.is_string() ? v.as_string().size() >> 10
                      : v.is_list() ? v.as_list().size() >> 7
                                    : 0;
  if (size > 0) {
    steps_ += static_cast<int64_t>(size);
    if (steps_ > limits_.max_steps) {
      pos_ = e.pos;
      Fail("the template exceeded its step limit");
    }
  }
  return v;
}

Value Interp::Eval(const Expr& e) {
  DepthGuard guard(*this, &eval_depth_, kMaxEvalDepth, "expressions");
  Step();
  pos_ = e.pos;
  switch (e.kind) {
    case ExprKind::kLiteral:
      return e.literal;
    case ExprKind::kName:
      return Lookup(e.name);
    case ExprKind::kList:
    case ExprKind::kTuple: {
      List items;
      items.reserve(e.items.size());
      for (const auto& i : e.items) items.push_back(Eval(*i));
      Value v = e.kind == ExprKind::kTuple ? Value::Tuple(std::move(items)) : Value(std::move(items));
      pos_ = e.pos;
      CheckDepth(v);
      return v;
    }
    case ExprKind::kDict: {
      DictBuilder b;
      for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
        Value k = Eval(*e.items[i]);
        if (k.is_list() && !k.is_tuple()) TypeError(*this, "unhashable type: 'list'");
        if (k.is_dict()) TypeError(*this, "unhashable type: 'dict'");
        b.Set(std::move(k), Eval(*e.items[i + 1]));
      }
      Value v = std::move(b).Build();
      pos_ = e.pos;
      CheckDepth(v);
      return v;
    }
    case ExprKind::kGetAttr: {
      const Value obj = Eval(*e.items[0]);
      pos_ = e.pos;
      return GetAttr(obj, e.name);
    }
    case ExprKind::kGetItem: {
      const Value obj = Eval(*e.items[0]);
      const Value key = Eval(*e.items[1]);
      pos_ = e.pos;
      return GetItem(obj, key);
    }
    case ExprKind::kSlice: {
      const Value obj = Eval(*e.items[0]);
      Value parts[3];
      for (int i = 0; i < 3; ++i) {
        parts[i] = e.items[i + 1] != nullptr ? Eval(*e.items[i + 1]) : Value::None();
      }
      pos_ = e.pos;
      if (obj.is_undefined()) FailUndefined(obj);
      if (obj.is_list()) {
        const List& l = obj.as_list();
        List out;
        for (int64_t i : SliceIndices(*this, static_cast<int64_t>(l.size()), parts[0], parts[1], parts[2])) {
          out.push_back(l[static_cast<size_t>(i)]);
        }
        return Bounded(obj.is_tuple() ? Value::Tuple(std::move(out)) : Value(std::move(out)), e);
      }
      if (obj.is_string()) {
        const std::string& s = obj.as_string();
        std::string out;
        if (IsAscii(s)) {
          for (int64_t i : SliceIndices(*this, static_cast<int64_t>(s.size()), parts[0], parts[1], parts[2])) {
            out.push_back(s[static_cast<size_t>(i)]);
          }
        } else {
          const std::u32string cps = DecodeUtf8(s);
          for (int64_t i : SliceIndices(*this, static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2])) {
            AppendUtf8(cps[static_cast<size_t>(i)], &out);
          }
        }
        return Bounded(Value(std::move(out)), e);
      }
      if (obj.is_iterator() && obj.as_iterator().type == IteratorState::Type::kRange) {
        const List& l = obj.as_iterator().items;
        List out;
        for (int64_t i : SliceIndices(*this, static_cast<int64_t>(l.size()), parts[0], parts[1], parts[2])) {
          out.push_back(l[static_cast<size_t>(i)]);
        }
        return Bounded(Value(std::move(out)), e);
      }
      // Python's own error: jinja2 compiles a slice as a plain subscript.
      if (obj.is_dict()) TypeError(*this, "unhashable type: 'slice'");
      TypeError(*this, absl::StrCat(Quoted(obj.TypeName()), " object is not subscriptable"));
    }
    case ExprKind::kCall:
      return Bounded(EvalCall(e), e);
    case ExprKind::kFilter:
      return Bounded(EvalFilter(e, nullptr), e);
    case ExprKind::kTest:
      return Value(EvalTest(e));
    case ExprKind::kNot:
      return Value(!Eval(*e.items[0]).Truthy());
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = Eval(*e.items[0]);
      pos_ = e.pos;
      if (v.is_undefined()) FailUndefined(v);
      if (IsIntLike(v)) {
        if (e.kind == ExprKind::kPos) return Value(v.as_int());
        if (v.as_int() == INT64_MIN) CheckedInt(*this, true, 0);
        return Value(-v.as_int());
      }
      if (v.is_float()) return Value(e.kind == ExprKind::kNeg ? -v.as_float() : v.as_float());
      TypeError(*this, absl::StrCat("bad operand type for unary ", e.kind == ExprKind::kNeg ? "-" : "+",
                                    ": ", Quoted(v.TypeName())));
    }
    case ExprKind::kBinary: {
      const Value a = Eval(*e.items[0]);
      const Value b = Eval(*e.items[1]);
      pos_ = e.pos;
      return Bounded(BinaryOp(*this, e.name, a, b), e);
    }
    case ExprKind::kAnd: {
      Value a = Eval(*e.items[0]);
      if (!a.Truthy()) return a;
      return Eval(*e.items[1]);
    }
    case ExprKind::kOr: {
      Value a = Eval(*e.items[0]);
      if (a.Truthy()) return a;
      return Eval(*e.items[1]);
    }
    case ExprKind::kCompare: {
      Value left = Eval(*e.items[0]);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = Eval(*e.items[i + 1]);
        pos_ = e.pos;
        const std::string& op = e.ops[i];
        bool r;
        if (op == "==") {
          r = left.Equals(right);
        } else if (op == "!=") {
          r = !left.Equals(right);
        } else if (op == "<") {
          r = LessThan(*this, left, right);
        } else if (op == ">") {
          r = LessThan(*this, right, left);
        } else if (op == "<=") {
          r = !LessThan(*this, right, left);
          if (r && !left.Equals(right) && !LessThan(*this, left, right)) r = false;
        } else if (op == ">=") {
          r = !LessThan(*this, left, right);
          if (r && !left.Equals(right) && !LessThan(*this, right, left)) r = false;
        } else if (op == "in") {
          r = Contains(*this, right, left);
        } else {
          r = !Contains(*this, right, left);
        }
        if (!r) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::kCondExpr: {
      if (Eval(*e.items[0]).Truthy()) return Eval(*e.items[1]);
      if (e.items[2] != nullptr) return Eval(*e.items[2]);
      return Value::Undefined();
    }
  }
  return Value::Undefined();
}

// ---------------------------------------------------------------------------------------------
// Statements

void Interp::Run(const Body& body) { Exec(body); }

Value Interp::Render(const Body& body) {
  std::string buffer;
  std::string* saved = out_;
  out_ = &buffer;
  try {
    Exec(body);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return Value(std::move(buffer));
}

Interp::Flow Interp::Exec(const Body& body) {
  for (const auto& n : body) {
    Step();
    const Flow f = ExecNode(*n);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Value Interp::MakeMacro(const Node& n) {
  auto c = std::make_shared<Callable>();
  c->name = n.text;
  const Node* node = &n;
  c->fn = [node](Interp& in, CallArgs& args) -> Value {
    DepthGuard guard(in, &in.call_depth_, in.limits_.max_depth, "macro calls");
    Scope scope;
    scope.parent = &in.root_;
    const auto& params = node->params;
    if (args.positional.size() > params.size() && !node->uses_varargs) {
      TypeError(in, absl::StrCat("macro ", Quoted(node->text), " takes not more than ", params.size(),
                                 " argument(s)"));
    }
    Scope* saved = in.scope_;
    in.scope_ = &scope;
    struct Restore {
      Interp& in;
      Scope* saved;
      ~Restore() { in.scope_ = saved; }
    } restore{in, saved};
    std::vector<bool> used(args.keywords.size(), false);
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      Value v;
      bool found = false;
      if (i < args.positional.size()) {
        v = args.positional[i];
        found = true;
      }
      for (size_t k = 0; k < args.keywords.size(); ++k) {
        if (args.keywords[k].first == p.name) {
          if (found) TypeError(in, absl::StrCat("macro ", Quoted(node->text), " got multiple values for argument ", Quoted(p.name)));
          v = args.keywords[k].second;
          used[k] = true;
          found = true;
        }
      }
      if (!found) {
        v = p.default_value != nullptr ? in.Eval(*p.default_value)
                                       : Value::Undefined(p.name);
      }
      scope.vars.emplace_back(p.name, std::move(v));
    }
    Dict kwargs;
    for (size_t k = 0; k < args.keywords.size(); ++k) {
      if (used[k]) continue;
      const auto& [name, v] = args.keywords[k];
      if (name == "caller" && node->uses_caller) {
        scope.vars.emplace_back("caller", v);
      } else if (node->uses_kwargs) {
        kwargs.emplace_back(Value(name), v);
      } else {
        TypeError(in, absl::StrCat("macro ", Quoted(node->text), " takes no keyword argument ", Quoted(name)));
      }
    }
    if (node->uses_varargs) {
      List extra;
      for (size_t i = params.size(); i < args.positional.size(); ++i) extra.push_back(args.positional[i]);
      scope.vars.emplace_back("varargs", Value::Tuple(std::move(extra)));
    }
    if (node->uses_kwargs) scope.vars.emplace_back("kwargs", Value(std::move(kwargs)));
    return in.Render(node->body);
  };
  return Value::Function(std::move(c));
}

void Interp::ExecFor(const Node& n, const Value& iterable, int depth) {
  pos_ = n.pos;
  // With an `if` filter, jinja2 filters lazily: an item is tested only when the loop reaches
  // it, or when the body's loop.last / loop.length looks ahead to it.
  const List source = Iterate(iterable);
  List items;
  size_t next_source = 0;
  Scope* const outer = scope_;  // the filter sees the loop variable over the enclosing scope
  const auto pull = [&](size_t want) {
    while (items.size() < want && next_source < source.size()) {
      const Value& item = source[next_source++];
      if (n.cond == nullptr) {
        items.push_back(item);
        continue;
      }
      Step();
      Scope s;
      s.parent = outer;
      Scope* const saved = scope_;
      scope_ = &s;
      try {
        Assign(n.target, item);
        const bool keep = Eval(*n.cond).Truthy();
        scope_ = saved;
        if (keep) items.push_back(item);
      } catch (...) {
        scope_ = saved;
        throw;
      }
    }
  };
  const bool lazy = n.cond != nullptr && n.lookahead < 2;
  pull(lazy ? 1 + n.lookahead : source.size());
  if (items.empty()) {
    Exec(n.else_body);
    return;
  }
  // jinja2 runs the else block unless some iteration's body ran to its end (a break or a
  // continue skips the marker).
  bool completed = false;
  // Known when every item is; a lazy loop's body never reads it.
  int64_t len = static_cast<int64_t>(items.size());
  auto index_holder = std::make_shared<int64_t>(0);
  auto cycle = std::make_shared<Callable>();
  cycle->name = "cycle";
  cycle->fn = [index_holder](Interp& in, CallArgs& args) -> Value {
    if (args.positional.empty()) TypeError(in, "no items for cycling given");
    return args.positional[static_cast<size_t>(*index_holder) % args.positional.size()];
  };
  const Value cycle_value = Value::Function(cycle);
  auto last_seen = NewChangedMemory();
  auto changed = std::make_shared<Callable>();
  changed->name = "changed";
  changed->fn = [last_seen](Interp&, CallArgs& args) -> Value {
    const Value now = Value(args.positional);
    if (last_seen->has_value() && Value(**last_seen).Equals(now)) return Value(false);
    *last_seen = args.positional;
    return Value(true);
  };
  const Value changed_value = Value::Function(changed);
  Value recurse;
  if (n.recursive) {
    auto r = std::make_shared<Callable>();
    r->name = "loop";
    const Node* node = &n;
    r->fn = [node, depth](Interp& in, CallArgs& args) -> Value {
      if (args.positional.size() != 1) TypeError(in, "loop() takes exactly one argument");
      DepthGuard guard(in, &in.call_depth_, in.limits_.max_depth, "recursive loops");
      std::string buffer;
      std::string* saved = in.out_;
      in.out_ = &buffer;
      try {
        in.ExecFor(*node, args.positional[0], depth + 1);
      } catch (...) {
        in.out_ = saved;
        throw;
      }
      in.out_ = saved;
      return Value(std::move(buffer));
    };
    recurse = Value::Function(std::move(r));
  }
  Scope s;
  s.parent = scope_;
  scope_ = &s;
  struct Restore {
    Interp& in;
    Scope* parent;
    ~Restore() { in.scope_ = parent; }
  } restore{*this, s.parent};
  for (int64_t i = 0;; ++i) {
    if (lazy) {
      pull(static_cast<size_t>(i) + 1 + static_cast<size_t>(n.lookahead));
      len = static_cast<int64_t>(items.size());
    }
    if (i >= len) break;
    Step();
    *index_holder = i;
    s.vars.clear();
    Assign(n.target, items[static_cast<size_t>(i)]);
    // The keys are made once; a loop object is a dict of this iteration's values.
    static const Value* const keys = new Value[15]{
        Value("index"), Value("index0"), Value("revindex"), Value("revindex0"), Value("first"),
        Value("last"), Value("length"), Value("depth"), Value("depth0"), Value("previtem"),
        Value("nextitem"), Value("cycle"), Value("changed"), Value("__call__"),
        Value::Undefined("loop item")};
    Dict loop;
    loop.reserve(14);
    loop.emplace_back(keys[0], Value(i + 1));
    loop.emplace_back(keys[1], Value(i));
    loop.emplace_back(keys[2], Value(len - i));
    loop.emplace_back(keys[3], Value(len - i - 1));
    loop.emplace_back(keys[4], Value(i == 0));
    loop.emplace_back(keys[5], Value(i == len - 1));
    loop.emplace_back(keys[6], Value(len));
    loop.emplace_back(keys[7], Value(int64_t{depth}));
    loop.emplace_back(keys[8], Value(int64_t{depth - 1}));
    loop.emplace_back(keys[9], i > 0 ? items[static_cast<size_t>(i - 1)] : keys[14]);
    loop.emplace_back(keys[10], i + 1 < len ? items[static_cast<size_t>(i + 1)] : keys[14]);
    loop.emplace_back(keys[11], cycle_value);
    loop.emplace_back(keys[12], changed_value);
    if (n.recursive) loop.emplace_back(keys[13], recurse);
    s.vars.emplace_back("loop", Value(std::move(loop)));
    const Flow f = Exec(n.body);
    if (f == Flow::kBreak) break;
    if (f == Flow::kNormal) completed = true;
  }
  if (!completed && !n.else_body.empty()) {
    scope_ = s.parent;
    Exec(n.else_body);
  }
}

Interp::Flow Interp::ExecNode(const Node& n) {
  switch (n.kind) {
    case NodeKind::kText:
      CheckSize(out_->size() + n.text.size());
      out_->append(n.text);
      return Flow::kNormal;
    case NodeKind::kPrint: {
      const Value v = Eval(*n.expr);
      if (v.is_string()) {
        CheckSize(out_->size() + v.as_string().size());
        out_->append(v.as_string());
      } else {
        const std::string s = Str(v);
        CheckSize(out_->size() + s.size());
        out_->append(s);
      }
      return Flow::kNormal;
    }
    case NodeKind::kIf:
      for (size_t i = 0; i < n.conds.size(); ++i) {
        if (Eval(*n.conds[i]).Truthy()) return Exec(n.bodies[i]);
      }
      if (n.bodies.size() > n.conds.size()) return Exec(n.bodies.back());
      return Flow::kNormal;
    case NodeKind::kFor: {
      const Value iterable = Eval(*n.expr);
      ExecFor(n, iterable, 1);
      return Flow::kNormal;
    }
    case NodeKind::kSet: {
      const Value v = Eval(*n.expr);
      Assign(n.target, v);
      return Flow::kNormal;
    }
    case NodeKind::kSetBlock: {
      Value v = Render(n.body);
      for (const auto& f : n.filters) v = EvalFilter(*f, &v);
      Assign(n.target, v);
      return Flow::kNormal;
    }
    case NodeKind::kMacro:
      SetVar(n.text, MakeMacro(n));
      return Flow::kNormal;
    case NodeKind::kCallBlock: {
      auto c = std::make_shared<Callable>();
      c->name = "caller";
      const Node* node = &n;
      // The caller sees the call site's variables while the call block runs. A macro may keep
      // it (`{% set ns.c = caller %}`) past the block, whose scope is then gone: called later,
      // it sees the template's top-level variables.
      Scope* site = scope_;
      auto site_alive = std::make_shared<bool>(true);
      struct SiteEnds {
        std::shared_ptr<bool> alive;
        ~SiteEnds() { *alive = false; }
      } site_ends{site_alive};
      c->fn = [node, site, site_alive](Interp& in, CallArgs& args) -> Value {
        DepthGuard guard(in, &in.call_depth_, in.limits_.max_depth, "macro calls");
        Scope scope;
        scope.parent = *site_alive ? site : &in.root_;
        for (size_t i = 0; i < node->params.size(); ++i) {
          const Param& p = node->params[i];
          const Value* v = args.Get(i, p.name);
          scope.vars.emplace_back(p.name, v != nullptr ? *v
                                          : p.default_value != nullptr ? in.Eval(*p.default_value)
                                                                       : Value::Undefined(p.name));
        }
        Scope* saved = in.scope_;
        in.scope_ = &scope;
        struct Restore {
          Interp& in;
          Scope* saved;
          ~Restore() { in.scope_ = saved; }
        } restore{in, saved};
        return in.Render(node->body);
      };
      const Expr& call = *n.expr;
      const Value f = Eval(*call.items[0]);
      CallArgs args;
      EvalArgs(call, 1, &args);
      args.keywords.emplace_back("caller", Value::Function(std::move(c)));
      pos_ = call.pos;
      const Value r = CallValue(f, args);
      const std::string s = Str(r);
      CheckSize(out_->size() + s.size());
      out_->append(s);
      return Flow::kNormal;
    }
    case NodeKind::kFilterBlock: {
      Value v = Render(n.body);
      for (const auto& f : n.filters) v = EvalFilter(*f, &v);
      const std::string s = Str(v);
      CheckSize(out_->size() + s.size());
      out_->append(s);
      return Flow::kNormal;
    }
    case NodeKind::kBreak:
      return Flow::kBreak;
    case NodeKind::kContinue:
      return Flow::kContinue;
    case NodeKind::kWith: {
      std::vector<Value> values;
      for (const auto& e : n.conds) values.push_back(Eval(*e));
      Scope s;
      s.parent = scope_;
      scope_ = &s;
      struct Restore {
        Interp& in;
        Scope* parent;
        ~Restore() { in.scope_ = parent; }
      } restore{*this, s.parent};
      for (size_t i = 0; i < values.size(); ++i) Assign(n.targets[i], values[i]);
      return Exec(n.body);
    }
    case NodeKind::kScope:
      return Exec(n.body);
  }
  return Flow::kNormal;
}

}  // namespace kvgrid::model::jinja
