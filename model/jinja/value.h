// The values a Jinja template computes with, with Python's semantics as jinja2 gives them:
// undefined, None, booleans, 64-bit integers, floats, strings (UTF-8; length, indexing and
// slicing count code points), lists, dicts (insertion-ordered), and the objects templates
// call: namespaces (mutable through `{% set ns.x = ... %}`), macros and built-in functions.
//
// Lists and dicts are immutable once built (the sandbox forbids mutating methods), so copies
// share them; only a namespace is shared and mutable, as in jinja2.
//
// Thread-safety: a Value may be read from several threads when no namespace in it is being
// assigned.
#ifndef KVGRID_MODEL_JINJA_VALUE_H_
#define KVGRID_MODEL_JINJA_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::model::jinja {

class Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<Value, Value>>;  // insertion order; keys unique

struct Callable;  // a macro, a built-in function or a bound method (interp.h)

// What Python hands templates where jinja2's filters and dict methods return no list: a
// generator (select, map, unique, ...), a reverse iterator, a dict view or a range. Their
// items are computed eagerly, but they keep Python's behaviour: a generator or iterator is
// always true, has no len(), is not JSON, and is used up by one iteration; a view or a range
// has a len() and is true when not empty; only a range can be indexed.
struct IteratorState {
  enum class Type { kGenerator, kReverseIterator, kDictKeys, kDictValues, kDictItems, kRange };
  Type type;
  List items;
  std::string repr;       // a range's "range(0, 3)"
  bool consumed = false;  // generators and iterators: iterated once already
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace,
                    kCallable, kIterator };

  Value() = default;  // undefined
  static Value None() { Value v; v.kind_ = Kind::kNone; return v; }
  static Value Undefined(std::string name = {});  // `name` is what was looked up, for errors
  Value(bool b) : kind_(Kind::kBool), int_(b) {}  // NOLINT: implicit like Python
  Value(int i) : kind_(Kind::kInt), int_(i) {}    // NOLINT
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}  // NOLINT
  Value(double d) : kind_(Kind::kFloat), float_(d) {}  // NOLINT
  Value(std::string s);       // NOLINT
  Value(std::string_view s);  // NOLINT
  Value(const char* s) : Value(std::string_view(s)) {}  // NOLINT
  Value(List list);  // NOLINT
  Value(Dict dict);  // NOLINT; keys must be unique (use DictBuilder otherwise)
  static Value Tuple(List items);  // a list that prints as "(a, b)"
  // A string marked safe (jinja2's Markup, from |safe and |escape), which |escape leaves as is.
  static Value Markup(std::string s);
  static Value Namespace(Dict initial);
  static Value Function(std::shared_ptr<const Callable> callable);
  // A function that keeps `held` (a bound method's object, joiner's separator): it counts
  // as holding it in depth() and nodes(), so chains of them are bounded like nested lists.
  static Value Function(std::shared_ptr<const Callable> callable, const Value& held);
  static Value Iterator(IteratorState::Type type, List items, std::string repr = {});

  // A dict or list from JSON text (objects keep their key order; integers that fit int64 stay
  // integers, others are floats). Errors: INVALID_ARGUMENT naming `source` and the position.
  static absl::StatusOr<Value> FromJson(std::string_view json_text, std::string_view source);

  [[nodiscard]] Kind kind() const { return kind_; }
  [[nodiscard]] bool is_undefined() const { return kind_ == Kind::kUndefined; }
  [[nodiscard]] bool is_none() const { return kind_ == Kind::kNone; }
  [[nodiscard]] bool is_bool() const { return kind_ == Kind::kBool; }
  [[nodiscard]] bool is_int() const { return kind_ == Kind::kInt; }
  [[nodiscard]] bool is_float() const { return kind_ == Kind::kFloat; }
  [[nodiscard]] bool is_number() const { return is_int() || is_float() || is_bool(); }
  [[nodiscard]] bool is_string() const { return kind_ == Kind::kString; }
  [[nodiscard]] bool is_list() const { return kind_ == Kind::kList; }
  [[nodiscard]] bool is_dict() const { return kind_ == Kind::kDict; }
  [[nodiscard]] bool is_namespace() const { return kind_ == Kind::kNamespace; }
  [[nodiscard]] bool is_callable() const { return kind_ == Kind::kCallable; }
  [[nodiscard]] bool is_iterator() const { return kind_ == Kind::kIterator; }
  // Whether identity (Python's `is`) holds: the same list, dict, namespace or function.
  [[nodiscard]] bool SameObject(const Value& other) const {
    return kind_ == other.kind_ && ptr_ != nullptr && ptr_ == other.ptr_;
  }
  // The shared object behind a string, list, dict, namespace or function (null otherwise).
  [[nodiscard]] const void* identity() const { return ptr_.get(); }

  [[nodiscard]] bool is_tuple() const { return kind_ == Kind::kList && tuple_; }
  // groupby's (grouper, list) named tuples, which also answer .grouper and .list.
  [[nodiscard]] bool is_group() const { return is_tuple() && group_; }
  static Value Group(Value grouper, List items);
  [[nodiscard]] bool is_markup() const { return kind_ == Kind::kString && tuple_; }
  // Levels of lists and dicts in this value (0 for a scalar), which the interpreter bounds so
  // that printing, comparing and serializing never recurse without limit.
  [[nodiscard]] int depth() const { return depth_; }
  // The values printing, comparing or serializing this one visits: 1 for a scalar, a namespace
  // or a function; a list or dict adds its elements' (keys' and values') counts, a value it
  // holds twice counted twice (saturating at 2^32 - 1). The interpreter bounds it, so that a
  // small value sharing its parts (`[x, x]`, doubled again and again) cannot stand for an
  // exponential amount of work.
  [[nodiscard]] int64_t nodes() const { return nodes_; }

  [[nodiscard]] bool as_bool() const { return int_ != 0; }
  [[nodiscard]] int64_t as_int() const { return int_; }  // bools are 0/1
  [[nodiscard]] double as_float() const { return is_float() ? float_ : static_cast<double>(int_); }
  [[nodiscard]] const std::string& as_string() const {
    return *static_cast<const std::string*>(ptr_.get());
  }
  [[nodiscard]] const List& as_list() const { return *static_cast<const List*>(ptr_.get()); }
  // Dicts and namespaces.
  [[nodiscard]] const Dict& as_dict() const { return *static_cast<const Dict*>(ptr_.get()); }
  // A namespace's attributes, which `{% set ns.x = ... %}` assigns. As in jinja2, == and
  // tojson never look inside a namespace and repr guards against meeting one inside itself,
  // so its attributes may come to hold the namespace without making those walks endless.
  [[nodiscard]] Dict& mutable_namespace() const {
    return *static_cast<Dict*>(const_cast<void*>(ptr_.get()));
  }
  [[nodiscard]] const Callable& as_callable() const {
    return *static_cast<const Callable*>(ptr_.get());
  }
  [[nodiscard]] IteratorState& as_iterator() const {
    return *static_cast<IteratorState*>(const_cast<void*>(ptr_.get()));
  }
  // For an undefined value: the name that was looked up ("" when unknown).
  [[nodiscard]] const std::string& undefined_name() const;

  // Python's truth value (undefined is false).
  [[nodiscard]] bool Truthy() const;
  // Python's ==: 1 == 1.0 == True; lists and dicts compare by element; undefined equals only
  // undefined.
  [[nodiscard]] bool Equals(const Value& other) const;
  // The value stored under `key` in a dict or namespace, or null.
  [[nodiscard]] const Value* Find(const Value& key) const;
  [[nodiscard]] const Value* Find(std::string_view key) const;
  [[nodiscard]] const Value* Find(const char* key) const { return Find(std::string_view(key)); }
  [[nodiscard]] const Value* Find(const std::string& key) const {
    return Find(std::string_view(key));
  }

  // str(x) in Python: None -> "None", True -> "True", 1.0 -> "1.0", lists and dicts as their
  // repr ("['a', 1]"), undefined -> "". A list, dict or namespace inside itself prints as
  // "[...]", "(...)" or "{...}". Writing stops once the text is longer than `max_bytes`, so
  // that no value costs more to print than the limit its caller then enforces (values that
  // share their parts, or hold one long string many times, would otherwise expand without
  // bound).
  [[nodiscard]] std::string Str(int64_t max_bytes = INT64_MAX) const;
  // repr(x) in Python, with Str's guards.
  [[nodiscard]] std::string Repr(int64_t max_bytes = INT64_MAX) const;
  // The name Python gives the type, for error messages ("str", "int", "dict", ...).
  [[nodiscard]] const char* TypeName() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;  // a tuple (lists), Markup (strings)
  bool group_ = false;  // a groupby tuple
  int32_t depth_ = 0;
  uint32_t nodes_ = 1;
  union {
    int64_t int_ = 0;
    double float_;
  };
  // The string (also an undefined value's name), list, dict or callable, by kind.
  std::shared_ptr<const void> ptr_;
};

// Builds a dict whose later Set of a key replaces the earlier value in place (as Python's
// dict assignment does).
class DictBuilder {
 public:
  DictBuilder& Set(Value key, Value value);
  DictBuilder& Set(std::string_view key, Value value) { return Set(Value(key), std::move(value)); }
  DictBuilder& Set(const char* key, Value value) { return Set(Value(key), std::move(value)); }
  DictBuilder& Set(const std::string& key, Value value) {
    return Set(Value(key), std::move(value));
  }
  [[nodiscard]] Value Build() && { return Value(std::move(dict_)); }

 private:
  Dict dict_;
};

// Python's repr of a float: the shortest text that reads back as the same double, "1.0",
// "1e-05", "1e+16", "inf", "nan".
std::string FloatRepr(double d);

}  // namespace kvgrid::model::jinja

#endif  // KVGRID_MODEL_JINJA_VALUE_H_
