"""`kvgrid chat-template` against the reference: Python's jinja2 configured as Hugging Face
transformers configures it for apply_chat_template (jinja_reference.py), byte for byte, on
the corpus in tests/data/chat_templates:

  templates/      chat templates written for these tests in the styles of the model families
                  users run (ChatML, Llama 3.x, Mistral, Gemma, Phi-3, DeepSeek, Granite,
                  SmolLM, Hermes with named templates, Qwen3), templates that exercise the
                  language's constructs, and the templates of two real tokenizer_config.json
                  files (Llama 3 and Qwen3; copies of ../shared/tokenizers, less the vocabulary)
  conversations/  requests: messages, tools, documents, and template variables
  snippets.txt    focused cases with the variables of context.json
  expected_errors.json  the (template, conversation) pairs on which jinja2 raises

Where jinja2 renders, kvgrid must print the same bytes; where jinja2 raises, kvgrid must fail
(exit status 1 with a message, or {"ok": false} in --batch mode).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jinja_reference as jr

CONVERSATIONS = jr.load_conversations()
TEMPLATES = jr.template_files()
SNIPPETS = jr.load_snippets()
EXPECTED_ERRORS = json.loads((jr.DATA_DIR / "expected_errors.json").read_text())
PAIRS = [(t, c) for t in TEMPLATES for c in CONVERSATIONS]
SHARED_TOKENIZERS = Path(os.environ.get("KVGRID_SHARED_TOKENIZERS",
                                        jr.SOURCE_DIR.parent / "shared" / "tokenizers"))
# Copies in templates/ of the real files there (chat template and special tokens only).
REAL_COPIES = {"llama3": "llama3_tokenizer_config.json", "qwen": "qwen3_tokenizer_config.json"}


def _uses_clock(source):
    return "strftime_now" in source


def _expected(template_name, conversation_name):
    return jr.render_chat(TEMPLATES[template_name], CONVERSATIONS[conversation_name])


def _agrees(expected_before, template_name, conversation_name, got):
    """compare() against the reference rendered before kvgrid ran, and once more after for
    templates that read the clock (a date may change in between)."""
    problem = jr.compare(expected_before, got)
    if problem and _uses_clock(json.dumps(TEMPLATES[template_name].templates)):
        problem = jr.compare(_expected(template_name, conversation_name), got)
    return problem


# ---------------------------------------------------------------------------------------------
# The corpus itself, against jinja2 alone: it renders and raises where it is meant to.

def test_corpus_raises_exactly_where_listed():
    raised = {}
    for t, c in PAIRS:
        ok, _ = _expected(t, c)
        if not ok:
            raised.setdefault(t, []).append(c)
    assert raised == EXPECTED_ERRORS


def test_corpus_snippets_behave_as_marked():
    wrong = [(c["name"], c["expect"], jr.render(c["template"], c["variables"]))
             for c in SNIPPETS
             if jr.render(c["template"], c["variables"])[0] != (c["expect"] == "ok")]
    assert not wrong


def test_corpus_copies_of_real_templates_are_current():
    if not SHARED_TOKENIZERS.is_dir():
        pytest.skip(f"{SHARED_TOKENIZERS} is absent")
    for folder, copy in REAL_COPIES.items():
        original = json.loads((SHARED_TOKENIZERS / folder / "tokenizer_config.json").read_text())
        ours = json.loads((jr.DATA_DIR / "templates" / copy).read_text())
        assert ours["chat_template"] == original["chat_template"], copy


# ---------------------------------------------------------------------------------------------
# Every (template, conversation) pair: through --batch (the interpreter, with the variables
# transformers builds) and through --template/--request (kvgrid's own request handling).

@pytest.fixture(scope="module")
def batch_pairs(kvgrid_exe):
    cases, expected = [], []
    for t, c in PAIRS:
        tf, req = TEMPLATES[t], CONVERSATIONS[c]
        try:
            source = tf.select(req.get("tools"))
        except ValueError:
            source = None
        cases.append({"template": source if source is not None else "{{ raise_exception('x') }}",
                      "variables": jr.chat_variables(req, tf.special_tokens)})
        expected.append(_expected(t, c))
    results = jr.run_batch(kvgrid_exe, cases)
    return {pair: (exp, got) for pair, exp, got in zip(PAIRS, expected, results)}


@pytest.mark.parametrize("template,conversation", PAIRS)
def test_pair_batch(batch_pairs, template, conversation):
    expected, got = batch_pairs[(template, conversation)]
    problem = _agrees(expected, template, conversation, got)
    assert problem is None, problem


@pytest.fixture(scope="module")
def cli_pairs(kvgrid_exe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("requests")
    expected = [_expected(t, c) for t, c in PAIRS]
    jobs = [(TEMPLATES[t].path, CONVERSATIONS[c]) for t, c in PAIRS]
    results = jr.run_chat_many(kvgrid_exe, jobs, tmp)
    return {pair: (exp, got) for pair, exp, got in zip(PAIRS, expected, results)}


def _cli_result(rc, out, err):
    if rc == 0:
        return {"ok": True, "text": out}
    if rc == 1:
        return {"ok": False, "error": err}
    return {"ok": False, "crash": f"exit status {rc}; stderr: {err[-500:]}"}


@pytest.mark.parametrize("template,conversation", PAIRS)
def test_pair_cli(cli_pairs, template, conversation):
    expected, (rc, out, err) = cli_pairs[(template, conversation)]
    got = _cli_result(rc, out, err)
    problem = _agrees(expected, template, conversation, got)
    assert problem is None, problem
    if not expected[0]:
        assert err.strip(), "a failure must say why on stderr"
        if expected[1].startswith("TemplateError: "):  # raise_exception: the message verbatim
            assert expected[1][len("TemplateError: "):] in err, err


# ---------------------------------------------------------------------------------------------
# Focused cases.

@pytest.fixture(scope="module")
def batch_snippets(kvgrid_exe):
    before = [jr.render(c["template"], c["variables"]) for c in SNIPPETS]
    got = jr.run_batch(kvgrid_exe, SNIPPETS)
    return {c["name"]: (exp, g) for c, exp, g in zip(SNIPPETS, before, got)}


@pytest.mark.parametrize("name", [c["name"] for c in SNIPPETS])
def test_snippet(batch_snippets, name):
    case = next(c for c in SNIPPETS if c["name"] == name)
    expected, got = batch_snippets[name]
    if name.endswith("_beyond_64_bits"):
        # kvgrid's integers are 64-bit by design (README): where jinja2 prints an integer that
        # needs more, kvgrid must refuse with an error saying so, never print something else.
        assert expected[0] and re.search(r"\d{19,}", expected[1]), expected
        assert not got.get("ok"), got
        assert ("integer overflow" in got.get("error", "")
                or "integer literal out of range" in got.get("error", "")), got
        return
    problem = jr.compare(expected, got)
    if problem and _uses_clock(case["template"]):
        problem = jr.compare(jr.render(case["template"], case["variables"]), got)
    assert problem is None, f"{problem}\n--- template ---\n{case['template']}"


def _batch_one(exe, template, variables=None, timeout=600):
    return jr.run_batch(exe, [{"template": template, "variables": variables or {}}],
                        timeout=timeout)[0]


def _assert_batch_matches(exe, template, variables=None):
    problem = jr.compare(jr.render(template, variables or {}), _batch_one(exe, template, variables))
    assert problem is None, f"{problem}\n--- template ---\n{template!r}"


@pytest.mark.parametrize("template", [
    "a\r\nb{% if true %}\r\nc{% endif %}\r\nd\r\n",
    "{{ 'x' }}\r\n{% for i in [1] %}\r\n  {{ i }}\r\n{% endfor %}\r\n",
    "one\rtwo\n",
    "{% set s %}\r\nblock\r\n{% endset %}{{ s | tojson }}",
], ids=["crlf", "crlf_loop", "cr", "crlf_block_set"])
def test_line_endings_are_normalized(kvgrid_exe, template):
    # jinja2 turns \r\n and \r in template text into \n (newline_sequence).
    _assert_batch_matches(kvgrid_exe, template)


@pytest.mark.parametrize("source", ["Hi {{ name }}\n", "Hi {{ name }}\n\n", "Hi {{ name }}",
                                    "{% if true %}x{% endif %}\n", "x\n\n\n"],
                         ids=["one", "two", "none", "after_block", "three"])
def test_jinja_file_final_newline(kvgrid_exe, tmp_path, source):
    # keep_trailing_newline=False: jinja2 drops one final newline of the template.
    path = tmp_path / "t.jinja"
    path.write_text(source)
    request = {"messages": [], "name": "Ann"}
    ok, text = jr.render_chat(jr.TemplateFile(path), request)
    rc, out, err = jr.run_chat(kvgrid_exe, path, request, tmp_path)
    assert (rc, out) == (0, text), err


def test_batch_output_is_one_line_per_case(kvgrid_exe):
    cases = [{"template": t, "variables": {"x": "a\nb"}} for t in
             ["{{ x }}", "{{ 1/0 }}", "", "{{ x }}\n\n", "{% if %}", "\u2028{{ '\u2029' }}"]]
    got = jr.run_batch(kvgrid_exe, cases)
    assert len(got) == len(cases)
    for case, g in zip(cases, got):
        assert jr.compare(jr.render(case["template"], case["variables"]), g) is None, (case, g)


# ---------------------------------------------------------------------------------------------
# Template files: named templates, special tokens, the real tokenizer_config.json files, GGUF.

def _write_config(path, **config):
    path.write_text(json.dumps(config, ensure_ascii=False))
    return path


def _assert_cli_matches(exe, path, request, tmp_path):
    ok, text = jr.render_chat(jr.TemplateFile(path), request)
    rc, out, err = jr.run_chat(exe, path, request, tmp_path)
    if ok:
        assert rc == 0, f"kvgrid failed ({rc}): {err}\nexpected {text!r}"
        assert out == text, jr.describe_first_difference(text, out)
    else:
        assert rc == 1, f"jinja2 fails ({text}) but kvgrid exited {rc} with {out!r} {err!r}"
        assert err.strip()


@pytest.mark.parametrize("request_name,expect", [
    ("basic", "default"), ("tools", "tool_use"), ("tools_empty_list", "tool_use")])
def test_named_templates_choice(kvgrid_exe, tmp_path, request_name, expect):
    # transformers: "tool_use" when tools is not None (an empty list too) and the file has it.
    path = _write_config(tmp_path / "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "default:{{ messages | length }}"},
        {"name": "tool_use", "template": "tool_use:{{ tools | length }}"},
        {"name": "other", "template": "other"}])
    request = CONVERSATIONS[request_name]
    ok, text = jr.render_chat(jr.TemplateFile(path), request)
    assert ok and text.startswith(expect + ":")
    _assert_cli_matches(kvgrid_exe, path, request, tmp_path)


def test_named_templates_without_default(kvgrid_exe, tmp_path):
    path = _write_config(tmp_path / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "tools only"}])
    _assert_cli_matches(kvgrid_exe, path, CONVERSATIONS["tools"], tmp_path)
    rc, out, err = jr.run_chat(kvgrid_exe, path, CONVERSATIONS["basic"], tmp_path)
    assert rc == 1 and err.strip(), (rc, out, err)  # transformers: no default template


def test_special_tokens_from_config(kvgrid_exe, tmp_path):
    # Tokens as strings or {"content": ...}; a null or empty token is not a variable at all.
    path = _write_config(
        tmp_path / "tokenizer_config.json",
        chat_template="[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}][{{ unk_token is defined }}]"
                      "[{{ sep_token is defined }}][{{ bos_token is none }}]{{ messages | length }}",
        bos_token=None, eos_token={"content": "</é>", "lstrip": False}, pad_token="",
        unk_token=None, sep_token="<sep>")
    _assert_cli_matches(kvgrid_exe, path, {"messages": []}, tmp_path)


def test_special_tokens_overridden_by_request(kvgrid_exe, tmp_path):
    path = _write_config(tmp_path / "tokenizer_config.json",
                         chat_template="{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}",
                         bos_token="<s>", eos_token={"content": "</s>"})
    _assert_cli_matches(kvgrid_exe, path, {"messages": [], "eos_token": "E",
                                           "add_generation_prompt": True}, tmp_path)


def test_additional_special_tokens_variable(kvgrid_exe, tmp_path):
    # transformers passes special_tokens_map, additional_special_tokens (a list) included.
    path = _write_config(tmp_path / "tokenizer_config.json",
                         chat_template="{{ additional_special_tokens | default('absent') }}",
                         additional_special_tokens=["<a>", {"content": "<b>"}])
    _assert_cli_matches(kvgrid_exe, path, {"messages": []}, tmp_path)


def test_request_defaults(kvgrid_exe, tmp_path):
    # tools and documents are None (defined) when the request has none; add_generation_prompt
    # is False.
    path = tmp_path / "t.jinja"
    path.write_text("{{ tools is defined }} {{ tools is none }} {{ documents is none }} "
                    "{{ add_generation_prompt }} {{ add_generation_prompt is false }} "
                    "{{ messages | length }} {{ enable_thinking is defined }}")
    _assert_cli_matches(kvgrid_exe, path, {"messages": [{"role": "user", "content": "x"}]},
                        tmp_path)


@pytest.mark.parametrize("folder", sorted(REAL_COPIES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_shared_real_tokenizer_config(kvgrid_exe, tmp_path, folder, conversation):
    # The full file (with its vocabulary's added_tokens_decoder), where ../shared has it.
    path = SHARED_TOKENIZERS / folder / "tokenizer_config.json"
    if not path.is_file():
        pytest.skip(f"{path} is absent (the copy in templates/ is checked in test_pair_*)")
    _assert_cli_matches(kvgrid_exe, path, CONVERSATIONS[conversation], tmp_path)


def _write_gguf(path, chat_template, tokens=None, bos_id=None, eos_id=None):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_chat_template(chat_template)
    if tokens is not None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_types([1] * len(tokens))
        if bos_id is not None:
            w.add_bos_token_id(bos_id)
        if eos_id is not None:
            w.add_eos_token_id(eos_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("conversation", ["basic", "tools", "thinking", "unicode"])
def test_gguf_chat_template(kvgrid_exe, tmp_path, conversation):
    source = TEMPLATES["qwen3_tokenizer_config.json"].templates
    path = _write_gguf(tmp_path / "m.gguf", source)
    request = CONVERSATIONS[conversation]
    ok, text = jr.render(source, jr.chat_variables(request))
    rc, out, err = jr.run_chat(kvgrid_exe, path, request, tmp_path)
    assert ok and (rc, out) == (0, text), (rc, err)


@pytest.mark.parametrize("request_name,expect", [("basic", "default"), ("tools", "tool_use")])
def test_gguf_named_templates(kvgrid_exe, tmp_path, request_name, expect):
    # llama.cpp's convention: tokenizer.chat_template (default), tokenizer.chat_templates (the
    # other names) and tokenizer.chat_template.<name>; chosen as transformers chooses.
    path = _write_gguf(tmp_path / "m.gguf", [
        {"name": "default", "template": "default:{{ messages | length }}"},
        {"name": "tool_use", "template": "tool_use:{{ tools | length }}"}])
    rc, out, err = jr.run_chat(kvgrid_exe, path, CONVERSATIONS[request_name], tmp_path)
    assert rc == 0 and out.startswith(expect + ":"), (rc, out, err)


def test_gguf_special_tokens_from_vocabulary(kvgrid_exe, tmp_path):
    # A GGUF has no tokenizer_config.json; its bos/eos token ids name the tokens that
    # transformers (loading the GGUF) and llama.cpp give the template as bos_token/eos_token.
    path = _write_gguf(tmp_path / "m.gguf", "[{{ bos_token }}][{{ eos_token }}]",
                       tokens=["<unk>", "<s>", "</s>", "a"], bos_id=1, eos_id=2)
    rc, out, err = jr.run_chat(kvgrid_exe, path, {"messages": []}, tmp_path)
    assert (rc, out) == (0, "[<s>][</s>]"), err


@pytest.mark.parametrize("make,needle", [
    (lambda d: d / "missing.jinja", "missing.jinja"),
    (lambda d: _write_config(d / "no_template.json", bos_token="<s>"), "no_template.json"),
    (lambda d: (d / "broken.json").write_text('{"chat_template": "x",') and d / "broken.json",
     "broken.json"),
    (lambda d: (d / "bad.jinja").write_text("{% if %}") and d / "bad.jinja", "bad.jinja"),
], ids=["missing", "no_chat_template", "malformed_json", "syntax_error"])
def test_bad_template_files(kvgrid_exe, tmp_path, make, needle):
    path = make(tmp_path)
    rc, out, err = jr.run_chat(kvgrid_exe, path, {"messages": []}, tmp_path)
    assert rc == 1 and needle in err, (rc, out, err)


def test_raise_exception_exit_status_and_message(kvgrid_exe, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("before{{ raise_exception('Only \"user\" roles, é: ' ~ messages[0].role) }}")
    rc, out, err = jr.run_chat(kvgrid_exe, path, CONVERSATIONS["basic"], tmp_path)
    assert rc == 1, (rc, out, err)
    assert 'Only "user" roles, é: system' in err
    assert out == "", "nothing is printed when the template fails"


# ---------------------------------------------------------------------------------------------
# Errors: syntax errors name their line; templates that run away stop in bounded time.

SYNTAX_ERRORS = [
    ("unknown_tag", "a\nb\n{% frobnicate %}\n", 3),
    ("bad_expression", "\n\n\n{{ 1 + }}", 4),
    ("unknown_filter", "ok\n{{ x | no_such_filter }}", 2),
    ("unknown_test", "\n\n{{ x is no_such_test }}", 3),
    ("endfor_in_if", "{% if true %}\n\n{% endfor %}", 3),
    ("unclosed_string", "x\n{{ 'abc }}", 2),
    ("unclosed_if", "x\n{% if true %}\nnever closed\n", None),
    ("unclosed_for", "{% for x in y %}\n{{ x }}", None),
    ("unclosed_comment", "\n{# never closed", None),
    ("unclosed_expression", "line\n{{ x", None),
    ("stray_endif", "text\n{% endif %}", 2),
    ("else_twice", "{% if x %}\n{% else %}\n{% else %}\n{% endif %}", 3),
    ("bad_set_target", "\n{% set 1 = 2 %}", 2),
    ("macro_without_name", "\n\n{% macro %}{% endmacro %}", 3),
    ("unbalanced_parens", "{{ (1 + 2 }}", 1),
    ("bad_token", "\n{{ 1 $ 2 }}", 2),
]


@pytest.mark.parametrize("name,template,line", SYNTAX_ERRORS, ids=[s[0] for s in SYNTAX_ERRORS])
def test_syntax_error_names_line(kvgrid_exe, tmp_path, name, template, line):
    ok, why = jr.render(template, {"x": 1, "y": []})
    assert not ok, "jinja2 rejects it too"
    got = _batch_one(kvgrid_exe, template, {"x": 1, "y": []})
    assert not got.get("ok") and not got.get("crash"), got
    numbers = re.findall(r"(?::|line )(\d+)", got.get("error", ""))
    assert numbers, f"no line number in {got.get('error')!r}"
    if line is not None:
        assert str(line) in numbers, f"expected line {line} in {got.get('error')!r}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    rc, out, err = jr.run_chat(kvgrid_exe, path, {"messages": []}, tmp_path)
    assert rc == 1 and re.search(r"(?::|line )\d+", err), (rc, out, err)


@pytest.mark.parametrize("template,line", [
    ("a\n\n{{ 1 / 0 }}", 3),
    ("{% for m in messages %}\n{{ m.content.upper() }}\n{{ m.nope.deeper }}\n{% endfor %}", 3),
    ("\n{% if true %}\n  {{ raise_exception('boom') }}\n{% endif %}", 3),
])
def test_render_error_names_line(kvgrid_exe, template, line):
    variables = {"messages": [{"content": "x"}]}
    assert not jr.render(template, variables)[0]
    got = _batch_one(kvgrid_exe, template, variables)
    assert not got.get("ok") and not got.get("crash"), got
    assert str(line) in re.findall(r"(?::|line )(\d+)", got.get("error", "")), got


RUNAWAY = {
    "range_1e9": "{% for i in range(10**9) %}{% endfor %}",
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}"
                     "{% endfor %}{% endfor %}",
    "nested_ranges_no_output": "{% set ns = namespace(n=0) %}{% for i in range(100000) %}"
                               "{% for j in range(100000) %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                               "{% endfor %}{{ ns.n }}",
    "macro_recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "macro_recursion_no_output": "{% macro f(n) %}{% set x = f(n + 1) %}{% endmacro %}{{ f(0) }}",
    "mutual_recursion": "{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}"
                        "{% endmacro %}{{ a(0) }}",
    "caller_recursion": "{% macro m() %}{% call m() %}{% endcall %}{% endmacro %}{{ m() }}",
    "string_doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "list_doubling": "{% set ns = namespace(l=[0]) %}{% for i in range(40) %}"
                     "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
    "string_repeat": "{{ ('x' * 10**10) | length }}",
    "list_repeat": "{{ ([0] * 10**10) | length }}",
    "string_repeat_100mb": "{{ 'x' * 100000000 }}",
    "output_100mb": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "center_huge": "{{ 'x' | center(10**10) }}",
    "indent_huge": "{{ 'a\nb' | indent(10**10) }}",
    "format_huge": "{{ '%9999999999s' % 'x' }}",
    "join_doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                     "{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}{{ ns.s | length }}",
    # Small values that share their parts, standing for exponentially large ones.
    "shared_list_doubling": "{% set ns = namespace(l=[0]) %}{% for i in range(64) %}"
                            "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "shared_list_doubling_in_macro_args": "{% macro m(x, n) %}{% if n %}{{ m([x, x], n - 1) }}"
                                          "{% else %}{{ x == x }}{% endif %}{% endmacro %}"
                                          "{{ m([1], 100) }}",
    "shared_namespace_doubling": "{% set ns = namespace(a=1) %}{% for i in range(64) %}"
                                 "{% set n = namespace() %}{% set n.a = (ns.a, ns.a) %}"
                                 "{% set ns.a = n %}{% endfor %}{{ ns.a }}",
    "long_string_many_times": "{% set s = 'x' * 1000000 %}{{ [s] * 1000 }}",
}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_fails_in_bounded_time(kvgrid_exe, name):
    # Not rendered with jinja2: some of these would hang it or exhaust memory.
    try:
        got = _batch_one(kvgrid_exe, RUNAWAY[name], timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("kvgrid chat-template ran for more than 20 s")
    assert not got.get("crash"), got
    assert got.get("ok") is False and got.get("error"), got


# Deep nesting that jinja2 rejects only because Python's recursion limit is reached: kvgrid may
# render it (then exactly) or refuse it with an error, but must not crash or hang.
_DEEP_LIST = "{% set ns = namespace(x=[], y=[]) %}{% for i in range(100000) %}" \
             "{% set ns.x = [ns.x] %}{% set ns.y = [ns.y] %}{% endfor %}"
DEEP = {
    "deep_list_tojson": (_DEEP_LIST + "{{ ns.x | tojson }}", "[" * 100001 + "]" * 100001),
    "deep_list_print": (_DEEP_LIST + "{{ ns.x }}", "[" * 100001 + "]" * 100001),
    "deep_list_compare": (_DEEP_LIST + "{{ ns.x == ns.y }}", "True"),
    "deep_list_length": (_DEEP_LIST + "{{ ns.x | string | length }}", "200002"),
    "deep_parens": ("{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}", "1"),
    "deep_ifs": ("{% if true %}" * 20000 + "x" + "{% endif %}" * 20000, "x"),
    "deep_filters": ("{{ 1" + " | string" * 100000 + " }}", "1"),
    "deep_not": ("{{ " + "not " * 100001 + "true }}", "False"),
    "deep_minus": ("{{ " + "-" * 100001 + "1 }}", "-1"),
    "long_chain": ("{{ 1" + " + 1" * 200000 + " }}", "200001"),
    # Each namespace holds the next: freeing the first must not recurse down the chain.
    "namespace_chain": ("{% set root = namespace(next=none) %}{% set ns = namespace(cur=root) %}"
                        "{% for j in range(3) %}{% for i in range(100000) %}"
                        "{% set n = namespace(next=none) %}{% set c = ns.cur %}"
                        "{% set c.next = n %}{% set ns.cur = n %}{% endfor %}{% endfor %}done",
                        "done"),
    "deep_macro_nesting": ("{% macro m(n) %}{% if n > 0 %}({{ m(n - 1) }}){% endif %}{% endmacro %}"
                           "{{ m(5000) }}", "(" * 5000 + ")" * 5000),
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deep_nesting_renders_or_fails_cleanly(kvgrid_exe, name):
    template, text = DEEP[name]
    try:
        got = _batch_one(kvgrid_exe, template, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("kvgrid chat-template ran for more than 20 s")
    assert not got.get("crash"), got
    if got.get("ok"):
        assert got["text"] == text, jr.describe_first_difference(text, got["text"])
    else:
        assert got.get("error"), got


def test_runaway_template_through_cli(kvgrid_exe, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(RUNAWAY["nested_ranges"])
    try:
        rc, out, err = jr.run_chat(kvgrid_exe, path, {"messages": []}, tmp_path, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("kvgrid chat-template ran for more than 20 s")
    assert rc == 1 and err.strip(), (rc, out[:200], err)


@pytest.mark.parametrize("depth", [500, 100000])
def test_deep_request_json(kvgrid_exe, tmp_path, depth):
    # A deeply nested request value must not crash the parser or the printer.
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages | length }}{{ deep | length }}{{ deep | tojson | length }}")
    request_text = '{"messages": [], "deep": ' + "[" * depth + "]" * depth + "}"
    req = tmp_path / "req.json"
    req.write_text(request_text)
    p = subprocess.run([str(kvgrid_exe), "chat-template", "--template", str(path),
                        "--request", str(req)], capture_output=True, text=True, timeout=20)
    assert p.returncode in (0, 1), (p.returncode, p.stderr[-500:])
    if p.returncode == 0 and depth < sys.getrecursionlimit() - 100:
        ok, text = jr.render(path.read_text(), json.loads(request_text))
        assert not ok or p.stdout == text
    if p.returncode == 1:
        assert p.stderr.strip()


def test_batch_keeps_going_after_failures(kvgrid_exe):
    cases = [{"template": RUNAWAY["macro_recursion"], "variables": {}},
             {"template": "{{ x }}", "variables": {"x": "after"}},
             {"template": "{% endif %}", "variables": {}},
             {"template": RUNAWAY["string_doubling"], "variables": {}},
             {"template": "{{ x ~ '!' }}", "variables": {"x": "still"}}]
    got = jr.run_batch(kvgrid_exe, cases, timeout=60)
    assert [g.get("ok") for g in got] == [False, True, False, False, True], got
    assert got[1]["text"] == "after" and got[4]["text"] == "still!"


def test_help_exits_zero(kvgrid_exe):
    p = subprocess.run([str(kvgrid_exe), "chat-template", "--help"], capture_output=True,
                       text=True, timeout=20)
    assert p.returncode == 0 and "--template" in (p.stdout + p.stderr)
