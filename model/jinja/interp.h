// The tree-walking interpreter behind jinja::Template, and the pieces the built-ins
// (builtins.cc) share with it: errors thrown while rendering, call arguments, callables and
// Python's operators. Internal to model/jinja.
#ifndef KVGRID_MODEL_JINJA_INTERP_H_
#define KVGRID_MODEL_JINJA_INTERP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/jinja/ast.h"
#include "model/jinja/template.h"
#include "model/jinja/value.h"

namespace kvgrid::model::jinja {

// What jinja2 would raise. Thrown inside the interpreter only; Template::Render turns it into
// a Status with the position.
struct RenderError {
  Pos pos;
  std::string message;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;

  // The argument at `index` or named `name`, or null; a keyword matched is marked used.
  const Value* Get(size_t index, std::string_view name);
  // Fails naming `function` when an argument was neither positional within `max_positional`
  // nor a keyword taken by Get.
  void CheckAllUsed(class Interp& in, std::string_view function, size_t max_positional) const;
  std::vector<bool> used;
};

class Interp;

// A macro, a built-in function or a bound method.
struct Callable {
  std::string name;
  std::function<Value(Interp&, CallArgs&)> fn;
};

class Interp {
 public:
  Interp(const RenderLimits& limits, const Value& globals, std::string* out)
      : limits_(limits), globals_(globals), out_(out) {}
  ~Interp();
  Interp(const Interp&) = delete;
  Interp& operator=(const Interp&) = delete;

  // Renders `body` at the top level. Throws RenderError.
  void Run(const Body& body);

  // Lists and dicts it builds (literals, and what calls, filters and operators return) are
  // bounded by CheckDepth, so no value the template can name stands for unbounded work.
  Value Eval(const Expr& e);
  // Calls `callee` (a macro, built-in or method) with `args`.
  Value CallValue(const Value& callee, CallArgs& args);

  // One unit of work; throws once the step budget is spent.
  void Step() {
    if (++steps_ > limits_.max_steps) Fail("the template exceeded its step limit");
  }
  // Throws when a string of `bytes` would exceed the size limit.
  void CheckSize(size_t bytes) {
    if (static_cast<int64_t>(bytes) > limits_.max_output_bytes) {
      Fail("the template built a string or list larger than its size limit");
    }
  }
  // str(v) and repr(v), within the size limit (throwing beyond it).
  std::string Str(const Value& v) {
    std::string s = v.Str(limits_.max_output_bytes);
    CheckSize(s.size());
    return s;
  }
  std::string Repr(const Value& v) {
    std::string s = v.Repr(limits_.max_output_bytes);
    CheckSize(s.size());
    return s;
  }
  [[noreturn]] void Fail(std::string message) const { throw RenderError{pos_, std::move(message)}; }
  // Throws when `v` nests lists and dicts deeper than the interpreter allows, or holds more
  // elements (Value::nodes) than the size limit.
  void CheckDepth(const Value& v) const;
  // UndefinedError for using an undefined value.
  [[noreturn]] void FailUndefined(const Value& v) const;

  // Environment lookups jinja2 makes: obj.name and obj[key].
  Value GetAttr(const Value& obj, const std::string& name);
  Value GetItem(const Value& obj, const Value& key);

  // The values of an iterable (list, tuple, dict keys, string characters, undefined: none).
  List Iterate(const Value& v);

  // A namespace, and the memory of a loop's changed(): the only values that change after they
  // are built, so the only way a value comes to hold itself (`{% set ns.me = [ns] %}`,
  // `loop.changed(loop)`). The interpreter keeps each until the render ends and then empties
  // it, so that no reference cycle outlives the render and no chain of them is freed
  // recursively while it runs.
  Value NewNamespace(Dict initial);
  std::shared_ptr<std::optional<List>> NewChangedMemory();

  [[nodiscard]] const RenderLimits& limits() const { return limits_; }
  Pos pos_;  // of the node being evaluated, for errors

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  struct Scope {
    std::vector<std::pair<std::string, Value>> vars;
    Scope* parent = nullptr;
  };

  Flow Exec(const Body& body);
  Flow ExecNode(const Node& n);
  void ExecFor(const Node& n, const Value& iterable, int depth);
  void Assign(const Target& t, const Value& v);
  void SetVar(const std::string& name, Value v);
  Value Lookup(const std::string& name);
  // CheckDepth at e, and the steps building `v` took.
  Value Bounded(Value v, const Expr& e);
  Value EvalCall(const Expr& e);
  Value EvalFilter(const Expr& e, const Value* operand);
  bool EvalTest(const Expr& e);
  void EvalArgs(const Expr& e, size_t first, CallArgs* args);
  Value MakeMacro(const Node& n);
  Value Render(const Body& body);  // into a string of its own

  const RenderLimits& limits_;
  const Value& globals_;
  std::string* out_;
  Scope root_;
  Scope* scope_ = &root_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
  int eval_depth_ = 0;
  std::vector<Value> namespaces_;
  std::vector<std::shared_ptr<std::optional<List>>> changed_memories_;
};

// Python's operators. Throw RenderError (TypeError, ZeroDivisionError, ...) through `in`.
Value BinaryOp(Interp& in, std::string_view op, const Value& a, const Value& b);
// a < b (and the others through it); TypeError for types Python cannot order.
bool LessThan(Interp& in, const Value& a, const Value& b);
bool Contains(Interp& in, const Value& container, const Value& item);
// Markup's escaping (& < > " ').
std::string EscapeHtml(const std::string& s);
// `fmt % args` for strings.
std::string PercentFormat(Interp& in, const std::string& fmt, const Value& args);

// The built-ins (builtins.cc). `filter` and `test` are the parser's ResolveFilter/ResolveTest.
Value ApplyResolvedFilter(Interp& in, const void* filter, const Value& v, CallArgs& args);
bool ApplyResolvedTest(Interp& in, const void* test, const Value& v, CallArgs& args);
Value ApplyFilter(Interp& in, const std::string& name, const Value& v, CallArgs& args);
bool ApplyTest(Interp& in, const std::string& name, const Value& v, CallArgs& args);
// A method of a str, list or dict (`"a".upper()`); false when there is none of that name.
bool CallMethod(Interp& in, const Value& obj, const std::string& name, CallArgs& args,
                Value* result);
bool HasMethod(const Value& obj, const std::string& name);
// range, dict, namespace, raise_exception, strftime_now, joiner, cycler; null when unknown.
const Value* BuiltinGlobal(const std::string& name);

}  // namespace kvgrid::model::jinja

#endif  // KVGRID_MODEL_JINJA_INTERP_H_
