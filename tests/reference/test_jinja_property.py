"""Random expressions and small templates through `kvgrid chat-template --batch`, against
jinja2 as transformers configures it (jinja_reference.py): both render the same text, or both
fail.

The generator is seeded (KVGRID_JINJA_SEED, default below; KVGRID_JINJA_CASES cases) and stays
within what chat templates use: literals (ints, floats, strings with non-ASCII text, lists,
dicts, tuples), variables of a random context, arithmetic, comparisons, boolean logic, inline
if, filters, tests, slices, string and dict methods, and if/for/set/namespace statements.
Values are typed as they are built so that most cases render; the rest fail on both sides.
Integers stay far inside 64 bits (kvgrid's integers), and no generated value is a Python
generator or iterator whose printed form is an address.
"""

import collections
import copy
import json
import os
import random
import re

import jinja_reference as jr

SEED = int(os.environ.get("KVGRID_JINJA_SEED", "20250611"))
CASES = int(os.environ.get("KVGRID_JINJA_CASES", "4000"))

STRINGS = ["", "a", "abc", "Hello", "hello world", "  padded  ", "MiXeD cAsE", "x,y,,z",
           "line1\nline2\n", "tab\tsep", "42", "-7", "3.5", " 12 ", "1e3", "it's", 'say "hi"',
           "back\\slash", "é", "wörld", "Straße", "ΑΒΓ αβγ", "日本語", "emoji 🌍🎉", "e\u0301",
           "<b>&</b>", "{{ x }}", "</s>", "a-b_c d", "UPPER lower", "ǅ title", "\u00a0nbsp",
           "--==--", "aaa", "abcabc", "zzz", "A", "ünïcödé"]
SEPARATORS = ["", " ", ",", "-", ", ", "\n", "|", "::", "é"]
STRIP_CHARS = [" ", "a", "-=", "xy", "lo", "\n", "é"]
FLOATS = [0.0, 0.1, 0.5, 1.0, 2.5, -0.75, 3.14159, 1e-7, 1e16, 123.456, -2.5, 2.5e-8, 0.3,
          2.675, 100.0, 1e15, -0.0, 7.0]
INT_FILTERS = ["abs", "string", "float", "int", "tojson"]
STR_FILTERS = ["upper", "lower", "capitalize", "title", "trim", "length", "reverse", "string",
               "tojson", "wordcount", "first", "last", "list", "count", "int", "float"]
LIST_FILTERS = ["length", "first", "last", "sum", "min", "max", "sort", "unique", "reverse",
                "join", "tojson", "string", "list", "count"]
TESTS_ANY = ["defined", "undefined", "none", "string", "mapping", "iterable", "sequence",
             "number", "integer", "float", "boolean", "true", "false"]
BASE_CONTEXT = {
    "i": 3, "j": -2, "k": 0, "big": 123456789, "f": 2.5, "g": -0.125, "s": "Hello, World",
    "u": "héllo wörld 日本 🌍", "e": "", "ml": "a\nb\n\n c", "b": True, "nb": False, "n": None,
    "nums": [3, 1, 2, 10], "floats": [1.5, -2.0, 0.25], "words": ["pear", "Apple", "fig", "apple"],
    "mixed": [1, "a", None, 2.5, True, [1], {"k": "v"}], "empty": [],
    "d": {"name": "kv", "n": 2, "list": [1, 2], "none": None, "nested": {"x": 1.5}},
    "people": [{"name": "Ann", "age": 31}, {"name": "bob", "age": 25, "admin": True},
               {"name": "Cy", "age": 31}],
}


def _paren(text, rng):
    # Always around a product: `a * b | f` applies f to b, and a large int times a string
    # would build a huge string.
    # would build a huge string; and around a filtered or concatenated operand, whose filter
    # would otherwise reach past it (`a ~ l | reverse` prints an iterator's address).
    return f"({text})" if rng.random() < 0.85 or any(c in text for c in "*|~") else text


def _base(text):
    """`text` made safe to follow with .method() or [...] (a filter would bind last)."""
    return text if re.fullmatch(r"[\w.]+|'[^']*'|\"[^\"]*\"", text) else f"({text})"


def _str_literal(value, rng):
    if "'" in value and '"' not in value:
        quote = '"'
    else:
        quote = rng.choice(["'", '"'])
    out = value.replace("\\", "\\\\").replace(quote, "\\" + quote)
    out = out.replace("\n", "\\n").replace("\t", "\\t")
    return quote + out + quote


class Gen:
    """Typed random expressions: gen(kind) returns the source of an expression that, as built,
    should evaluate to a value of `kind` (int, float, str, bool, list, dict)."""

    def __init__(self, rng, context):
        self.rng = rng
        self.ctx = context

    def var(self, kind):
        names = [n for n, v in self.ctx.items() if _kind(v) == kind]
        return self.rng.choice(names) if names else None

    def gen(self, kind, depth=0):
        r = self.rng
        if depth >= 3 or r.random() < 0.25:
            leaf = self.leaf(kind)
            if leaf is not None:
                return leaf
        return getattr(self, "g_" + kind)(depth + 1)

    def leaf(self, kind):
        r = self.rng
        if r.random() < 0.5:
            v = self.var(kind)
            if v is not None:
                return v
        if kind == "int":
            return str(r.choice([0, 1, 2, 3, 5, 7, 10, 42, -1, -4, 100, 2 ** 31, -9]))
        if kind == "float":
            return repr(r.choice(FLOATS))
        if kind == "str":
            return _str_literal(r.choice(STRINGS), r)
        if kind == "bool":
            return r.choice(["true", "false", "True", "False"])
        if kind == "list":
            items = [self.gen(r.choice(["int", "str", "float"]), 3) for _ in range(r.randint(0, 4))]
            if r.random() < 0.5:
                items = [self.leaf("int") for _ in range(r.randint(0, 5))]
            return "[" + ", ".join(items) + "]"
        if kind == "dict":
            keys = r.sample(["a", "b", "name", "k2", "é"], r.randint(0, 3))
            return "{" + ", ".join(f"{_str_literal(k, r)}: {self.gen(r.choice(['int', 'str', 'float', 'bool']), 3)}"
                                   for k in keys) + "}"
        return None

    # int-valued
    def g_int(self, d):
        r = self.rng
        c = r.randrange(14)
        if c == 0:
            op = r.choice(["+", "-", "*", "//", "%"])
            return f"{_paren(self.gen('int', d), r)} {op} {_paren(self.gen('int', d), r)}"
        if c == 1:
            return f"{r.randint(-5, 6)} ** {r.randint(0, 3)}"
        if c == 2:
            return f"{_paren(self.gen(r.choice(['str', 'list', 'dict']), d), r)} | {r.choice(['length', 'count'])}"
        if c == 3:
            # A float converted to int stays small: kvgrid's integers are 64-bit (the
            # focused cases check what lies beyond).
            base = self.gen(r.choice(["str", "int"]), d) if r.random() < 0.6 else self.leaf("float")
            return f"{_paren(base, r)} | int"
        if c == 4:
            return f"{_paren(self.gen('int', d), r)} | abs"
        if c == 5:
            s = _base(self.gen("str", d))
            return f"{s}.{r.choice(['find', 'count', 'rfind'])}({_str_literal(r.choice(STRINGS[:12] + ['l', 'o', 'é']), r)})"
        if c == 6:
            return f"{_paren(self.int_list(d), r)} | {r.choice(['sum', 'min', 'max', 'first', 'last'])}"
        if c == 7:
            return f"-{_paren(self.gen('int', d), r)}"
        if c == 8:
            return f"{_paren(self.gen('bool', d), r)} | int"
        if c == 9:
            return f"{_base(self.int_list(d))}[{r.randint(-4, 5)}]"
        if c == 10:
            return f"people[{r.randint(-3, 2)}].age"
        if c == 11:
            return f"{_paren(self.gen('int', d), r)} if {self.gen('bool', d)} else {_paren(self.gen('int', d), r)}"
        if c == 12:
            return f"range({r.randint(-2, 6)}) | list | length"
        return f"d.n + {self.gen('int', d)}"

    def int_list(self, d):
        r = self.rng
        c = r.randrange(6)
        if c == 0:
            return "nums"
        if c == 1:
            return f"range({r.randint(0, 4)}, {r.randint(3, 9)}) | list"
        if c == 2:
            return "people | map(attribute='age') | list"
        if c == 3:
            return f"nums | select('{r.choice(['odd', 'even'])}') | list"
        if c == 4:
            return f"nums | sort(reverse={r.choice(['true', 'false'])})"
        return "[" + ", ".join(str(r.randint(-9, 20)) for _ in range(r.randint(1, 5))) + "]"

    # float-valued
    def g_float(self, d):
        r = self.rng
        c = r.randrange(9)
        if c == 0:
            op = r.choice(["+", "-", "*", "/"])
            a = self.gen(r.choice(["int", "float"]), d)
            b = self.gen("float", d)
            return f"{_paren(a, r)} {op} {_paren(b, r)}" if r.random() < 0.5 else f"{_paren(b, r)} {op} {_paren(a, r)}"
        if c == 1:
            return f"{_paren(self.gen('int', d), r)} / {_paren(self.gen('int', d), r)}"
        if c == 2:
            return f"{_paren(self.gen(r.choice(['str', 'int']), d), r)} | float"
        if c == 3:
            prec = r.choice(["", "1", "2", "0", "3"])
            method = r.choice(["", ", 'floor'", ", 'ceil'"]) if prec else ""
            return f"{_paren(self.gen('float', d), r)} | round{('(' + prec + method + ')') if prec else ''}"
        if c == 4:
            return f"{_paren(self.gen('float', d), r)} {r.choice(['//', '%'])} {_paren(self.gen(r.choice(['int', 'float']), d), r)}"
        if c == 5:
            return f"floats | {r.choice(['sum', 'min', 'max', 'first'])}"
        if c == 6:
            return f"{r.randint(-4, 5)} ** {r.randint(-2, -1)}"
        if c == 7:
            return f"{_paren(self.gen('float', d), r)} | abs"
        return f"d.nested.x * {self.gen('int', d)}"

    # str-valued
    def g_str(self, d):
        r = self.rng
        c = r.randrange(24)
        s = lambda: _paren(self.gen("str", d), r)  # noqa: E731
        sb = lambda: _base(self.gen("str", d))  # noqa: E731
        lit = lambda pool: _str_literal(r.choice(pool), r)  # noqa: E731
        if c == 0:
            return f"{s()} ~ {_paren(self.gen(r.choice(['str', 'int', 'float', 'bool', 'list']), d), r)}"
        if c == 1:
            return f"{s()} + {s()}"
        if c == 2:
            return f"{s()} | {r.choice(['upper', 'lower', 'capitalize', 'title', 'trim', 'reverse', 'string'])}"
        if c == 3:
            return f"{sb()}.{r.choice(['upper', 'lower', 'strip', 'lstrip', 'rstrip', 'title', 'capitalize'])}()"
        if c == 4:
            return f"{sb()}.{r.choice(['strip', 'lstrip', 'rstrip'])}({lit(STRIP_CHARS)})"
        if c == 5:
            a, b = r.choice([None, -3, -1, 0, 1, 2, 5, 20]), r.choice([None, -2, 0, 1, 3, 4, 30])
            st = r.choice([None, None, None, -1, 2, -2, 3])
            sl = f"{'' if a is None else a}:{'' if b is None else b}" + ("" if st is None else f":{st}")
            return f"{sb()}[{sl}]"
        if c == 6:
            return f"{sb()}[::-1]"
        if c == 7:
            return f"{_paren(self.gen('list', d), r)} | join({lit(SEPARATORS)})"
        if c == 8:
            return f"{_paren(self.gen(r.choice(['int', 'float', 'bool', 'list', 'dict', 'str']), d), r)} | string"
        if c == 9:
            kind = r.choice(["int", "float", "str", "list", "dict", "bool"])
            args = r.choice(["", "", "indent=2", "sort_keys=true", "separators=(',', ':')"])
            return f"{_paren(self.gen(kind, d), r)} | tojson{('(' + args + ')') if args else ''}"
        if c == 10:
            return f"{sb()}.replace({lit(['a', 'l', ' ', 'é', 'o', ''])}, {lit(['', 'X', '--', 'ü'])}{', ' + str(r.randint(0, 2)) if r.random() < 0.3 else ''})"
        if c == 11:
            return f"{s()} | replace({lit(['a', 'l', ' ', 'é'])}, {lit(['', 'X', '__'])})"
        if c == 12:
            fmt = r.choice(["%s", "%s-%s", "[%5s]", "%-4s|", "%d", "%.2f", "%x", "%s=%d"])
            nargs = fmt.count("%")
            vals = []
            for spec in re.findall(r"%[-\d.]*([sdfx])", fmt):
                vals.append(self.gen({"s": r.choice(["str", "int", "float"]), "d": "int", "f": "float", "x": "int"}[spec], d))
            if nargs == 1:
                return f"{_str_literal(fmt, r)} % {_paren(vals[0], r)}"
            return f"{_str_literal(fmt, r)} % ({', '.join(vals)})"
        if c == 13:
            fmt = r.choice(["{}", "{}-{}", "{0}{0}", "<{}>", "{:>6}", "{:.3f}"])
            n = len(re.findall(r"\{[^}]*\}", fmt)) if "0" not in fmt else 1
            kinds = ["float"] if "f}" in fmt else [r.choice(["str", "int", "float", "bool"]) for _ in range(n)]
            return f"{_str_literal(fmt, r)}.format({', '.join(self.gen(k, d) for k in kinds)})"
        if c == 14:
            sep = r.choice(["", ", " + lit(SEPARATORS[1:]), ", " + lit(SEPARATORS[1:]) + ", " + str(r.randint(-1, 2))])
            method = r.choice(["split", "rsplit"])
            if sep == "":
                sep = r.choice(["", ", none, 1"])
            return f"{sb()}.{method}({sep.lstrip(', ')}) | join({lit(['|', ','])})"
        if c == 15:
            return f"{_paren(self.gen('str', d), r)} if {self.gen('bool', d)} else {_paren(self.gen('str', d), r)}"
        if c == 16:
            return f"{s()} | center({r.randint(0, 12)})"
        if c == 17:
            extra = r.choice(["", ", true", ", false, '~'", ", true, '..', 0"])
            return f"{s()} | truncate({r.choice([r.randint(3, 14), r.randint(0, 3)])}{extra})"
        if c == 18:
            return f"{s()} | indent({r.randint(0, 3)}{r.choice(['', ', true', ', first=true, blank=true'])})"
        if c == 19:
            return f"{lit(SEPARATORS)}.join({_paren(self.str_list(d), r)})"
        if c == 20:
            return f"{s()} * {r.randint(-1, 3)}"
        if c == 21:
            return f"d.get({lit(['name', 'missing', 'n'])}, {s()}) | string"
        if c == 22:
            return f"{sb()}.splitlines() | join('/')"
        return f"{s()} | default({s()}{r.choice(['', ', true'])})"

    def str_list(self, d):
        r = self.rng
        c = r.randrange(5)
        if c == 0:
            return "words"
        if c == 1:
            return f"{_base(self.gen('str', d))}.split()"
        if c == 2:
            return "people | map(attribute='name') | list"
        if c == 3:
            return f"words | map('{r.choice(['upper', 'lower', 'capitalize', 'trim'])}') | list"
        return "[" + ", ".join(_str_literal(r.choice(STRINGS), r) for _ in range(r.randint(0, 4))) + "]"

    # bool-valued
    def g_bool(self, d):
        r = self.rng
        c = r.randrange(12)
        if c == 0:
            kind = r.choice(["int", "float", "str", "int"])
            op = r.choice(["==", "!=", "<", "<=", ">", ">="])
            a, b = self.gen(kind, d), self.gen(kind if r.random() < 0.9 else "float", d)
            return f"{_paren(a, r)} {op} {_paren(b, r)}"
        if c == 1:
            return f"{_paren(self.gen(r.choice(['int', 'str']), d), r)} {r.choice(['in', 'not in'])} {_paren(self.gen(r.choice(['list', 'str', 'dict']), d), r)}"
        if c == 2:
            return f"{_base(self.gen('str', d))}.{r.choice(['startswith', 'endswith'])}({_str_literal(r.choice(STRINGS[:10]), r) if r.random() < 0.7 else '(' + _str_literal(r.choice(STRINGS), r) + ', ' + _str_literal(r.choice(STRINGS), r) + ')'})"
        if c == 3:
            kind = r.choice(["int", "float", "str", "list", "dict", "bool"])
            neg = r.choice(["", "not "])
            return f"{_paren(self.gen(kind, d), r)} is {neg}{r.choice(TESTS_ANY)}"
        if c == 4:
            t = r.choice(["odd", "even", "divisibleby(3)", "divisibleby 2", "eq 3", "ne 0", "lt 5", "gt -1", "in [1, 2, 3]"])
            return f"{_paren(self.gen('int', d), r)} is {t}"
        if c == 5:
            return f"not {_paren(self.gen('bool', d), r)}"
        if c == 6:
            return f"{_paren(self.gen('bool', d), r)} {r.choice(['and', 'or'])} {_paren(self.gen('bool', d), r)}"
        if c == 7:
            return f"{r.choice(['missing', 'd.missing', 'd.name', 'n', 'people[5]'])} is {r.choice(['defined', 'undefined', 'none'])}"
        if c == 8:
            return f"{_base(self.gen('str', d))}.{r.choice(['isdigit', 'isalpha', 'isspace', 'isupper', 'islower'])}()"
        if c == 9:
            return f"{_paren(self.gen(r.choice(['list', 'str', 'int']), d), r)} | length > {r.randint(0, 4)}"
        if c == 10:
            return f"{_paren(self.gen('int', d), r)} < {_paren(self.gen('int', d), r)} <= {_paren(self.gen('int', d), r)}"
        return f"{_paren(self.gen(r.choice(['int', 'str', 'list']), d), r)} | {r.choice(['string', 'int', 'length'])} == {self.gen(r.choice(['int', 'str']), d)}"

    # list-valued
    def g_list(self, d):
        r = self.rng
        c = r.randrange(16)
        l = lambda: _paren(self.gen("list", d), r)  # noqa: E731
        if c == 0:
            return self.int_list(d)
        if c == 1:
            return self.str_list(d)
        if c == 2:
            return f"{l()} + {l()}"
        if c == 3:
            return f"{_base(self.gen('list', d))}[{r.choice(['1:', ':-1', '::-1', '::2', '-2:', '1:3', '5:'])}]"
        if c == 4:
            return f"{l()} | {r.choice(['sort', 'unique | list', 'reverse | list', 'list', 'sort(reverse=true)'])}"
        if c == 5:
            return f"{_paren(self.gen('str', d), r)} | list"
        if c == 6:
            return f"range({r.randint(-1, 5)}, {r.randint(0, 8)}{', ' + str(r.choice([1, 2, -1, 3])) if r.random() < 0.4 else ''}) | list"
        if c == 7:
            return f"{l()} | select('{r.choice(['odd', 'even', 'string', 'number', 'none', 'defined'])}') | list"
        if c == 8:
            return f"{l()} | reject('{r.choice(['odd', 'even', 'string', 'number', 'none'])}') | list"
        if c == 9:
            test = r.choice(["", ', "eq", 31', ', "gt", 26', ', "defined"'])
            attr = r.choice(["name", "age", "admin"])
            dflt = r.choice(["", ", default=0"])
            return (f"people | selectattr('{r.choice(['admin', 'age', 'name'])}'{test}) | "
                    f"map(attribute='{attr}'{dflt}) | list")
        if c == 10:
            return f"people | sort(attribute='{r.choice(['age', 'name', 'age,name'])}'{r.choice(['', ', reverse=true'])}) | map(attribute='name') | list"
        if c == 11:
            return f"{_paren(self.gen('dict', d), r)} | {r.choice(['dictsort', 'list', 'items | list'])}"
        if c == 12:
            return f"{l()} | batch({r.randint(1, 3)}) | list"
        if c == 13:
            return f"{l()} | map('{r.choice(['string', 'upper', 'length', 'int', 'abs'])}') | list"
        if c == 14:
            return f"d.{r.choice(['keys()', 'values()'])} | list"
        return f"{l()} * {r.randint(0, 2)}"

    def g_dict(self, d):
        r = self.rng
        c = r.randrange(4)
        if c == 0:
            return "d"
        if c == 1:
            return f"dict({', '.join(f'k{n}=' + self.gen(r.choice(['int', 'str']), d) for n in range(r.randint(0, 3)))})"
        if c == 2:
            return "d.nested"
        return self.leaf("dict")


def _kind(value):
    if isinstance(value, bool):
        return "bool"
    return {int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value))


def random_context(rng):
    ctx = copy.deepcopy(BASE_CONTEXT)
    ctx["r_int"] = rng.randint(-50, 50)
    ctx["r_float"] = rng.choice(FLOATS)
    ctx["r_str"] = rng.choice(STRINGS)
    ctx["r_list"] = [rng.choice([rng.randint(-5, 5), rng.choice(STRINGS[:8])]) for _ in range(rng.randint(0, 4))]
    ctx["r_bool"] = rng.random() < 0.5
    return ctx


def random_template(rng, ctx):
    g = Gen(rng, ctx)
    ws = lambda: rng.choice(["", "", "-"])  # noqa: E731
    kind = rng.choice(["int", "float", "str", "bool", "list", "dict"])
    shape = rng.randrange(10)
    if shape <= 3:
        return "{{" + ws() + " " + g.gen(kind) + " " + ws() + "}}"
    if shape == 4:
        return (f"{{%{ws()} set v = {g.gen(kind)} {ws()}%}}[{{{{ v }}}}]"
                f"{{% if v is string %}}{{{{ v | length }}}}{{% endif %}}")
    if shape == 5:
        return (f"{{%{ws()} if {g.gen('bool')} {ws()}%}}\n  A {{{{ {g.gen('str')} }}}}\n"
                f"{{%{ws()} elif {g.gen('bool')} %}}\n  B\n{{% else {ws()}%}}\n  C {{{{ {g.gen('int')} }}}}\n{{% endif %}}\n")
    if shape == 6:
        body = rng.choice(["{{ loop.index }}:{{ x }}", "{{ loop.revindex0 }}{{ loop.cycle('a', 'b') }}{{ x }}",
                           "{{ x }}{{ ',' if not loop.last }}", "{% if loop.first %}^{% endif %}{{ x | string | upper }}",
                           "{% if x is number and x > 2 %}{% break %}{% endif %}{{ x }};",
                           "{% if loop.index is even %}{% continue %}{% endif %}{{ loop.index0 }}={{ x }} "])
        cond = rng.choice(["", "", f" if x is {rng.choice(['number', 'string', 'defined', 'odd'])}"])
        return f"{{%{ws()} for x in {g.gen('list')}{cond} {ws()}%}}{body}{{% else %}}none{{% endfor %}}"
    if shape == 7:
        return (f"{{% set ns = namespace(acc={g.gen(rng.choice(['int', 'str']))}) %}}"
                f"{{% for x in {g.gen('list')} %}}{{% set ns.acc = ns.acc ~ x %}}{{% endfor %}}{{{{ ns.acc }}}}")
    if shape == 8:
        return (f"{{% for k, v in {g.gen('dict')}.items() %}}{{{{ k }}}}={{{{ v }}}}"
                f"{{{{ ';' if not loop.last }}}}{{% endfor %}}")
    a = g.gen(kind)
    return (f"{{% macro m(p, q={g.gen('str')}) %}}<{{{{ p }}}}|{{{{ q }}}}>{{% endmacro %}}"
            f"{{{{ m({a}) }}}}{{{{ m(q={g.gen('int')}, p=1) }}}}")


def generate(seed=SEED, count=CASES):
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        ctx = random_context(rng)
        cases.append({"template": random_template(rng, ctx), "variables": ctx})
    return cases


def _features(template):
    """Names of filters, tests, methods and statements a template uses (for the summary)."""
    names = set(re.findall(r"\|\s*(\w+)", template))
    names |= {"is " + t for t in re.findall(r"\bis\s+(?:not\s+)?(\w+)", template)}
    names |= {"." + m for m in re.findall(r"\.(\w+)\(", template)}
    names |= {op for op in ["//", "%", "**", "~", "[::", "in "] if op in template}
    names |= {"{% " + t for t in re.findall(r"\{%-?\s*(\w+)", template)}
    return names


def _beyond_64_bits(expected, got):
    """kvgrid's integers are 64-bit by design: a case whose jinja2 text holds an integer of 19+
    digits (built from strings of digits or big products) may fail there with its overflow
    error. The focused cases (snippets.txt) pin what lies beyond 64 bits."""
    return (expected[0] and not got.get("ok") and "integer overflow" in got.get("error", "")
            and re.search(r"\d{19,}", expected[1]) is not None)


def test_reference_generator_is_mostly_valid():
    cases = generate(count=500)
    ok = sum(jr.render(c["template"], c["variables"])[0] for c in cases)
    assert ok > 0.6 * len(cases), f"only {ok} of {len(cases)} generated cases render in jinja2"


def test_random_templates_match_jinja2(kvgrid_exe):
    cases = generate()
    expected = [jr.render(c["template"], c["variables"]) for c in cases]
    got = jr.run_batch(kvgrid_exe, cases)
    mismatches = []
    for case, exp, g in zip(cases, expected, got):
        problem = jr.compare(exp, g)
        if problem and not _beyond_64_bits(exp, g):
            mismatches.append((case, problem))
    if not mismatches:
        return
    bad = collections.Counter()
    for case, _ in mismatches:
        bad.update(_features(case["template"]))
    total = collections.Counter()
    for case in cases:
        total.update(_features(case["template"]))
    suspects = sorted(bad, key=lambda f: (-bad[f] / total[f], -bad[f]))[:15]
    lines = [f"{len(mismatches)} of {len(cases)} cases differ from jinja2 (seed {SEED}).",
             "features in failing cases (failing/uses): "
             + ", ".join(f"{f!r} {bad[f]}/{total[f]}" for f in suspects)]
    for case, problem in mismatches[:20]:
        used = {k: v for k, v in case["variables"].items() if re.search(rf"\b{k}\b", case["template"])}
        lines.append(f"--- {case['template']!r}\n    variables {json.dumps(used, ensure_ascii=False)}"
                     f"\n    {problem}")
    raise AssertionError("\n".join(lines))
