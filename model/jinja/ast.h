// The parsed form of a Jinja template: expressions and statements, each with its position in
// the source for error messages. Built by ParseProgram (parser.cc), walked by the interpreter
// (interp.cc). Internal to model/jinja.
#ifndef KVGRID_MODEL_JINJA_AST_H_
#define KVGRID_MODEL_JINJA_AST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "model/jinja/value.h"

namespace kvgrid::model::jinja {

struct Pos {
  int line = 1;
  int column = 1;
};

enum class ExprKind {
  kLiteral,   // literal
  kName,      // name
  kList,      // items
  kTuple,     // items
  kDict,      // items: key0, value0, key1, value1, ...
  kGetAttr,   // items[0] . name
  kGetItem,   // items[0] [ items[1] ]
  kSlice,     // items[0] [ items[1] : items[2] : items[3] ]; absent parts are null
  kCall,      // items[0] ( items[1..] ); the last kwnames.size() arguments are keywords
  kFilter,    // items[0] | name ( items[1..] ); items[0] is null in a filter block
  kTest,      // items[0] is [not] name ( items[1..] )
  kNot,       // not items[0]
  kNeg,       // - items[0]
  kPos,       // + items[0]
  kBinary,    // items[0] op items[1]: + - * / // % ** ~
  kAnd,       // items[0] and items[1]
  kOr,        // items[0] or items[1]
  kCompare,   // items[0] ops[0] items[1] ops[1] items[2] ...: == != < <= > >= in notin
  kCondExpr,  // items[1] if items[0] else items[2] (items[2] null without else)
};

struct Expr {
  ExprKind kind;
  Pos pos;
  Value literal;                  // kLiteral
  std::string name;               // kName, kGetAttr, kFilter, kTest; kBinary: the operator
  std::vector<std::string> ops;   // kCompare
  std::vector<std::string> kwnames;  // kCall, kFilter, kTest: names of the keyword arguments
  bool negated = false;           // kTest: `is not`
  int depth = 0;                  // of the tree below (bounded by the parser)
  const void* builtin = nullptr;  // kFilter, kTest: ResolveFilter / ResolveTest of name
  std::vector<std::unique_ptr<Expr>> items;
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

enum class NodeKind {
  kText,         // text
  kPrint,        // {{ expr }}
  kIf,           // conds[i] -> bodies[i]; a last body without cond is the else branch
  kFor,          // for target in expr [if cond] body [else else_body]
  kSet,          // set target = expr
  kSetBlock,     // set target [| filters] body endset
  kMacro,        // macro name(params) body
  kCallBlock,    // call[(params)] expr body
  kFilterBlock,  // filter filters body
  kBreak,
  kContinue,
  kWith,         // with targets = values body
  kScope,        // a body rendered as is (generation, block)
};

// An assignment target: a name, `ns.attr`, or a tuple of names.
struct Target {
  Pos pos;
  std::string name;                // a name, or the namespace's name for ns.attr
  std::string attr;                // ns.attr
  std::vector<Target> items;       // a tuple
  bool is_tuple = false;
};

struct Param {
  std::string name;
  std::unique_ptr<Expr> default_value;  // null: required
};

struct Node {
  NodeKind kind;
  Pos pos;
  std::string text;                       // kText; kMacro: the macro's name
  std::unique_ptr<Expr> expr;             // kPrint, kFor (iterable), kSet, kCallBlock (the call)
  std::unique_ptr<Expr> cond;             // kFor: the `if` filter
  std::vector<std::unique_ptr<Expr>> conds;  // kIf; kWith: values
  std::vector<Body> bodies;               // kIf
  Target target;                          // kFor, kSet, kSetBlock
  std::vector<Target> targets;            // kWith
  std::vector<Param> params;              // kMacro, kCallBlock (the caller's)
  std::vector<std::unique_ptr<Expr>> filters;  // kSetBlock, kFilterBlock: chained kFilter
  Body body;
  Body else_body;                         // kFor
  bool recursive = false;                 // kFor
  // kFor with an `if` filter: how far ahead of the current item the body's `loop` looks, so
  // the filter runs on later items only as jinja2's lazy loop would (0: not at all, 1:
  // loop.last / loop.nextitem, 2: loop.length / revindex or `loop` itself, all of them).
  int lookahead = 2;
  // kMacro: whether the body reads `varargs`, `kwargs` or `caller` (jinja2 accepts extra
  // arguments only then).
  bool uses_varargs = false;
  bool uses_kwargs = false;
  bool uses_caller = false;
};

// Parses a template with transformers' lexer settings (trim_blocks, lstrip_blocks,
// keep_trailing_newline=False). Errors: INVALID_ARGUMENT "<name>:<line>:<column>: <what>".
absl::StatusOr<Body> ParseProgram(std::string_view source, std::string_view name);

// The filter or test of this name (builtins.cc), or null; the parser refuses others, as jinja2
// does at compile time, and keeps the handle so a render looks nothing up by name.
const void* ResolveFilter(std::string_view name);
const void* ResolveTest(std::string_view name);

}  // namespace kvgrid::model::jinja

#endif  // KVGRID_MODEL_JINJA_AST_H_
