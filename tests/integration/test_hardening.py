"""Hostile requests on the public doors: a request_id or model name past its bound is refused
naming the field and the limit (the id is echoed in every response, so it would be multiplied
by every token), and a string field that is not UTF-8 is INVALID_ARGUMENT (HTTP 400) naming
the field by its path, over gRPC and over the OpenAI HTTP API, instead of a bare
UNIMPLEMENTED."""

import json
import shutil
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from kvgrid_client import pb

from .conftest import MODEL_DIR, MODEL_ID, executable, free_port, rpc_error

WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8", "--threads", "1"]
MARKER = "QQQQ"  # replaced by invalid UTF-8 in the serialized request
BAD_UTF8 = b"\xff\xfe\xc3("


@pytest.fixture(scope="module")
def served(module_cluster):
    port = free_port()
    c = module_cluster(workers=1, worker_args=WORKER_ARGS,
                       coordinator_args=["--http-listen", f"127.0.0.1:{port}"])
    c.base_url = f"http://127.0.0.1:{port}"
    return c


def generate_error(client, **request):
    return rpc_error(lambda: list(client.generate(timeout=30, **request)))


def corrupt(message) -> bytes:
    data = message.SerializeToString()
    assert data.count(MARKER.encode()) == 1
    return data.replace(MARKER.encode(), BAD_UTF8)


def raw_generate(c, data: bytes):
    with grpc.insecure_channel(c.addr) as ch:
        call = ch.unary_stream("/kvgrid.v1.Generation/Generate",
                               request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        return list(call(data, timeout=30))


def raw_unary(c, method: str, data: bytes, response):
    with grpc.insecure_channel(c.addr) as ch:
        call = ch.unary_unary(f"/kvgrid.v1.Generation/{method}",
                              request_serializer=lambda b: b,
                              response_deserializer=response.FromString)
        return call(data, timeout=30)


def test_request_id_longer_than_256_bytes_is_refused(served):
    e = generate_error(served.client, prompt="In the beginning", max_new_tokens=2,
                       request_id="x" * 257)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id: at most 256 bytes, got 257" in e.details()
    # A megabyte id is refused the same way, at once, without being echoed back.
    e = generate_error(served.client, prompt="In the beginning", max_new_tokens=2,
                       request_id="y" * (1 << 20))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(e.details()) < 200
    done = served.client.generate_text("In the beginning", max_new_tokens=2,
                                       request_id="z" * 256)
    assert done.request_id == "z" * 256


def test_model_name_longer_than_256_bytes_is_refused(served):
    e = generate_error(served.client, prompt="In the beginning", max_new_tokens=2,
                       model="m" * 300)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model: at most 256 bytes, got 300" in e.details()
    e = rpc_error(lambda: raw_unary(served, "Tokenize",
                                    pb.TokenizeRequest(model="m" * 300, text="a")
                                    .SerializeToString(), pb.TokenizeResponse))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model: at most 256 bytes" in e.details()


def test_invalid_utf8_prompt_names_the_field(served):
    data = corrupt(pb.GenerateRequest(prompt=MARKER, model=MODEL_ID))
    e = rpc_error(lambda: raw_generate(served, data))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    assert e.details() == "prompt: invalid UTF-8"


def test_invalid_utf8_in_a_message_names_its_path(served):
    request = pb.GenerateRequest(model=MODEL_ID)
    request.messages.add(role="system", content="You answer.")
    request.messages.add(role="user", content="Who?")
    request.messages.add(role="user", content=MARKER)
    e = rpc_error(lambda: raw_generate(served, corrupt(request)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "messages[2].content: invalid UTF-8"


def test_invalid_utf8_in_tokenize_and_bytes_that_are_no_request(served):
    data = corrupt(pb.TokenizeRequest(model=MODEL_ID, text=MARKER))
    e = rpc_error(lambda: raw_unary(served, "Tokenize", data, pb.TokenizeResponse))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "text: invalid UTF-8"
    e = rpc_error(lambda: raw_generate(served, b"\xff\xff\xff\xff"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid kvgrid.v1.GenerateRequest" in e.details()
    # A well-formed raw request still generates: the raw registration parses as before.
    out = raw_generate(served, pb.GenerateRequest(
        prompt="In the beginning", model=MODEL_ID,
        stopping=pb.StoppingParams(max_new_tokens=3)).SerializeToString())
    assert sum(len(r.token_ids) for r in out) == 3
    ids = raw_unary(served, "Tokenize", pb.TokenizeRequest(model=MODEL_ID, text="In the")
                    .SerializeToString(), pb.TokenizeResponse)
    assert list(ids.token_ids) == served.client.tokenize("In the")


def post(c, path: str, body: bytes):
    req = urllib.request.Request(c.base_url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_long_model_name_is_400(served):
    status, body = post(served, "/v1/completions",
                        json.dumps({"model": "m" * 300, "prompt": "a", "max_tokens": 2}).encode())
    assert status == 400, body
    assert "model: at most 256 bytes" in body["error"]["message"]


def test_openai_invalid_utf8_names_the_field(served):
    body = (b'{"model": "' + MODEL_ID.encode() + b'", "max_tokens": 2, "messages": ['
            b'{"role": "user", "content": "hi"}, {"role": "user", "content": "'
            + BAD_UTF8 + b'"}]}')
    status, out = post(served, "/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["message"].startswith("messages[1].content: invalid UTF-8"), out
    status, out = post(served, "/v1/completions",
                       b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "' + BAD_UTF8 + b'"}')
    assert status == 400, out
    assert out["error"]["message"].startswith("prompt: invalid UTF-8"), out


@pytest.mark.parametrize("linked", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_model_file_linked_outside_its_directory_is_refused(tmp_path, linked):
    """The coordinator and the worker both refuse to start on it, naming the file; the same
    directory with the file copied in serves (kvgrid run generates)."""
    outside = tmp_path / "elsewhere"
    model = tmp_path / "kjv"
    outside.mkdir()
    model.mkdir()
    for f in MODEL_DIR.iterdir():
        if f.is_file():
            shutil.copyfile(f, model / f.name)
    (model / linked).rename(outside / linked)
    (model / linked).symlink_to(outside / linked)
    for argv in ([executable("kvgrid-coordinator"), "--model", model, "--listen", "127.0.0.1:0"],
                 [executable("kvgrid"), "run", "--model", model, "--prompt", "In the",
                  "--max-new-tokens", "2"]):
        if linked == "model.safetensors" and "kvgrid-coordinator" in str(argv[0]):
            continue  # the coordinator reads no weights
        p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0, p
        assert f"{model / linked}: a symbolic link to {outside / linked}" in p.stderr, p.stderr
        assert "outside the model directory" in p.stderr
    (model / linked).unlink()
    shutil.copyfile(outside / linked, model / linked)
    p = subprocess.run([str(executable("kvgrid")), "run", "--model", str(model), "--prompt",
                        "In the", "--max-new-tokens", "2"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
