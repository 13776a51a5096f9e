"""The reference for kvgrid's chat templates: Python's jinja2 configured as Hugging Face
transformers configures it for `apply_chat_template`, and helpers that run `kvgrid
chat-template` on the same input.

transformers (chat_template_utils._compile_jinja_template / render_jinja_template) renders with
  jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
      extensions=[<the {% generation %} tag>, jinja2.ext.loopcontrols])
  filters["tojson"]  = json.dumps with ensure_ascii=False (and indent/separators/sort_keys)
  globals["raise_exception"](message) raises jinja2.exceptions.TemplateError(message)
  globals["strftime_now"](format)     = datetime.now().strftime(format)
and passes messages, tools (None when absent), documents (None when absent),
add_generation_prompt (False when absent), the tokenizer's special tokens, then the caller's
other keyword arguments. A chat_template given as a list of {"name", "template"} is a set of
named templates: "tool_use" when tools were given (not None) and the set has it, else "default".
"""

import concurrent.futures
import copy
import functools
import json
import os
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

HERE = Path(__file__).resolve().parent
SOURCE_DIR = Path(os.environ.get("KVGRID_SOURCE_DIR", HERE.parent.parent))
DATA_DIR = SOURCE_DIR / "tests" / "data" / "chat_templates"

# The special-token attributes transformers' special_tokens_map holds (only those set).
SPECIAL_TOKEN_ATTRIBUTES = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token", "additional_special_tokens"]


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant tokens with it;
    rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body
                                      ).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 (the name transformers gives it)
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=None)
def environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=4096)
def _compile(source):
    return environment().from_string(source)


def render(source, variables):
    """(True, text) or (False, "<ExceptionType>: message") for `source` with `variables` as its
    globals, as transformers renders."""
    # A copy: a few jinja2 filters change their argument in place (indent on a list extends it
    # with "\n"), and the caller sends the same variables to kvgrid.
    variables = copy.deepcopy(variables)
    try:
        return True, _compile(source).render(**variables)
    except Exception as e:  # noqa: BLE001 -- any failure of jinja2 is a failure to compare
        return False, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------
# Chat templates as files, and conversations (requests) as transformers receives them.

def _token_text(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


class TemplateFile:
    """A chat template file: a .jinja file, or a JSON object with "chat_template" (a string or
    a list of {"name", "template"}) and the special tokens of a tokenizer_config.json."""

    def __init__(self, path):
        self.path = Path(path)
        self.special_tokens = {}
        if self.path.suffix == ".jinja":
            # transformers reads chat_template.jinja as text, keeping its final newline (which
            # jinja2 then drops: keep_trailing_newline=False).
            self.templates = self.path.read_text(encoding="utf-8")
            return
        config = json.loads(self.path.read_text(encoding="utf-8"))
        chat_template = config["chat_template"]
        if isinstance(chat_template, list):
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.templates = chat_template
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            value = config.get(attr)
            if attr == "additional_special_tokens" and isinstance(value, list):
                value = [_token_text(v) for v in value]
            else:
                value = _token_text(value)
            if value:  # special_tokens_map keeps the tokens that are set (truthy)
                self.special_tokens[attr] = value

    @property
    def name(self):
        return self.path.name

    def select(self, tools):
        """The template source transformers picks for a request with `tools` (None: none)."""
        if isinstance(self.templates, str):
            return self.templates
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ValueError("this file has several chat templates and none is named 'default'")


def chat_variables(request, special_tokens=None):
    """The variables transformers renders a request with: messages, tools, documents,
    add_generation_prompt, the special tokens, then the request's other fields."""
    extra = {k: v for k, v in request.items()
             if k not in ("messages", "tools", "documents", "add_generation_prompt")}
    return {"messages": request.get("messages", []), "tools": request.get("tools"),
            "documents": request.get("documents"),
            "add_generation_prompt": request.get("add_generation_prompt", False),
            **(special_tokens or {}), **extra}


def render_chat(template_file, request):
    """(ok, text or error) for `request` rendered with `template_file` (a TemplateFile)."""
    try:
        source = template_file.select(request.get("tools"))
    except ValueError as e:
        return False, f"ValueError: {e}"
    return render(source, chat_variables(request, template_file.special_tokens))


def load_conversations(directory=None):
    """name -> request dict, for every conversations/*.json of the corpus."""
    directory = Path(directory or DATA_DIR / "conversations")
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(directory.glob("*.json"))}


def template_files(directory=None):
    """Every chat template file (.jinja and .json) of the corpus, by file name."""
    directory = Path(directory or DATA_DIR / "templates")
    return {p.name: TemplateFile(p) for p in sorted(directory.iterdir())
            if p.suffix in (".jinja", ".json")}


def load_snippets(path=None):
    """The focused cases of snippets.txt: a list of dicts {name, template, expect, variables}.

    Format: each case starts with a header line `### <name>` optionally followed by `error`
    (jinja2 must raise) and/or a JSON object of variables merged over context.json; the lines up
    to the next header (the newline before it excluded) are the template.
    """
    path = Path(path or DATA_DIR / "snippets.txt")
    context = json.loads((path.parent / "context.json").read_text(encoding="utf-8"))
    cases, current = [], None
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.startswith("### "):
            if current:
                cases.append(current)
            head = line[4:].strip()
            name, _, rest = head.partition(" ")
            rest = rest.strip()
            expect = "ok"
            if rest.startswith("error"):
                expect, rest = "error", rest[len("error"):].strip()
            variables = dict(context)
            if rest:
                variables.update(json.loads(rest))
            current = {"name": name, "expect": expect, "variables": variables, "lines": []}
        elif current is not None:
            current["lines"].append(line)
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"{path}: text before the first case: {line!r}")
    if current:
        cases.append(current)
    names = set()
    for case in cases:
        case["template"] = "\n".join(case.pop("lines"))
        if case["name"] in names:
            raise ValueError(f"{path}: two cases named {case['name']}")
        names.add(case["name"])
    return cases


# ---------------------------------------------------------------------------------------------
# Running kvgrid.

def run_batch(exe, cases, timeout=600):
    """Renders [{"template", "variables"}] with `kvgrid chat-template --batch`; returns one
    {"ok", "text"|"error"} per case. A batch process that dies on a case is restarted after it,
    and that case reads {"ok": False, "crash": ...}."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cases.jsonl"
        while len(results) < len(cases):
            rest = cases[len(results):]
            path.write_text("".join(json.dumps({"template": c["template"],
                                                "variables": c["variables"]},
                                               ensure_ascii=False) + "\n" for c in rest),
                            encoding="utf-8")
            p = subprocess.run([str(exe), "chat-template", "--batch", str(path)],
                               capture_output=True, timeout=timeout)
            lines = [ln for ln in p.stdout.decode("utf-8", "replace").split("\n") if ln]
            for ln in lines[:len(rest)]:
                try:
                    results.append(json.loads(ln))
                except json.JSONDecodeError:
                    results.append({"ok": False, "crash": f"unparsable output line {ln[:200]!r}"})
            if len(lines) >= len(rest):
                break
            # The process stopped before answering every case: the next one is the culprit.
            results.append({"ok": False, "crash": f"exit status {p.returncode}; stderr: "
                                                  f"{p.stderr.decode('utf-8', 'replace')[-500:]}"})
    return results


def run_chat(exe, template_path, request, tmp_dir, timeout=60):
    """`kvgrid chat-template --template FILE --request REQUEST.json`: (returncode, stdout text,
    stderr text)."""
    fd, req_path = tempfile.mkstemp(suffix=".json", dir=tmp_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(request, f, ensure_ascii=False)
    p = subprocess.run([str(exe), "chat-template", "--template", str(template_path),
                        "--request", req_path], capture_output=True, timeout=timeout)
    os.unlink(req_path)
    return (p.returncode, p.stdout.decode("utf-8", "surrogateescape"),
            p.stderr.decode("utf-8", "replace"))


def run_chat_many(exe, jobs, tmp_dir, workers=8):
    """run_chat for each (template_path, request) of `jobs`, in parallel, in order."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: run_chat(exe, job[0], job[1], tmp_dir), jobs))


def compare(expected, got):
    """None when kvgrid's result `got` ({"ok", "text"|"error"}) agrees with the reference's
    (ok, text|error), else a one-paragraph description of the difference."""
    ok, value = expected
    if got.get("crash"):
        return f"kvgrid crashed: {got['crash']}"
    if ok and got.get("ok"):
        if got.get("text") == value:
            return None
        return f"text differs:\n  expected {value!r}\n  got      {got.get('text')!r}"
    if ok:
        return f"kvgrid failed: {got.get('error')!r}\n  expected {value!r}"
    if got.get("ok"):
        return f"jinja2 fails ({value}) but kvgrid rendered {got.get('text')!r}"
    return None


def describe_first_difference(a, b):
    """Where two texts part, for messages about long renders."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return f"first difference at character {n}: expected {a[n:n + 60]!r}, got {b[n:n + 60]!r}"
