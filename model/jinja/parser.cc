// Lexer and recursive-descent parser for Jinja templates, following jinja2's grammar and
// operator precedence (lexer.py, parser.py): or < and < not < comparisons < + - < ~ < * / // %
// < ** < unary - + < postfix (. [] ()) and filters/tests.
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/jinja/ast.h"
#include "model/jinja/unicode.h"
#include "model/json_util.h"

namespace kvgrid::model::jinja {
namespace {

constexpr size_t kMaxSourceBytes = size_t{1} << 20;
constexpr int kMaxParseDepth = 200;
constexpr int kMaxExprDepth = 400;

enum class Tok { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat,
                 kOp, kEof };

struct Token {
  Tok type;
  std::string text;  // data, name, string value, operator
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;
};

struct SyntaxError {
  size_t offset;
  std::string message;
};

bool IsWs(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

std::string_view RStrip(std::string_view s) {
  while (!s.empty() && IsWs(s.back())) s.remove_suffix(1);
  return s;
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {}

  std::vector<Token> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      const size_t open = FindOpen(pos);
      if (open == std::string_view::npos) {
        Emit(Tok::kData, std::string(src_.substr(pos)), pos);
        break;
      }
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const char sign = open + 2 < src_.size() ? src_[open + 2] : '\0';
      std::string_view text = src_.substr(pos, open - pos);
      if (sign == '-') {
        text = RStrip(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: drop the spaces and tabs between a line start and a block tag.
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string_view::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          std::string_view rest = text.substr(l_pos);
          bool all_ws = !rest.empty();
          for (char c : rest) all_ws = all_ws && IsWs(c);
          if (all_ws) text = text.substr(0, l_pos);
        }
      }
      if (!text.empty()) Emit(Tok::kData, std::string(text), pos);
      size_t p = open + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        p = EndComment(open, p, &line_starting);
      } else if (kind == '%' && IsRawBegin(p)) {
        p = Raw(open, p, &line_starting);
      } else {
        Emit(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", open);
        p = Tag(kind, p, &line_starting);
      }
      pos = p;
    }
    Emit(Tok::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  size_t FindOpen(size_t pos) const {
    while (true) {
      pos = src_.find('{', pos);
      if (pos == std::string_view::npos || pos + 1 >= src_.size()) return std::string_view::npos;
      const char c = src_[pos + 1];
      if (c == '{' || c == '%' || c == '#') return pos;
      ++pos;
    }
  }

  void Emit(Tok type, std::string text, size_t offset) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    t.offset = offset;
    tokens_.push_back(std::move(t));
  }

  // After a block or comment end: `-` strips all following whitespace; `+` nothing; otherwise
  // trim_blocks removes one newline.
  size_t AfterBlockEnd(char modifier, size_t p, bool* line_starting) {
    if (modifier == '-') {
      while (p < src_.size() && IsWs(src_[p])) ++p;
      *line_starting = p > 0 && src_[p - 1] == '\n';
    } else if (modifier != '+' && p < src_.size() && src_[p] == '\n') {
      ++p;
      *line_starting = true;
    } else {
      *line_starting = false;
    }
    return p;
  }

  size_t EndComment(size_t open, size_t p, bool* line_starting) {
    const size_t end = src_.find("#}", p);
    if (end == std::string_view::npos) throw SyntaxError{open, "unclosed comment (missing '#}')"};
    char modifier = '\0';
    if (end > p && (src_[end - 1] == '-' || src_[end - 1] == '+')) modifier = src_[end - 1];
    return AfterBlockEnd(modifier, end + 2, line_starting);
  }

  bool IsRawBegin(size_t p) const {
    while (p < src_.size() && IsWs(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && IsWs(src_[p])) ++p;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    return src_.compare(p, 2, "%}") == 0;
  }

  size_t Raw(size_t open, size_t p, bool* line_starting) {
    // The begin tag: `-%}` strips what follows; a plain `%}` keeps its newline (as jinja2).
    while (IsWs(src_[p])) ++p;
    p += 3;
    while (IsWs(src_[p])) ++p;
    if (src_[p] == '-') {
      p += 3;
      while (p < src_.size() && IsWs(src_[p])) ++p;
    } else {
      p += src_[p] == '+' ? 3 : 2;
    }
    // Find `{%[-+]? endraw [-+]?%}`.
    size_t search = p;
    while (true) {
      const size_t s = src_.find("{%", search);
      if (s == std::string_view::npos) throw SyntaxError{open, "unclosed raw block (missing endraw)"};
      size_t q = s + 2;
      char open_sign = '\0';
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) open_sign = src_[q++];
      while (q < src_.size() && IsWs(src_[q])) ++q;
      if (src_.compare(q, 6, "endraw") != 0) {
        search = s + 2;
        continue;
      }
      q += 6;
      while (q < src_.size() && IsWs(src_[q])) ++q;
      char close_sign = '\0';
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) close_sign = src_[q++];
      if (src_.compare(q, 2, "%}") != 0) {
        search = s + 2;
        continue;
      }
      std::string_view data = src_.substr(p, s - p);
      if (open_sign == '-') data = RStrip(data);
      if (!data.empty()) Emit(Tok::kData, std::string(data), p);
      return AfterBlockEnd(close_sign, q + 2, line_starting);
    }
  }

  // Expression tokens up to the tag's end (`}}` or `%}`, recognized only where brackets
  // balance, as jinja2 does).
  size_t Tag(char kind, size_t p, bool* line_starting) {
    const size_t open = p;
    int balance = 0;
    while (true) {
      while (p < src_.size() && IsWs(src_[p])) ++p;
      if (p >= src_.size()) {
        throw SyntaxError{open, kind == '{' ? "unexpected end of template, expected '}}'"
                                            : "unexpected end of template, expected '%}'"};
      }
      const char c = src_[p];
      if (balance == 0) {
        const char close = kind == '{' ? '}' : '%';
        // `-}}` / `-%}` / `+%}` / `}}` / `%}`
        size_t q = p;
        char modifier = '\0';
        if ((c == '-' || (c == '+' && kind == '%')) && q + 1 < src_.size() && src_[q + 1] == close &&
            q + 2 < src_.size() && src_[q + 2] == '}') {
          modifier = c;
          ++q;
        }
        if (src_[q] == close && q + 1 < src_.size() && src_[q + 1] == '}') {
          Emit(kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, "", p);
          q += 2;
          if (kind == '{') {
            if (modifier == '-') {
              while (q < src_.size() && IsWs(src_[q])) ++q;
            }
            *line_starting = q > 0 && src_[q - 1] == '\n';
            return q;
          }
          return AfterBlockEnd(modifier, q, line_starting);
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t q = p;
        while (q < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[q])) || src_[q] == '_')) ++q;
        Emit(Tok::kName, std::string(src_.substr(p, q - p)), p);
        p = q;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        p = Number(p);
        continue;
      }
      if (c == '\'' || c == '"') {
        p = String(p);
        continue;
      }
      static constexpr const char* kOps2[] = {"//", "**", "==", "!=", "<=", ">="};
      bool matched = false;
      for (const char* op : kOps2) {
        if (src_.compare(p, 2, op) == 0) {
          Emit(Tok::kOp, op, p);
          p += 2;
          matched = true;
          break;
        }
      }
      if (matched) continue;
      if (std::strchr("+-*/%~[](){}<>=.:|,;", c) != nullptr) {
        if (c == '(' || c == '[' || c == '{') ++balance;
        if (c == ')' || c == ']' || c == '}') {
          if (balance == 0) throw SyntaxError{p, absl::StrCat("unexpected '", std::string(1, c), "'")};
          --balance;
        }
        Emit(Tok::kOp, std::string(1, c), p);
        ++p;
        continue;
      }
      throw SyntaxError{p, absl::StrCat("unexpected character '", std::string(1, c), "'")};
    }
  }

  size_t Digits(size_t p) const {
    // digits with single underscores between them
    while (p < src_.size()) {
      if (std::isdigit(static_cast<unsigned char>(src_[p]))) {
        ++p;
      } else if (src_[p] == '_' && p + 1 < src_.size() &&
                 std::isdigit(static_cast<unsigned char>(src_[p + 1])) && p > 0 &&
                 std::isdigit(static_cast<unsigned char>(src_[p - 1]))) {
        ++p;
      } else {
        break;
      }
    }
    return p;
  }

  size_t Number(size_t p) {
    const size_t start = p;
    const bool after_dot = p > 0 && src_[p - 1] == '.';
    // 0x / 0o / 0b
    if (src_[p] == '0' && p + 1 < src_.size() && std::strchr("xXoObB", src_[p + 1]) != nullptr &&
        src_[p + 1] != '\0') {
      const char base_c = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[p + 1])));
      const int base = base_c == 'x' ? 16 : base_c == 'o' ? 8 : 2;
      size_t q = p + 2;
      std::string digits;
      while (q < src_.size() && (std::isxdigit(static_cast<unsigned char>(src_[q])) || src_[q] == '_')) {
        if (src_[q] != '_') digits.push_back(src_[q]);
        ++q;
      }
      if (!digits.empty()) {
        Token t;
        t.type = Tok::kInt;
        t.offset = start;
        t.int_value = std::strtoll(digits.c_str(), nullptr, base);
        tokens_.push_back(std::move(t));
        return q;
      }
    }
    size_t q = Digits(p);
    bool is_float = false;
    if (!after_dot && q + 1 < src_.size() && src_[q] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[q + 1]))) {
      q = Digits(q + 1);
      is_float = true;
    }
    if (!after_dot && q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
      size_t e = q + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        q = Digits(e);
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = start; i < q; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    Token t;
    t.offset = start;
    if (is_float) {
      t.type = Tok::kFloat;
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t.type = Tok::kInt;
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) throw SyntaxError{start, "integer literal out of range"};
    }
    tokens_.push_back(std::move(t));
    return q;
  }

  // A string literal with Python's escapes (jinja2 decodes them with "unicode-escape").
  size_t String(size_t p) {
    const char quote = src_[p];
    const size_t start = p;
    ++p;
    std::string out;
    while (true) {
      if (p >= src_.size()) throw SyntaxError{start, "unterminated string literal"};
      const char c = src_[p];
      if (c == quote) {
        ++p;
        break;
      }
      if (c != '\\') {
        out.push_back(c);
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) throw SyntaxError{start, "unterminated string literal"};
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n': break;
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'v': out.push_back('\v'); break;
        case 'x':
        case 'u':
        case 'U': {
          const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (p + n > src_.size()) throw SyntaxError{p - 2, "truncated \\x/\\u escape"};
          uint32_t cp = 0;
          for (int k = 0; k < n; ++k) {
            const char h = src_[p + k];
            if (!std::isxdigit(static_cast<unsigned char>(h))) {
              throw SyntaxError{p - 2, "truncated \\x/\\u escape"};
            }
            cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                     ? h - '0'
                                                     : std::tolower(static_cast<unsigned char>(h)) - 'a' + 10);
          }
          if (cp > 0x10FFFF) throw SyntaxError{p - 2, "illegal Unicode character in escape"};
          p += n;
          AppendUtf8(cp, &out);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) {
              cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
            }
            AppendUtf8(cp, &out);
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    Emit(Tok::kString, std::move(out), start);
    return p;
  }

  std::string_view src_;
  std::vector<Token> tokens_;
};

// ---------------------------------------------------------------------------------------------

// Marks which of varargs/kwargs/caller the body of macro `m` reads (nested macros and
// call blocks count, as jinja2 looks at the body's free names).
void ScanExpr(const Expr* e, Node* m) {
  if (e == nullptr) return;
  if (e->kind == ExprKind::kName) {
    if (e->name == "varargs") m->uses_varargs = true;
    if (e->name == "kwargs") m->uses_kwargs = true;
    if (e->name == "caller") m->uses_caller = true;
  }
  for (const auto& c : e->items) ScanExpr(c.get(), m);
}

void ScanNames(const Body& body, Node* m) {
  for (const auto& n : body) {
    ScanExpr(n->expr.get(), m);
    ScanExpr(n->cond.get(), m);
    for (const auto& c : n->conds) ScanExpr(c.get(), m);
    for (const auto& f : n->filters) ScanExpr(f.get(), m);
    for (const auto& p : n->params) ScanExpr(p.default_value.get(), m);
    for (const auto& b : n->bodies) ScanNames(b, m);
    ScanNames(n->body, m);
    ScanNames(n->else_body, m);
  }
}

// How far ahead of the current item a loop body's `loop` looks (see Node::lookahead). Nested
// loops have a `loop` of their own: only their iterable and filter are this loop's.
int LoopLookahead(const Expr* e) {
  if (e == nullptr) return 0;
  if (e->kind == ExprKind::kGetAttr && e->items[0] != nullptr &&
      e->items[0]->kind == ExprKind::kName && e->items[0]->name == "loop") {
    if (e->name == "length" || e->name == "revindex" || e->name == "revindex0") return 2;
    if (e->name == "last" || e->name == "nextitem") return 1;
    return 0;
  }
  if (e->kind == ExprKind::kName && e->name == "loop") return 2;
  int need = 0;
  for (const auto& c : e->items) need = std::max(need, LoopLookahead(c.get()));
  return need;
}

int LoopLookahead(const Body& body) {
  int need = 0;
  for (const auto& n : body) {
    need = std::max({need, LoopLookahead(n->expr.get()), LoopLookahead(n->cond.get())});
    for (const auto& c : n->conds) need = std::max(need, LoopLookahead(c.get()));
    for (const auto& f : n->filters) need = std::max(need, LoopLookahead(f.get()));
    for (const auto& p : n->params) need = std::max(need, LoopLookahead(p.default_value.get()));
    for (const auto& b : n->bodies) need = std::max(need, LoopLookahead(b));
    if (n->kind != NodeKind::kFor) {
      need = std::max({need, LoopLookahead(n->body), LoopLookahead(n->else_body)});
    }
  }
  return need;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  Body Program() {
    Body body = Statements({});
    if (Cur().type != Tok::kEof) Fail(Cur().offset, "unexpected end tag");
    return body;
  }

  std::function<Pos(size_t)> to_pos;

 private:
  const Token& Cur() const { return toks_[i_]; }
  const Token& Peek(int k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  void Next() {
    if (i_ + 1 < toks_.size()) ++i_;
  }
  [[noreturn]] void Fail(size_t offset, std::string msg) const { throw SyntaxError{offset, std::move(msg)}; }
  Pos PosOf(const Token& t) const { return to_pos(t.offset); }

  bool IsOp(std::string_view op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(std::string_view n) const { return Cur().type == Tok::kName && Cur().text == n; }
  bool SkipOp(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view n) {
    if (!IsName(n)) return false;
    Next();
    return true;
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof: return "end of template";
      case Tok::kBlockEnd: return "end of statement block";
      case Tok::kVarEnd: return "end of print statement";
      case Tok::kName: return absl::StrCat("'", t.text, "'");
      case Tok::kOp: return absl::StrCat("'", t.text, "'");
      case Tok::kString: return "string";
      case Tok::kInt: return "integer";
      case Tok::kFloat: return "float";
      default: return "token";
    }
  }
  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) Fail(Cur().offset, absl::StrCat("expected '", Sv(op), "', got ", Describe(Cur())));
  }
  void ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) {
      Fail(Cur().offset, absl::StrCat("expected end of statement block, got ", Describe(Cur())));
    }
    Next();
  }
  std::string ExpectName() {
    if (Cur().type != Tok::kName) Fail(Cur().offset, absl::StrCat("expected a name, got ", Describe(Cur())));
    std::string n = Cur().text;
    Next();
    return n;
  }

  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p(p) {
      if (++p->depth_ > kMaxParseDepth) p->Fail(p->Cur().offset, "template nested too deeply");
    }
    ~DepthGuard() { --p->depth_; }
    Parser* p;
  };

  // Statements until a block tag whose keyword is in `end` (left as the current token, after
  // the block begin), or the end of the template.
  Body Statements(std::initializer_list<std::string_view> end) {
    DepthGuard guard(this);
    Body body;
    while (true) {
      const Token& t = Cur();
      if (t.type == Tok::kEof) {
        if (end.size() > 0) {
          std::string_view closing = *end.begin();
          for (std::string_view e : end) {
            if (e.substr(0, 3) == "end") closing = e;
          }
          Fail(t.offset, absl::StrCat("unexpected end of template; expected '", Sv(closing), "'"));
        }
        return body;
      }
      if (t.type == Tok::kData) {
        auto n = std::make_unique<Node>();
        n->kind = NodeKind::kText;
        n->pos = PosOf(t);
        n->text = t.text;
        body.push_back(std::move(n));
        Next();
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        Next();
        auto n = std::make_unique<Node>();
        n->kind = NodeKind::kPrint;
        n->pos = PosOf(Cur());
        n->expr = TupleExpr(true);
        if (Cur().type != Tok::kVarEnd) {
          Fail(Cur().offset, absl::StrCat("expected end of print statement, got ", Describe(Cur())));
        }
        Next();
        body.push_back(std::move(n));
        continue;
      }
      if (t.type == Tok::kBlockBegin) {
        const Token& kw = Peek();
        if (kw.type == Tok::kName) {
          for (std::string_view e : end) {
            if (kw.text == e) {
              Next();  // leave the keyword as current
              return body;
            }
          }
        }
        Next();
        body.push_back(Statement());
        continue;
      }
      Fail(t.offset, absl::StrCat("unexpected ", Describe(t)));
    }
  }

  std::unique_ptr<Node> Statement() {
    const Token& kw = Cur();
    if (kw.type != Tok::kName) Fail(kw.offset, "tag name expected");
    auto n = std::make_unique<Node>();
    n->pos = PosOf(kw);
    const std::string word = kw.text;
    const size_t word_offset = kw.offset;
    Next();
    if (word == "if") {
      n->kind = NodeKind::kIf;
      // jinja2 reads an if/elif test without a top-level conditional expression.
      n->conds.push_back(TupleExpr(false));
      ExpectBlockEnd();
      while (true) {
        n->bodies.push_back(Statements({"elif", "else", "endif"}));
        const std::string tag = Cur().text;
        Next();
        if (tag == "elif") {
          n->conds.push_back(TupleExpr(false));
          ExpectBlockEnd();
        } else if (tag == "else") {
          ExpectBlockEnd();
          n->bodies.push_back(Statements({"endif"}));
          Next();
          ExpectBlockEnd();
          break;
        } else {
          ExpectBlockEnd();
          break;
        }
      }
    } else if (word == "for") {
      n->kind = NodeKind::kFor;
      n->target = AssignTarget(/*allow_attr=*/false, "in");
      if (!SkipName("in")) Fail(Cur().offset, absl::StrCat("expected 'in', got ", Describe(Cur())));
      n->expr = TupleExpr(false, {"recursive"});
      if (SkipName("if")) n->cond = Expression(true);
      if (SkipName("recursive")) n->recursive = true;
      ExpectBlockEnd();
      ++loop_depth_;
      n->body = Statements({"endfor", "else"});
      --loop_depth_;
      n->lookahead = n->recursive ? 2 : LoopLookahead(n->body);
      if (Cur().text == "else") {
        Next();
        ExpectBlockEnd();
        n->else_body = Statements({"endfor"});
      }
      Next();
      ExpectBlockEnd();
    } else if (word == "set") {
      n->target = AssignTarget(/*allow_attr=*/true, "");
      if (SkipOp("=")) {
        n->kind = NodeKind::kSet;
        n->expr = TupleExpr(true);
        ExpectBlockEnd();
      } else {
        n->kind = NodeKind::kSetBlock;
        if (n->target.is_tuple || !n->target.attr.empty()) {
          Fail(Cur().offset, "a block set needs a plain name");
        }
        while (SkipOp("|")) n->filters.push_back(FilterCall(nullptr));
        ExpectBlockEnd();
        n->body = Statements({"endset"});
        Next();
        ExpectBlockEnd();
      }
    } else if (word == "macro") {
      n->kind = NodeKind::kMacro;
      n->text = ExpectName();
      Params(&n->params);
      ExpectBlockEnd();
      const int saved = loop_depth_;
      loop_depth_ = 0;
      n->body = Statements({"endmacro"});
      loop_depth_ = saved;
      ScanNames(n->body, n.get());
      Next();
      if (Cur().type == Tok::kName) Next();  // {% endmacro name %}
      ExpectBlockEnd();
    } else if (word == "call") {
      n->kind = NodeKind::kCallBlock;
      if (IsOp("(")) Params(&n->params);
      n->expr = Expression(true);
      if (n->expr->kind != ExprKind::kCall) Fail(word_offset, "expected a call after 'call'");
      ExpectBlockEnd();
      const int saved = loop_depth_;
      loop_depth_ = 0;
      n->body = Statements({"endcall"});
      loop_depth_ = saved;
      Next();
      ExpectBlockEnd();
    } else if (word == "filter") {
      n->kind = NodeKind::kFilterBlock;
      n->filters.push_back(FilterCall(nullptr));
      while (SkipOp("|")) n->filters.push_back(FilterCall(nullptr));
      ExpectBlockEnd();
      n->body = Statements({"endfilter"});
      Next();
      ExpectBlockEnd();
    } else if (word == "break" || word == "continue") {
      if (loop_depth_ == 0) Fail(word_offset, absl::StrCat("'", word, "' outside of a loop"));
      n->kind = word == "break" ? NodeKind::kBreak : NodeKind::kContinue;
      ExpectBlockEnd();
    } else if (word == "with") {
      n->kind = NodeKind::kWith;
      while (Cur().type != Tok::kBlockEnd) {
        if (!n->targets.empty()) ExpectOp(",");
        n->targets.push_back(AssignTarget(false, ""));
        ExpectOp("=");
        n->conds.push_back(Expression(true));
      }
      ExpectBlockEnd();
      n->body = Statements({"endwith"});
      Next();
      ExpectBlockEnd();
    } else if (word == "generation" || word == "block") {
      // transformers' {% generation %} marks assistant text for masks; a {% block %} without
      // inheritance renders in place.
      n->kind = NodeKind::kScope;
      if (word == "block") {
        ExpectName();
        SkipName("scoped");
        SkipName("required");
      }
      ExpectBlockEnd();
      const std::string end = word == "generation" ? "endgeneration" : "endblock";
      n->body = Statements({end});
      Next();
      if (word == "block" && Cur().type == Tok::kName) Next();
      ExpectBlockEnd();
    } else if (word == "include" || word == "import" || word == "from" || word == "extends") {
      Fail(word_offset, absl::StrCat("'", word, "' is not supported: a chat template has no loader"));
    } else {
      Fail(word_offset, absl::StrCat("unknown tag '", word, "'"));
    }
    return n;
  }

  void Params(std::vector<Param>* params) {
    ExpectOp("(");
    while (!SkipOp(")")) {
      if (!params->empty()) ExpectOp(",");
      if (SkipOp(")")) break;  // trailing comma
      Param p;
      p.name = ExpectName();
      if (SkipOp("=")) {
        p.default_value = Expression(true);
      } else if (!params->empty() && params->back().default_value != nullptr) {
        Fail(Cur().offset, "non-default argument follows default argument");
      }
      params->push_back(std::move(p));
    }
  }

  // A name, `ns.attr`, or a parenthesized tuple of targets.
  Target TargetItem(bool allow_attr) {
    Target x;
    x.pos = PosOf(Cur());
    if (SkipOp("(")) {
      x.is_tuple = true;
      while (!SkipOp(")")) {
        if (!x.items.empty()) {
          ExpectOp(",");
          if (SkipOp(")")) break;
        }
        x.items.push_back(TargetItem(allow_attr));
      }
      return x;
    }
    if (Cur().type != Tok::kName) Fail(Cur().offset, absl::StrCat("can't assign to ", Describe(Cur())));
    x.name = Cur().text;
    Next();
    if (allow_attr && IsOp(".") && Peek().type == Tok::kName) {
      Next();
      x.attr = Cur().text;
      Next();
    }
    return x;
  }

  Target AssignTarget(bool allow_attr, std::string_view end_name) {
    Target first = TargetItem(allow_attr);
    if (!IsOp(",")) return first;
    Target t;
    t.pos = first.pos;
    t.is_tuple = true;
    t.items.push_back(std::move(first));
    while (SkipOp(",")) {
      if (!(Cur().type == Tok::kName || IsOp("(")) || (!end_name.empty() && IsName(end_name))) break;
      t.items.push_back(TargetItem(allow_attr));
    }
    return t;
  }

  // Appends a child, keeping the tree shallow enough to walk and free recursively.
  void Push(Expr* parent, std::unique_ptr<Expr> child) {
    if (child != nullptr && child->depth + 1 > parent->depth) {
      parent->depth = child->depth + 1;
      if (parent->depth > kMaxExprDepth) {
        throw SyntaxError{Cur().offset, "expression nested too deeply"};
      }
    }
    parent->items.push_back(std::move(child));
  }

  std::unique_ptr<Expr> Make(ExprKind kind, size_t offset) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = to_pos(offset);
    return e;
  }

  bool AtTupleEnd(std::initializer_list<std::string_view> extra_end) const {
    const Token& t = Cur();
    if (t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd || t.type == Tok::kEof) return true;
    if (t.type == Tok::kOp && (t.text == ")" || t.text == "]" || t.text == "}" || t.text == "=")) return true;
    if (t.type == Tok::kName) {
      for (std::string_view e : extra_end) {
        if (t.text == e) return true;
      }
    }
    return false;
  }

  // An expression or a tuple of them without parentheses (`a, b`).
  std::unique_ptr<Expr> TupleExpr(bool with_condexpr, std::initializer_list<std::string_view> extra_end = {}) {
    const size_t offset = Cur().offset;
    std::vector<std::unique_ptr<Expr>> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!SkipOp(",")) break;
        is_tuple = true;
        if (AtTupleEnd(extra_end)) break;
      }
      items.push_back(Expression(with_condexpr));
      if (!IsOp(",")) break;
    }
    if (!is_tuple) {
      if (items.empty()) Fail(offset, "expected an expression");
      return std::move(items[0]);
    }
    auto t = Make(ExprKind::kTuple, offset);
    for (auto& item : items) Push(t.get(), std::move(item));
    return t;
  }

  std::unique_ptr<Expr> Expression(bool with_condexpr) {
    DepthGuard guard(this);
    if (!with_condexpr) return Or();
    std::unique_ptr<Expr> e = Or();
    while (IsName("if")) {
      const size_t offset = Cur().offset;
      Next();
      auto c = Make(ExprKind::kCondExpr, offset);
      std::unique_ptr<Expr> cond = Or();
      std::unique_ptr<Expr> otherwise;
      if (SkipName("else")) otherwise = Expression(true);
      Push(c.get(), std::move(cond));
      Push(c.get(), std::move(e));
      Push(c.get(), std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  std::unique_ptr<Expr> Or() {
    std::unique_ptr<Expr> l = And();
    while (IsName("or")) {
      auto e = Make(ExprKind::kOr, Cur().offset);
      Next();
      Push(e.get(), std::move(l));
      Push(e.get(), And());
      l = std::move(e);
    }
    return l;
  }

  std::unique_ptr<Expr> And() {
    std::unique_ptr<Expr> l = Not();
    while (IsName("and")) {
      auto e = Make(ExprKind::kAnd, Cur().offset);
      Next();
      Push(e.get(), std::move(l));
      Push(e.get(), Not());
      l = std::move(e);
    }
    return l;
  }

  std::unique_ptr<Expr> Not() {
    if (IsName("not")) {
      DepthGuard guard(this);
      auto e = Make(ExprKind::kNot, Cur().offset);
      Next();
      Push(e.get(), Not());
      return e;
    }
    return Compare();
  }

  std::unique_ptr<Expr> Compare() {
    const size_t offset = Cur().offset;
    std::unique_ptr<Expr> first = Math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      const Token& t = Cur();
      if (t.type == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                 t.text == ">" || t.text == "<=" || t.text == ">=")) {
        op = t.text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        op = "notin";
        Next();
        Next();
      } else {
        break;
      }
      if (cmp == nullptr) {
        cmp = Make(ExprKind::kCompare, offset);
        Push(cmp.get(), std::move(first));
      }
      cmp->ops.push_back(op);
      Push(cmp.get(), Math1());
    }
    return cmp != nullptr ? std::move(cmp) : std::move(first);
  }

  std::unique_ptr<Expr> Binary(std::unique_ptr<Expr> l, std::string op, std::unique_ptr<Expr> r,
                               size_t offset) {
    auto e = Make(ExprKind::kBinary, offset);
    e->name = std::move(op);
    Push(e.get(), std::move(l));
    Push(e.get(), std::move(r));
    return e;
  }

  std::unique_ptr<Expr> Math1() {
    std::unique_ptr<Expr> l = Concat();
    while (IsOp("+") || IsOp("-")) {
      const std::string op = Cur().text;
      const size_t offset = Cur().offset;
      Next();
      l = Binary(std::move(l), op, Concat(), offset);
    }
    return l;
  }

  std::unique_ptr<Expr> Concat() {
    std::unique_ptr<Expr> l = Math2();
    while (IsOp("~")) {
      const size_t offset = Cur().offset;
      Next();
      l = Binary(std::move(l), "~", Math2(), offset);
    }
    return l;
  }

  std::unique_ptr<Expr> Math2() {
    std::unique_ptr<Expr> l = Pow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string op = Cur().text;
      const size_t offset = Cur().offset;
      Next();
      l = Binary(std::move(l), op, Pow(), offset);
    }
    return l;
  }

  std::unique_ptr<Expr> Pow() {
    std::unique_ptr<Expr> l = Unary(true);
    while (IsOp("**")) {
      const size_t offset = Cur().offset;
      Next();
      l = Binary(std::move(l), "**", Unary(true), offset);
    }
    return l;
  }

  std::unique_ptr<Expr> Unary(bool with_filter) {
    DepthGuard guard(this);
    std::unique_ptr<Expr> node;
    if (IsOp("-") || IsOp("+")) {
      node = Make(IsOp("-") ? ExprKind::kNeg : ExprKind::kPos, Cur().offset);
      Next();
      Push(node.get(), Unary(false));
    } else {
      node = Primary();
    }
    node = Postfix(std::move(node));
    if (with_filter) node = FilterExpr(std::move(node));
    return node;
  }

  std::unique_ptr<Expr> Primary() {
    const Token& t = Cur();
    const size_t offset = t.offset;
    switch (t.type) {
      case Tok::kName: {
        auto e = Make(ExprKind::kLiteral, offset);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::None();
        } else {
          e->kind = ExprKind::kName;
          e->name = t.text;
        }
        Next();
        return e;
      }
      case Tok::kString: {
        std::string s = t.text;
        Next();
        while (Cur().type == Tok::kString) {  // adjacent literals concatenate
          s += Cur().text;
          Next();
        }
        auto e = Make(ExprKind::kLiteral, offset);
        e->literal = Value(std::move(s));
        return e;
      }
      case Tok::kInt: {
        auto e = Make(ExprKind::kLiteral, offset);
        e->literal = Value(t.int_value);
        Next();
        return e;
      }
      case Tok::kFloat: {
        auto e = Make(ExprKind::kLiteral, offset);
        e->literal = Value(t.float_value);
        Next();
        return e;
      }
      case Tok::kOp:
        if (t.text == "(") {
          Next();
          if (SkipOp(")")) {
            auto e = Make(ExprKind::kTuple, offset);
            return e;
          }
          std::unique_ptr<Expr> inner = Expression(true);
          if (IsOp(",")) {
            auto tup = Make(ExprKind::kTuple, offset);
            Push(tup.get(), std::move(inner));
            while (SkipOp(",")) {
              if (IsOp(")")) break;
              Push(tup.get(), Expression(true));
            }
            inner = std::move(tup);
          }
          ExpectOp(")");
          return inner;
        }
        if (t.text == "[") {
          Next();
          auto e = Make(ExprKind::kList, offset);
          while (!SkipOp("]")) {
            if (!e->items.empty()) ExpectOp(",");
            if (SkipOp("]")) break;
            Push(e.get(), Expression(true));
          }
          return e;
        }
        if (t.text == "{") {
          Next();
          auto e = Make(ExprKind::kDict, offset);
          while (!SkipOp("}")) {
            if (!e->items.empty()) ExpectOp(",");
            if (SkipOp("}")) break;
            Push(e.get(), Expression(true));
            ExpectOp(":");
            Push(e.get(), Expression(true));
          }
          return e;
        }
        break;
      default:
        break;
    }
    Fail(offset, absl::StrCat("unexpected ", Describe(t)));
  }

  std::unique_ptr<Expr> Postfix(std::unique_ptr<Expr> node) {
    while (true) {
      const size_t offset = Cur().offset;
      if (IsOp(".")) {
        Next();
        if (Cur().type == Tok::kName) {
          auto e = Make(ExprKind::kGetAttr, offset);
          e->name = Cur().text;
          Next();
          Push(e.get(), std::move(node));
          node = std::move(e);
        } else if (Cur().type == Tok::kInt) {
          auto e = Make(ExprKind::kGetItem, offset);
          auto key = Make(ExprKind::kLiteral, Cur().offset);
          key->literal = Value(Cur().int_value);
          Next();
          Push(e.get(), std::move(node));
          Push(e.get(), std::move(key));
          node = std::move(e);
        } else {
          Fail(Cur().offset, "expected a name or a number after '.'");
        }
      } else if (IsOp("[")) {
        Next();
        node = Subscript(std::move(node), offset);
      } else if (IsOp("(")) {
        node = Call(std::move(node), offset);
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Expr> Subscript(std::unique_ptr<Expr> obj, size_t offset) {
    // [a], [a:b], [a:b:c], [::c], [a, b] (a tuple key)
    std::unique_ptr<Expr> parts[3];
    int n = 0;
    bool slice = false;
    while (true) {
      if (IsOp(":")) {
        slice = true;
        Next();
        ++n;
        if (n > 2) Fail(Cur().offset, "too many ':' in a slice");
        continue;
      }
      if (IsOp("]")) break;
      if (parts[n] != nullptr) Fail(Cur().offset, "expected ']'");
      parts[n] = Expression(true);
      if (!slice && IsOp(",")) {
        auto tup = Make(ExprKind::kTuple, offset);
        Push(tup.get(), std::move(parts[0]));
        while (SkipOp(",")) {
          if (IsOp("]")) break;
          Push(tup.get(), Expression(true));
        }
        parts[0] = std::move(tup);
      }
    }
    if (!slice && parts[0] == nullptr) Fail(Cur().offset, "expected a subscript expression");
    ExpectOp("]");
    if (!slice) {
      auto e = Make(ExprKind::kGetItem, offset);
      Push(e.get(), std::move(obj));
      Push(e.get(), std::move(parts[0]));
      return e;
    }
    auto e = Make(ExprKind::kSlice, offset);
    Push(e.get(), std::move(obj));
    for (auto& p : parts) Push(e.get(), std::move(p));
    return e;
  }

  // Arguments after '(': positional, then name=value (keywords after positionals).
  void CallArgs(Expr* e) {
    ExpectOp("(");
    bool need_comma = false;
    while (!SkipOp(")")) {
      if (need_comma) {
        ExpectOp(",");
        if (SkipOp(")")) break;
      }
      need_comma = true;
      if (IsOp("*") || IsOp("**")) Fail(Cur().offset, "*args and **kwargs are not supported");
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        e->kwnames.push_back(Cur().text);
        Next();
        Next();
        Push(e, Expression(true));
      } else {
        if (!e->kwnames.empty()) Fail(Cur().offset, "positional argument follows keyword argument");
        Push(e, Expression(true));
      }
    }
  }

  std::unique_ptr<Expr> Call(std::unique_ptr<Expr> callee, size_t offset) {
    auto e = Make(ExprKind::kCall, offset);
    Push(e.get(), std::move(callee));
    CallArgs(e.get());
    return e;
  }

  std::unique_ptr<Expr> FilterCall(std::unique_ptr<Expr> operand) {
    const size_t offset = Cur().offset;
    auto e = Make(ExprKind::kFilter, offset);
    e->name = ExpectName();
    while (IsOp(".") && Peek().type == Tok::kName) {  // dotted filter names
      Next();
      e->name += "." + Cur().text;
      Next();
    }
    e->builtin = ResolveFilter(e->name);
    if (e->builtin == nullptr) Fail(offset, absl::StrCat("no filter named '", e->name, "'"));
    Push(e.get(), std::move(operand));
    if (IsOp("(")) CallArgs(e.get());
    return e;
  }

  std::unique_ptr<Expr> FilterExpr(std::unique_ptr<Expr> node) {
    while (true) {
      if (IsOp("|")) {
        Next();
        node = FilterCall(std::move(node));
      } else if (IsName("is")) {
        const size_t offset = Cur().offset;
        Next();
        auto e = Make(ExprKind::kTest, offset);
        if (SkipName("not")) e->negated = true;
        e->name = ExpectName();
        while (IsOp(".") && Peek().type == Tok::kName) {
          Next();
          e->name += "." + Cur().text;
          Next();
        }
        e->builtin = ResolveTest(e->name);
        if (e->builtin == nullptr) Fail(offset, absl::StrCat("no test named '", e->name, "'"));
        Push(e.get(), std::move(node));
        const Token& t = Cur();
        if (IsOp("(")) {
          CallArgs(e.get());
        } else if ((t.type == Tok::kName || t.type == Tok::kString || t.type == Tok::kInt ||
                    t.type == Tok::kFloat || IsOp("[") || IsOp("{")) &&
                   !(IsName("else") || IsName("or") || IsName("and"))) {
          if (IsName("is")) Fail(t.offset, "You cannot chain multiple tests with is");
          Push(e.get(), Postfix(Primary()));
        }
        node = std::move(e);
      } else if (IsOp("(")) {
        node = Call(std::move(node), Cur().offset);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseProgram(std::string_view source, std::string_view name) {
  if (source.size() > kMaxSourceBytes) {
    return absl::InvalidArgumentError(absl::StrCat(Sv(name), ": template of ", source.size(),
                                                   " bytes is larger than the limit of ",
                                                   kMaxSourceBytes));
  }
  // jinja2 reads every newline sequence as \n and drops one trailing newline
  // (keep_trailing_newline=False).
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src.push_back(source[i]);
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<size_t> line_starts = {0};
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\n') line_starts.push_back(i + 1);
  }
  const auto to_pos = [&line_starts, &src](size_t offset) {
    const auto it = std::upper_bound(line_starts.begin(), line_starts.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts.begin());
    const size_t start = line_starts[line - 1];
    Pos p;
    p.line = static_cast<int>(line);
    p.column = static_cast<int>(CodePointCount(std::string_view(src).substr(start, offset - start))) + 1;
    return p;
  };
  try {
    Lexer lexer(src);
    Parser parser(lexer.Run());
    parser.to_pos = to_pos;
    return parser.Program();
  } catch (const SyntaxError& e) {
    const Pos p = to_pos(std::min(e.offset, src.size()));
    return absl::InvalidArgumentError(
        absl::StrCat(Sv(name), ":", p.line, ":", p.column, ": syntax error: ", e.message));
  }
}

}  // namespace kvgrid::model::jinja
