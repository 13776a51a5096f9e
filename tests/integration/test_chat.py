"""Chat requests end to end: messages rendered by the model's chat template on the coordinator
(compared with jinja2 configured as transformers configures it, and with `kvgrid
chat-template`), generated like the same prompt as token ids, stopped by the template's
end-of-turn token, with n > 1 and streaming; errors naming the field; `kvgrid generate --chat`,
`kvgrid chat` driven through a pipe, and `kvgrid serve --chat-template`."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import tokenizers

from kvgrid_client import pb

from .conftest import (MODEL_DIR, SOURCE_DIR, Proc, collect, executable, free_port, rpc_error,
                       wait_until)

sys.path.insert(0, str(SOURCE_DIR / "tests" / "reference"))
import jinja_reference  # noqa: E402  (tests/reference: jinja2 as transformers renders)

LLAMA3_EOS = {128001, 128009}  # the fixture's generation_config.json

CONVERSATION = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Who made the heaven and the earth?"}]


@pytest.fixture(scope="module")
def fixtures_dir():
    d = os.environ.get("KVGRID_FIXTURES")
    if not d or not (Path(d) / "llama3-tiny" / "tokenizer_config.json").exists():
        pytest.fail("KVGRID_FIXTURES must hold the tiny fixture models (ctest sets it)")
    return Path(d)


@pytest.fixture(scope="module")
def llama(module_cluster, fixtures_dir):
    return module_cluster(workers=1, model_dir=fixtures_dir / "llama3-tiny",
                          worker_args=["--kv-cache-memory", "16MiB", "--threads", "1"])


@pytest.fixture(scope="module")
def qwen(module_cluster, fixtures_dir):
    return module_cluster(workers=1, model_dir=fixtures_dir / "qwen2-tiny",
                          worker_args=["--kv-cache-memory", "16MiB", "--threads", "1"])


def reference_render(template_path, request):
    """The prompt text transformers' apply_chat_template gives for `request`."""
    ok, text = jinja_reference.render_chat(jinja_reference.TemplateFile(template_path), request)
    assert ok, text
    return text


def kvgrid_render(template_path, request, tmp_path):
    """`kvgrid chat-template --template F --request R`, or None while the command is not
    built into kvgrid."""
    exe = executable("kvgrid")
    probe = subprocess.run([str(exe), "chat-template", "--help"], capture_output=True)
    if probe.returncode != 0:
        return None
    rc, out, err = jinja_reference.run_chat(exe, template_path, request, tmp_path)
    assert rc == 0, err
    return out


def check_rendering(cluster, template_path, request, tmp_path, **params):
    """Generates a chat request greedily and checks it saw the prompt the template renders:
    usage.prompt_tokens is that text's token count, and the same text as token ids generates
    the same tokens. Returns (the chat Completion, the rendered text)."""
    text = reference_render(template_path, request)
    ours = kvgrid_render(template_path, request, tmp_path)
    if ours is not None:
        assert ours == text, jinja_reference.describe_first_difference(text, ours)
    client = cluster.client
    chat_fields = {k: request[k] for k in ("tools", "documents", "add_generation_prompt")
                   if k in request}
    extra = {k: v for k, v in request.items() if k not in ("messages", *chat_fields)}
    if extra:
        chat_fields["chat_template_kwargs"] = extra
    chat = client.generate_text(messages=request["messages"], temperature=0, ignore_eos=True,
                                **chat_fields, **params)
    ids = client.tokenize(text)
    assert chat.usage.prompt_tokens == len(ids), (chat.usage, text)
    as_ids = client.generate_text(prompt_token_ids=ids, temperature=0, ignore_eos=True, **params)
    assert chat.token_ids == as_ids.token_ids
    assert chat.text == as_ids.text
    return chat, text


def test_llama3_chat_renders_as_transformers_does(llama, fixtures_dir, tmp_path):
    template = fixtures_dir / "llama3-tiny" / "tokenizer_config.json"
    request = {"messages": CONVERSATION, "add_generation_prompt": True}
    chat, text = check_rendering(llama, template, request, tmp_path, max_new_tokens=12)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert len(chat.token_ids) == 12 and chat.finish_reason == "length"
    # One BOS, also when add_bos asks for it.
    ids = llama.client.tokenize(text)
    assert ids.count(128000) == 1 and ids[0] == 128000
    again = llama.client.generate_text(messages=CONVERSATION, add_bos=True, temperature=0,
                                       ignore_eos=True, max_new_tokens=12)
    assert again.usage.prompt_tokens == len(ids)
    assert again.token_ids == chat.token_ids


def test_qwen_tools_and_thinking_render_as_transformers_does(qwen, fixtures_dir, tmp_path):
    template = fixtures_dir / "qwen2-tiny" / "tokenizer_config.json"
    corpus = jinja_reference.load_conversations()
    texts = {}
    for name in ("tools", "thinking_disabled", "multi_turn_no_prompt"):
        request = dict(corpus[name])
        request.setdefault("add_generation_prompt", False)
        chat, texts[name] = check_rendering(qwen, template, request, tmp_path, max_new_tokens=4)
        assert len(chat.token_ids) == 4, name
    # The tools and the tool calls' arguments reached the template as dicts.
    assert "<tools>" in texts["tools"] and '"arguments": {"city": "Paris"' in texts["tools"]
    assert texts["thinking_disabled"].endswith("<think>\n\n</think>\n\n")


def test_chat_n_and_streaming(llama):
    client = llama.client
    responses = list(client.generate(messages=CONVERSATION, max_new_tokens=16, temperature=0))
    assert responses
    finished = [r.finish_reason != pb.FINISH_REASON_UNSPECIFIED for r in responses]
    assert finished == [False] * (len(responses) - 1) + [True], responses
    done = collect(iter(responses))
    assert done.token_ids and done.usage.completion_tokens == len(done.token_ids)

    completions = client.generate_completions(messages=CONVERSATION, n=3, temperature=1.0,
                                              seed=11, max_new_tokens=8, ignore_eos=True)
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in completions)
    assert len({c.usage.prompt_tokens for c in completions}) == 1
    assert completions[0].usage.prompt_tokens == done.usage.prompt_tokens
    assert len({tuple(c.token_ids) for c in completions}) > 1, "n samples, not one repeated"


@pytest.fixture(scope="module")
def end_of_turn(llama, fixtures_dir, tmp_path_factory):
    """A copy of llama3-tiny whose tokenizer_config.json makes a token the model greedily
    emits for CONVERSATION (not at once, not one of its EOS ids) the eos_token, as
    `<|eot_id|>` is Llama 3 Instruct's. Returns (model dir, the greedy tokens past it, where
    the turn ends, the token)."""
    greedy = llama.client.generate_text(messages=CONVERSATION, temperature=0, ignore_eos=True,
                                        max_new_tokens=16).token_ids
    assert not LLAMA3_EOS & set(greedy), f"the fixture's EOS ends {greedy} already"
    k = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    src = fixtures_dir / "llama3-tiny"
    token = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json")).id_to_token(greedy[k])
    assert token, greedy[k]
    model = tmp_path_factory.mktemp("eot") / "llama3-eot"
    model.mkdir()
    # Copies: kvgrid refuses a model file that links outside its directory.
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(src / f, model / f)
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["eos_token"] = token
    (model / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return model, greedy, k, greedy[k]


def test_the_end_of_turn_token_stops_a_chat(cluster, end_of_turn):
    model, greedy, k, eot = end_of_turn
    c = cluster(workers=1, model_dir=model,
                worker_args=["--kv-cache-memory", "16MiB", "--threads", "1"])
    done = c.client.generate_text(messages=CONVERSATION, temperature=0, max_new_tokens=16)
    assert done.finish_reason == "stop", (done, greedy, k)
    assert done.token_ids == greedy[:k + 1]
    assert done.token_ids[-1] == eot

    for n in completions_of(c, n=2):
        assert n.finish_reason == "stop" and n.token_ids == greedy[:k + 1]
    # ignore_eos ignores it too; a prompt (not a chat) never stops there.
    past = c.client.generate_text(messages=CONVERSATION, temperature=0, max_new_tokens=16,
                                  ignore_eos=True)
    assert past.token_ids == greedy and past.finish_reason == "length"
    ids = c.client.tokenize(reference_render(model / "tokenizer_config.json",
                                             {"messages": CONVERSATION,
                                              "add_generation_prompt": True}))
    prompt = c.client.generate_text(prompt_token_ids=ids, temperature=0, max_new_tokens=16)
    assert prompt.token_ids == greedy and prompt.finish_reason == "length"


def completions_of(c, n):
    return c.client.generate_completions(messages=CONVERSATION, n=n, temperature=0,
                                         max_new_tokens=16)


def test_chat_errors_name_the_field(llama, module_cluster):
    client = llama.client

    def error(**request):
        return rpc_error(lambda: list(client.generate(timeout=30, **request)))

    cases = [
        (dict(messages=CONVERSATION, tools="[{"), "tools_json"),
        (dict(messages=CONVERSATION, tools='{"type": "function"}'), "tools_json"),
        (dict(messages=CONVERSATION, chat_template_kwargs="[]"), "chat_template_kwargs_json"),
        (dict(messages=[{"content": "no role"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content_parts[0].type"),
        (dict(messages=CONVERSATION, prompt="both"), "messages: give one of prompt"),
        (dict(prompt="a prompt", tools=[]), "tools_json: only for chat requests"),
    ]
    for request, needle in cases:
        e = error(**request)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, e.code(), e.details())
        assert needle in e.details(), (request, e.details())

    # A model without a chat template (kjv-tiny has none): refused before placement, so no
    # worker is needed to answer.
    kjv = module_cluster(workers=0, model_dir=MODEL_DIR)
    e = rpc_error(lambda: list(kjv.client.generate(messages=CONVERSATION, timeout=30)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    assert "model 'kjv-tiny' has no chat template" in e.details(), e.details()
    assert "--chat-template" in e.details(), e.details()

    # The cluster serves on.
    assert client.generate_text(messages=CONVERSATION, max_new_tokens=2).finish_reason


def run_cli(*argv, stdin=None, timeout=120):
    p = subprocess.run([str(executable("kvgrid")), *[str(a) for a in argv]], input=stdin,
                       capture_output=True, text=True, timeout=timeout)
    return p


def test_kvgrid_generate_chat(llama):
    p = run_cli("generate", "--addr", llama.addr, "--chat", CONVERSATION[1]["content"],
                "--system", CONVERSATION[0]["content"], "--temperature", 0, "--max-new-tokens",
                10, "--ignore-eos", "--json")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    want = llama.client.generate_text(messages=CONVERSATION, temperature=0, max_new_tokens=10,
                                      ignore_eos=True)
    assert got["token_ids"] == want.token_ids
    assert got["prompt_tokens"] == want.usage.prompt_tokens

    bad = run_cli("generate", "--addr", llama.addr, "--chat", "hi", "--prompt", "hi")
    assert bad.returncode == 2 and "exactly one of" in bad.stderr, bad.stderr
    bad = run_cli("generate", "--addr", llama.addr, "--prompt", "hi", "--system", "s")
    assert bad.returncode == 2 and "--system: only with --chat" in bad.stderr, bad.stderr


def test_kvgrid_chat_keeps_the_conversation(llama):
    flags = ["--temperature", 0, "--max-new-tokens", 6, "--ignore-eos"]
    turns = ["Hello there", "And then?"]
    p = run_cli("chat", "--addr", llama.addr, "--system", "Be kind.", *flags,
                stdin="\n".join(turns) + "\n/exit\nnever sent\n")
    assert p.returncode == 0, p.stderr

    client = llama.client
    messages = [{"role": "system", "content": "Be kind."}]
    want = ""
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = client.generate_text(messages=messages, temperature=0, max_new_tokens=6,
                                     ignore_eos=True)
        messages.append({"role": "assistant", "content": reply.text})
        want += reply.text + "\n"
    assert p.stdout == want, (p.stdout, want)

    # Piped input that fails a turn ends with the error and a non-zero status.
    bad = run_cli("chat", "--addr", llama.addr, "--chat-template-kwargs", "[1]",
                  stdin="Hello\n")
    assert bad.returncode == 2 and "chat_template_kwargs_json" in bad.stderr, bad.stderr


def test_kvgrid_serve_passes_the_chat_template_on(tmp_path):
    """kvgrid serve --chat-template on kjv-tiny (no template of its own): a bare .jinja
    renders with the model's special tokens from its tokenizer_config.json."""
    jinja = tmp_path / "chat.jinja"
    jinja.write_text("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
                     "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    port = free_port()
    serve = Proc("kvgrid-serve", [executable("kvgrid"), "serve", "--model", MODEL_DIR,
                                  "--port", port, "--chat-template", jinja,
                                  "--kv-cache-memory", "16MiB", "--threads", "1",
                                  "--drain-timeout-s", "2"],
                 tmp_path / "serve.log")
    children = []
    try:
        assert wait_until(lambda: "kvgrid serve: ready" in serve.log() or not serve.alive(),
                          timeout=90), serve.describe()
        assert serve.alive(), serve.describe()
        children = _children(serve.pid)
        addr = f"127.0.0.1:{port}"
        p = run_cli("generate", "--addr", addr, "--chat", "And God said", "--temperature", 0,
                    "--max-new-tokens", 12, "--ignore-eos", "--json")
        assert p.returncode == 0, p.stderr + serve.describe()
        got = json.loads(p.stdout)
        rendered = "<|begin_of_text|>user: And God said\nassistant:"
        from kvgrid_client import Client
        with Client(addr, timeout=60) as client:
            want = client.generate_text(rendered, temperature=0, max_new_tokens=12,
                                        ignore_eos=True)
            assert client.tokenize(rendered)[0] == 4094  # one BOS, the model's
        assert got["token_ids"] == want.token_ids
        assert got["prompt_tokens"] == want.usage.prompt_tokens
    finally:
        serve.stop()
        for pid in children:  # should kvgrid serve not have stopped them
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _children(pid):
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]
