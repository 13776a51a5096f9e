"""The OpenAI-compatible HTTP API (kvgrid-coordinator --http-listen), driven with the stock
`openai` Python client and curl against a real cluster: the same request path as gRPC, so
greedy outputs equal Generation.Generate's, a disconnect frees the request's KV blocks, and a
worker killed mid-stream does not break the SSE stream."""

import http.client
import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import httpx
import openai
import pytest

from .conftest import MODEL_DIR, MODEL_ID, Proc, executable, free_port, wait_until

PROMPT = "In the beginning"
CONVERSATION = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Who made the heaven and the earth?"}]
# kjv-tiny has no chat template of its own.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8", "--threads", "1"]


def http_cluster(factory, tmp_path, workers=1, extra=(), worker_args=WORKER_ARGS):
    port = free_port()
    jinja = tmp_path / "chat.jinja"
    jinja.write_text(TEMPLATE)
    c = factory(workers=workers, worker_args=worker_args,
                coordinator_args=["--http-listen", f"127.0.0.1:{port}", "--chat-template", jinja,
                                  *extra])
    c.http_port = port
    c.base_url = f"http://127.0.0.1:{port}"
    return c


@pytest.fixture(scope="module")
def api(module_cluster, tmp_path_factory):
    return http_cluster(module_cluster, tmp_path_factory.mktemp("openai"))


def oai(c, key="unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key=key, max_retries=0, timeout=60,
                         **kw)


def post(c, path, body, headers=None):
    """(status, parsed JSON body) of a raw POST."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(c.base_url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_health_tokenize(api):
    models = oai(api).models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert models.data[0].object == "model" and models.data[0].owned_by == "kvgrid"
    with urllib.request.urlopen(api.base_url + "/health", timeout=10) as r:
        assert r.status == 200
    # add_special_tokens defaults to true, as in vLLM: BOS first.
    status, tok = post(api, "/tokenize", {"model": MODEL_ID, "prompt": PROMPT})
    assert status == 200 and tok["tokens"] == list(api.client.tokenize(PROMPT, add_bos=True))
    status, plain = post(api, "/tokenize", {"model": MODEL_ID, "prompt": PROMPT,
                                            "add_special_tokens": False})
    assert plain["tokens"] == list(api.client.tokenize(PROMPT))
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    status, detok = post(api, "/detokenize", {"model": MODEL_ID, "tokens": plain["tokens"]})
    assert status == 200 and detok["prompt"] == PROMPT


def test_greedy_completion_equals_grpc(api):
    # A text prompt is tokenized with the post-processor's BOS (vLLM's add_special_tokens).
    grpc_done = api.client.generate_text(PROMPT, add_bos=True, temperature=0, max_new_tokens=24,
                                         ignore_eos=True)
    r = oai(api).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL_ID
    assert r.choices[0].text == grpc_done.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == grpc_done.usage.prompt_tokens
    # Token ids as the prompt give the same.
    ids = list(api.client.tokenize(PROMPT, add_bos=True))
    r2 = oai(api).completions.create(model=MODEL_ID, prompt=ids, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert r2.choices[0].text == grpc_done.text
    plain = api.client.generate_text(PROMPT, temperature=0, max_new_tokens=24, ignore_eos=True)
    r3 = oai(api).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert r3.usage.prompt_tokens == r.usage.prompt_tokens - 1
    assert r3.choices[0].text == plain.text


def test_greedy_chat_equals_grpc(api):
    grpc_done = api.client.generate_text(messages=CONVERSATION, temperature=0, max_new_tokens=16,
                                         ignore_eos=True)
    r = oai(api).chat.completions.create(model=MODEL_ID, messages=CONVERSATION, temperature=0,
                                         max_completion_tokens=16,
                                         extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == grpc_done.text
    assert r.usage.prompt_tokens == grpc_done.usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_text_equals_non_streamed(api):
    client = oai(api)
    params = dict(model=MODEL_ID, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPT, **params)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **params))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    chat_whole = client.chat.completions.create(messages=CONVERSATION, **params)
    chat_chunks = list(client.chat.completions.create(messages=CONVERSATION, stream=True,
                                                      stream_options={"include_usage": True},
                                                      **params))
    with_choices = [c for c in chat_chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == \
        chat_whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chat_chunks[-1].choices == [] and chat_chunks[-1].usage.completion_tokens == 20


def test_n_stop_seed_and_prompt_lists(api):
    client = oai(api)
    a = client.completions.create(model=MODEL_ID, prompt=PROMPT, n=2, max_tokens=12, seed=7,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL_ID, prompt=PROMPT, n=2, max_tokens=12, seed=7,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "seeded: reproducible"
    assert a.usage.completion_tokens == 24

    greedy = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24,
                                       temperature=0, extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]

    # Two prompts, n=2: choices numbered prompt by prompt, as OpenAI numbers them.
    two = client.completions.create(model=MODEL_ID, prompt=[PROMPT, "And God said"], n=2,
                                    max_tokens=6, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text == \
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=6,
                                  temperature=0).choices[0].text
    assert two.choices[2].text == two.choices[3].text != two.choices[0].text


def test_logprobs(api):
    client = oai(api)
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0

    c = client.chat.completions.create(model=MODEL_ID, messages=CONVERSATION, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(e.token for e in content) == c.choices[0].message.content
    for e in content:
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        assert len(e.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)

    streamed = list(client.chat.completions.create(model=MODEL_ID, messages=CONVERSATION,
                                                   max_tokens=5, temperature=0, logprobs=True,
                                                   stream=True, extra_body={"ignore_eos": True}))
    tokens = [e.token for ch in streamed if ch.choices and ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_errors_are_openai_errors(api):
    client = oai(api)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature="hot")
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=100000)
    assert "512" in e.value.message and "100000" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, echo=True)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, suffix="!")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=CONVERSATION,
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"content": "no role"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=CONVERSATION, presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, logit_bias={"x": 1})
    assert e.value.body["param"] == "logit_bias[x]"
    # Unknown fields are ignored; response_format text is accepted.
    ok = client.chat.completions.create(model=MODEL_ID, messages=CONVERSATION, max_tokens=2,
                                        response_format={"type": "text"}, user="u",
                                        extra_body={"no_such_field": 1})
    assert ok.choices[0].message.role == "assistant"
    # Bodies that are no JSON, or too deep, are 400s, never a hang or a crash.
    for body in [b"{", b"[]", b"\xff\xfe", b"[" * 100000, b'{"prompt": ' + b"[" * 5000]:
        status, err = post(api, "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == "body", (body[:20], err)
    status, err = post(api, "/v1/nothing", {})
    assert status == 404 and "error" in err


def test_tools_pass_to_the_template(api):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "call f"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                {"role": "user", "content": [{"type": "text", "text": "and?"}]}]
    r = oai(api).chat.completions.create(model=MODEL_ID, messages=messages, tools=tools,
                                         tool_choice="auto", max_tokens=3, temperature=0,
                                         extra_body={"chat_template_kwargs": {"x": 1},
                                                     "add_generation_prompt": True})
    assert r.choices[0].finish_reason in ("length", "stop")


class ManualCluster:
    """A coordinator and one worker started by hand, for configurations the cluster fixture's
    plaintext, keyless gRPC client cannot watch (API keys, TLS); ready once /health says so."""

    def __init__(self, tmp_path, extra=(), scheme="http", ssl_context=None):
        port, self.http_port = free_port(), free_port()
        self.base_url = f"{scheme}://127.0.0.1:{self.http_port}"
        self.coordinator = Proc("coordinator", [
            executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen",
            f"127.0.0.1:{port}", "--http-listen", f"127.0.0.1:{self.http_port}",
            "--worker-listen", f"127.0.0.1:{(wport := free_port())}", *extra],
            tmp_path / "coordinator.log")
        self.procs = [self.coordinator]
        self.coordinator.wait_listening()
        self.procs.append(Proc("worker", [executable("kvgrid-worker"), "--model", MODEL_DIR,
                                          "--coordinator", f"127.0.0.1:{wport}", "--listen",
                                          "127.0.0.1:0", *WORKER_ARGS], tmp_path / "worker.log"))

        def healthy():
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5,
                                            context=ssl_context) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        assert wait_until(healthy, timeout=60), self.coordinator.describe()

    def stop(self):
        for p in reversed(self.procs):
            p.stop()


def test_api_keys(tmp_path):
    c = ManualCluster(tmp_path, extra=["--api-keys", "k1,k2"])  # /health needs no key
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            oai(c, key="wrong").models.list()
        assert e.value.body["type"] == "authentication_error"
        status, err = post(c, "/v1/completions", {"prompt": PROMPT})
        assert status == 401 and "missing credentials" in err["error"]["message"]
        assert oai(c, key="k2").models.list().data[0].id == MODEL_ID
        r = oai(c, key="k1").completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        c.stop()


def test_tls_with_the_api_ports_certificate(tmp_path):
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, cwd=tmp_path, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout", "server.key", "-out", "server.pem")
    ctx = ssl.create_default_context(cafile=str(tmp_path / "server.pem"))
    c = ManualCluster(tmp_path, scheme="https", ssl_context=ctx,
                      extra=["--tls-cert", tmp_path / "server.pem", "--tls-key",
                             tmp_path / "server.key"])
    try:
        client = oai(c, http_client=httpx.Client(verify=str(tmp_path / "server.pem")))
        r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        chunks = list(client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4,
                                                temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
        # Plain HTTP on the TLS port gets no answer.
        with pytest.raises((urllib.error.URLError, OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{c.http_port}/health", timeout=5).read()
    finally:
        c.stop()


def blocks_used(c) -> int:
    return sum(w.usage.blocks_used for w in c.status().workers)


def test_disconnect_mid_stream_frees_kv(api):
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 500, "n": 4,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    # The close must land while the request runs (in flight at the coordinator); on a loaded
    # machine it can be done first, then it is tried again.
    for attempt in range(3):
        sock = socket.create_connection(("127.0.0.1", api.http_port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data: ") < 5:
            data = sock.recv(4096)
            assert data, received
            received += data
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        running = api.status().in_flight > 0
        sock.close()  # mid-stream: the coordinator aborts the request on its worker
        if running:
            break
    else:
        raise AssertionError("3 times, the request was done before the client closed")
    # Usage comes with heartbeats: wait for one after the abort.
    assert wait_until(lambda: api.status().in_flight == 0, timeout=10), api.status()
    time.sleep(1.0)
    assert wait_until(lambda: blocks_used(api) == 0, timeout=10), api.status()


@pytest.mark.parametrize("after_request", [b"", b"\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"],
                         ids=["nothing", "stray-crlf", "pipelined-request"])
def test_disconnect_during_a_non_streamed_response_frees_kv(api, after_request):
    """A client that closes while its (non-streamed) response is produced aborts the request at
    once, also when it sent more bytes after the request (a stray CRLF, a pipelined request, a
    TLS close_notify): those are read while the response is produced, not left in the socket
    where the close behind them would go unseen until the response's end."""
    # 48 prompts of 500 tokens on 8 sequence slots: six rounds, far longer than the 2 s below.
    body = json.dumps({"model": MODEL_ID, "prompt": [PROMPT] * 48, "max_tokens": 500,
                       "ignore_eos": True, "temperature": 0}).encode()
    for attempt in range(3):
        sock = socket.create_connection(("127.0.0.1", api.http_port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        running = wait_until(lambda: blocks_used(api) > 0, timeout=10)
        running = running and api.status().in_flight > 0
        # Sent once the request was read: bytes that came with it are read with it.
        if after_request:
            sock.sendall(after_request)
            time.sleep(0.2)
        closed = time.monotonic()
        sock.close()
        if running:
            break
        time.sleep(1.0)
    else:
        raise AssertionError("3 times, the request was done before the client closed")
    # An unseen close would keep it running to the end.
    assert wait_until(lambda: api.status().in_flight == 0, timeout=2), api.status()
    assert time.monotonic() - closed < 3
    time.sleep(1.0)
    assert wait_until(lambda: blocks_used(api) == 0, timeout=10), api.status()


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout(module_cluster, tmp_path):
    """A client that keeps its connection but reads nothing holds its stream only until a
    write makes no progress for --http-write-timeout-s; then the request is aborted and its KV
    blocks are freed, with the socket still open on the client's side."""
    c = http_cluster(module_cluster, tmp_path, extra=["--http-write-timeout-s", "2"])
    body = json.dumps({"model": MODEL_ID, "prompt": [PROMPT] * 64, "max_tokens": 480,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", c.http_port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        assert wait_until(lambda: blocks_used(c) > 0, timeout=10), c.status()
        # Never read: the socket buffers fill, the relay pauses, a write stalls and times out.
        assert wait_until(lambda: c.status().in_flight == 0, timeout=30), c.status()
        assert wait_until(lambda: blocks_used(c) == 0, timeout=10), c.status()
    finally:
        sock.close()


def test_expect_100_continue(api):
    """A client that sends `Expect: 100-continue` gets "100 Continue" before it sends the body
    (without it, curl stalls a second and stricter clients wait for good)."""
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", api.http_port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Type: application/json\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            data = sock.recv(4096)
            assert data, got
            got += data
        assert got == b"HTTP/1.1 100 Continue\r\n\r\n", got
        sock.sendall(body)
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200"), got
    # A body over the limit is refused from its header, with no 100 first.
    with socket.create_connection(("127.0.0.1", api.http_port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: 999999999999\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_curl_raw_sse_bytes(api):
    body = json.dumps({"model": MODEL_ID, "messages": CONVERSATION, "max_tokens": 4,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    p = subprocess.run(["curl", "-sN", "-i", "-H", "Content-Type: application/json", "-d", body,
                        api.base_url + "/v1/chat/completions"], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    head, _, payload = p.stdout.partition(b"\r\n\r\n")
    assert b"Content-Type: text/event-stream" in head and b"Transfer-Encoding: chunked" in head
    events = payload.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_http_requests_are_counted_with_api_label(cluster, tmp_path):
    mport = free_port()
    c = http_cluster(cluster, tmp_path, extra=["--metrics-listen", f"127.0.0.1:{mport}"])
    oai(c).completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=3)
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'kvgrid:request_success_total{model_name="kjv-tiny",api="http",' in text, text[:3000]
    assert 'kvgrid:time_to_first_token_seconds_count{model_name="kjv-tiny",api="http"} 1' in text


def test_worker_killed_mid_stream_completes_the_sse_stream(cluster, tmp_path):
    c = http_cluster(cluster, tmp_path, workers=2,
                     extra=["--heartbeat-timeout-ms", "2000"])
    client = oai(c)
    params = dict(model=MODEL_ID, prompt=PROMPT, max_tokens=200, temperature=0,
                  extra_body={"ignore_eos": True})
    unfailed = client.completions.create(**params)
    assert unfailed.usage.completion_tokens == 200
    # The kill must land while a worker is still generating; on a loaded machine the whole
    # sequence can be done first: then the victim is replaced and the scenario runs again.
    for attempt in range(3):
        procs = {w.worker_id: c.worker_proc(w.worker_id) for w in c.serving_workers()}
        text, finish, killed = [], None, None
        for chunk in client.completions.create(stream=True, **params):
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason
            if killed is None and len(text) >= 20:
                busy = [w.worker_id for w in c.status().workers if w.in_flight > 0]
                if busy:
                    killed = busy[0]
                    procs[killed].popen.kill()
                    procs[killed].popen.wait(timeout=10)
                else:
                    killed = ""
        print(f"attempt {attempt}: killed {killed!r} after 20 chunks")
        # No gap, no repeat: exactly the unfailed text.
        assert "".join(text) == unfailed.choices[0].text
        assert finish == "length"
        if killed:
            break
    else:
        raise AssertionError("3 times, the sequence was done before 20 chunks were read")
    assert wait_until(lambda: all(w.worker_id != killed or w.state != 1
                                  for w in c.status().workers), timeout=15)


def test_penalties_and_logit_bias(api):
    client = oai(api)
    forced = api.client.tokenize(" earth")[-1]
    status, detok = post(api, "/detokenize", {"model": MODEL_ID, "tokens": [forced]})
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == detok["prompt"] * 4
    # A strong frequency penalty moves greedy decoding off that repetition.
    p = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 3}, frequency_penalty=2.0,
                                  presence_penalty=2.0, extra_body={"ignore_eos": True})
    assert p.choices[0].text != r.choices[0].text


def test_full_queues_are_429_and_no_worker_is_503(cluster, tmp_path):
    c = http_cluster(cluster, tmp_path, extra=["--max-queue-depth", "0"],
                     worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "1",
                                  "--threads", "1"])
    client = oai(c)
    long = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=400, stream=True,
                                     temperature=0, extra_body={"ignore_eos": True})
    next(iter(long))
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
    long.close()
    c.workers[0].popen.kill()
    c.workers[0].popen.wait()
    assert wait_until(lambda: not c.serving_workers(), timeout=15)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 503
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(c.base_url + "/health", timeout=10)
    assert h.value.code == 503
