"""KServe v2 / Triton's inference protocol on the coordinator, driven with the stock
`tritonclient` (gRPC and HTTP), `requests`, and a client built from reflection alone, against
a real cluster: the same request path as Generation.Generate, so greedy outputs equal its
own, a cancelled stream frees its KV blocks, and errors carry the protocol's codes."""

import json
import queue
import threading
import time

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2 as triton_pb2
from tritonclient.grpc import service_pb2_grpc as triton_pb2_grpc
from tritonclient.utils import InferenceServerException

from .conftest import MODEL_DIR, MODEL_ID, Proc, executable, free_port, wait_until

PROMPT = "In the beginning God created"
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8", "--threads", "1"]
# A generation long enough to still be running when the test acts on it.
LONG = 400


@pytest.fixture(scope="module")
def kc(module_cluster):
    port = free_port()
    c = module_cluster(workers=1, worker_args=WORKER_ARGS,
                       coordinator_args=["--http-listen", f"127.0.0.1:{port}"])
    c.http = f"127.0.0.1:{port}"
    return c


def grpc_client(c):
    return tgrpc.InferenceServerClient(url=c.addr)


def text_inputs(prompt, **scalars):
    """tritonclient inputs: text_input plus scalars by name (bool, int, float or str)."""
    inputs = []
    t = tgrpc.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs.append(t)
    for name, value in scalars.items():
        if isinstance(value, bool):
            dt, arr = "BOOL", np.array([value], dtype=bool)
        elif isinstance(value, int):
            dt, arr = "INT32", np.array([value], dtype=np.int32)
        elif isinstance(value, float):
            dt, arr = "FP32", np.array([value], dtype=np.float32)
        elif isinstance(value, list):
            dt, arr = "BYTES", np.array([v.encode() for v in value], dtype=np.object_)
        else:
            dt, arr = "BYTES", np.array([value.encode()], dtype=np.object_)
        t = tgrpc.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def text_of(result, name="text_output"):
    return result.as_numpy(name)[0].decode()


def greedy(c, prompt, n):
    """Generation.Generate's greedy text for a prompt tokenized with the tokenizer's BOS, as
    the KServe door tokenizes it."""
    return c.client.generate_text(prompt, max_new_tokens=n, temperature=0, add_bos=True).text


def blocks_used(c) -> int:
    return sum(w.usage.blocks_used for w in c.status().workers)


def code_of(e: InferenceServerException) -> str:
    return e.status()


def test_our_protocol_is_tritonclients_on_the_wire(kc):
    """Every message and method the coordinator reflects for inference.GRPCInferenceService has
    the names, numbers and types of tritonclient's own definition of the protocol."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
    with grpc.insecure_channel(kc.addr) as ch:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        ours = pool.FindServiceByName("inference.GRPCInferenceService")
        theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        checked = set()

        def same_message(a, b):
            if a.full_name in checked:
                return
            checked.add(a.full_name)
            assert a.full_name == b.full_name
            for f in a.fields:
                g = b.fields_by_number.get(f.number)
                assert g is not None, f"{a.full_name}.{f.name} = {f.number} is not tritonclient's"
                assert (f.name, f.type, f.is_repeated) == (g.name, g.type, g.is_repeated), \
                    (a.full_name, f.name)
                if f.message_type is not None:
                    same_message(f.message_type, g.message_type)
                if f.enum_type is not None:
                    for v in f.enum_type.values:
                        assert g.enum_type.values_by_number[v.number].name == v.name
                if f.containing_oneof is not None:
                    assert g.containing_oneof.name == f.containing_oneof.name

        names = []
        for m in ours.methods:
            t = theirs.methods_by_name[m.name]
            assert (m.client_streaming, m.server_streaming) == \
                (t.client_streaming, t.server_streaming), m.name
            same_message(m.input_type, t.input_type)
            same_message(m.output_type, t.output_type)
            names.append(m.name)
        assert {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                "ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics"} <= set(names)
        assert len(checked) > 20


def test_liveness_readiness_metadata_and_config(kc):
    t = grpc_client(kc)
    assert t.is_server_live() and t.is_server_ready()
    assert t.is_model_ready(MODEL_ID) and t.is_model_ready(MODEL_ID, "1")
    meta = t.get_server_metadata(as_json=True)
    assert meta["name"] == "kvgrid" and "generate" in meta["extensions"]
    m = t.get_model_metadata(MODEL_ID, as_json=True)
    assert m["name"] == MODEL_ID and m["versions"] == ["1"]
    inputs = {i["name"]: i["datatype"] for i in m["inputs"]}
    assert inputs["text_input"] == "BYTES" and inputs["stream"] == "BOOL"
    assert inputs["max_tokens"] == "INT32" and inputs["temperature"] == "FP32"
    assert {o["name"] for o in m["outputs"]} >= {"text_output", "finish_reason"}
    cfg = t.get_model_config(MODEL_ID, as_json=True)["config"]
    assert cfg["name"] == MODEL_ID
    assert cfg["model_transaction_policy"]["decoupled"] is True
    assert {i["name"] for i in cfg["input"]} == set(inputs)
    for call in (lambda: t.is_model_ready("no-such-model"),
                 lambda: t.get_model_metadata("no-such-model"),
                 lambda: t.get_model_metadata(MODEL_ID, "7")):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert code_of(e.value) == "StatusCode.NOT_FOUND", e.value


def test_model_infer_greedy_equals_generate(kc):
    t = grpc_client(kc)
    want = greedy(kc, PROMPT, 12)
    r = t.infer(MODEL_ID, text_inputs(PROMPT, max_tokens=12, temperature=0.0,
                                      exclude_input_in_output=True, return_finish_reason=True,
                                      return_num_input_tokens=True,
                                      return_num_output_tokens=True),
                request_id="req-42")
    assert text_of(r) == want
    assert r.get_response().id == "req-42"
    assert text_of(r, "finish_reason") == "length"
    assert r.as_numpy("num_output_tokens")[0] == 12
    assert r.as_numpy("num_input_tokens")[0] == len(kc.client.tokenize(PROMPT)) + 1
    # By default the prompt comes first, as the vLLM backend answers.
    r = t.infer(MODEL_ID, text_inputs(PROMPT, max_tokens=12, temperature=0.0))
    assert text_of(r) == PROMPT + want
    # The same through request parameters and through sampling_parameters (vLLM's strings).
    r = t.infer(MODEL_ID, text_inputs(PROMPT, exclude_input_in_output=True),
                parameters={"max_tokens": 12, "temperature": 0.0})
    assert text_of(r) == want
    r = t.infer(MODEL_ID, text_inputs(
        PROMPT, exclude_input_in_output=True,
        sampling_parameters=json.dumps({"max_tokens": "12", "temperature": "0"})))
    assert text_of(r) == want


def test_typed_contents_and_logprobs(kc):
    """A request with typed contents (not raw), built from tritonclient's own messages."""
    want = kc.client.generate_text(PROMPT, max_new_tokens=5, temperature=0, add_bos=True,
                                   logprobs=0)
    req = triton_pb2.ModelInferRequest(model_name=MODEL_ID, id="typed")
    for name, dt, field, values in [("text_input", "BYTES", "bytes_contents", [PROMPT.encode()]),
                                    ("max_tokens", "INT32", "int_contents", [5]),
                                    ("temperature", "FP32", "fp32_contents", [0.0]),
                                    ("exclude_input_in_output", "BOOL", "bool_contents", [True]),
                                    ("return_logprobs", "BOOL", "bool_contents", [True]),
                                    ("return_cumulative_logprob", "BOOL", "bool_contents",
                                     [True])]:
        tensor = req.inputs.add(name=name, datatype=dt, shape=[1])
        getattr(tensor.contents, field).extend(values)
    with grpc.insecure_channel(kc.addr) as ch:
        resp = triton_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=60)
    r = tgrpc.InferResult(resp)
    assert text_of(r) == want.text and resp.id == "typed"
    lps = json.loads(text_of(r, "logprobs"))
    assert [lp["token_id"] for lp in lps] == list(want.token_ids)
    assert r.as_numpy("cumulative_logprob")[0] == pytest.approx(
        sum(lp["logprob"] for lp in lps), abs=1e-4)


class Stream:
    """tritonclient's decoupled streaming: results and errors as they arrive."""

    def __init__(self, c, **kw):
        self.client = grpc_client(c)
        self.q = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)),
                                 **kw)

    def send(self, inputs, request_id=""):
        self.client.async_stream_infer(MODEL_ID, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def until_final(self, timeout=60):
        """The chunks of one request up to its final response, or its error."""
        chunks = []
        deadline = time.monotonic() + timeout
        while True:
            result, error = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                return chunks, error
            chunks.append(result)
            p = result.get_response().parameters
            if p["triton_final_response"].bool_param:
                return chunks, None

    def close(self, cancel=False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_streamed_chunks_concatenate_to_the_whole_completion(kc):
    want = greedy(kc, PROMPT, 24)
    s = Stream(kc)
    try:
        s.send(text_inputs(PROMPT, max_tokens=24, temperature=0.0, stream=True,
                           return_num_output_tokens=True), request_id="s1")
        chunks, error = s.until_final()
        assert error is None, error
        assert len(chunks) > 1
        assert "".join(text_of(c) for c in chunks) == want
        assert all(c.get_response().id == "s1" for c in chunks)
        assert sum(int(c.as_numpy("num_output_tokens")[0]) for c in chunks) == 24
        assert [c.get_response().parameters["triton_final_response"].bool_param
                for c in chunks] == [False] * (len(chunks) - 1) + [True]
        # A request with stream false on the stream: one response, the whole completion.
        s.send(text_inputs(PROMPT, max_tokens=24, temperature=0.0,
                           exclude_input_in_output=True))
        chunks, error = s.until_final()
        assert error is None and [text_of(c) for c in chunks] == [want]
        # An error arrives as an error on the stream, which goes on.
        s.send(text_inputs(PROMPT, no_such_input=1))
        chunks, error = s.until_final()
        assert error is not None and "no_such_input" in str(error), error
        s.send(text_inputs(PROMPT, max_tokens=3, temperature=0.0, stream=True))
        chunks, error = s.until_final()
        assert error is None and "".join(text_of(c) for c in chunks) == greedy(kc, PROMPT, 3)
    finally:
        s.close()


def test_a_cancelled_stream_frees_its_kv_blocks(kc):
    # The cancel must land while the request runs; on a loaded machine it can be done first,
    # then it is tried again.
    for attempt in range(3):
        s = Stream(kc)
        s.send(text_inputs(PROMPT, max_tokens=LONG, ignore_eos=True, stream=True))
        first, error = s.q.get(timeout=60)
        assert error is None, error
        running = kc.status().in_flight > 0
        s.close(cancel=True)  # the coordinator aborts the request on its worker
        if running:
            break
    else:
        raise AssertionError("3 times, the request was done before the stream was cancelled")
    assert wait_until(lambda: kc.status().in_flight == 0, timeout=10), kc.status()
    time.sleep(1.0)  # usage comes with heartbeats: wait for one after the abort
    assert wait_until(lambda: blocks_used(kc) == 0, timeout=10), kc.status()


def test_errors_carry_the_protocols_codes(kc):
    t = grpc_client(kc)

    def infer_error(inputs, model=MODEL_ID, **kw):
        with pytest.raises(InferenceServerException) as e:
            t.infer(model, inputs, **kw)
        return code_of(e.value), e.value.message()

    code, msg = infer_error(text_inputs(PROMPT), model="no-such-model")
    assert code == "StatusCode.NOT_FOUND" and "no-such-model" in msg
    code, msg = infer_error(text_inputs(PROMPT, tempreature=0.5))
    assert code == "StatusCode.INVALID_ARGUMENT" and "'tempreature'" in msg
    code, msg = infer_error(text_inputs(PROMPT, temperature="hot"))
    assert code == "StatusCode.INVALID_ARGUMENT" and "'temperature'" in msg and "BYTES" in msg
    code, msg = infer_error(text_inputs(PROMPT, max_tokens=0))
    assert code == "StatusCode.INVALID_ARGUMENT" and "'max_tokens'" in msg
    code, msg = infer_error(text_inputs(PROMPT, stream=True))
    assert code == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in msg
    code, msg = infer_error(text_inputs(PROMPT, bad_words=["In the beginning"]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "bad_words" in msg
    code, msg = infer_error(text_inputs(PROMPT), parameters={"no_such_parameter": 3})
    assert code == "StatusCode.INVALID_ARGUMENT" and "no_such_parameter" in msg
    # A shape that does not hold the contents.
    bad = tgrpc.InferInput("text_input", [1], "BYTES")
    bad.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    del bad._input.shape[:]
    bad._input.shape.extend([3])
    code, msg = infer_error([bad])
    assert code == "StatusCode.INVALID_ARGUMENT" and "'text_input'" in msg, msg
    # Nothing required is missing silently.
    only = tgrpc.InferInput("max_tokens", [1], "INT32")
    only.set_data_from_numpy(np.array([4], dtype=np.int32))
    code, msg = infer_error([only])
    assert code == "StatusCode.INVALID_ARGUMENT" and "'text_input'" in msg, msg


def test_a_full_worker_is_resource_exhausted(cluster):
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "1",
                                        "--max-queue-depth", "0", "--threads", "1"])
    s = Stream(c)
    try:
        s.send(text_inputs(PROMPT, max_tokens=LONG, ignore_eos=True, stream=True))
        _, error = s.q.get(timeout=60)
        assert error is None, error
        with pytest.raises(InferenceServerException) as e:
            grpc_client(c).infer(MODEL_ID, text_inputs(PROMPT, max_tokens=4))
        assert code_of(e.value) == "StatusCode.RESOURCE_EXHAUSTED", e.value
    finally:
        s.close(cancel=True)


def test_api_keys_guard_all_but_the_probes(tmp_path):
    port = free_port()
    coordinator = Proc("coordinator", [executable("kvgrid-coordinator"), "--model", MODEL_DIR,
                                       "--listen", f"127.0.0.1:{port}", "--api-keys", "k1",
                                       "--cluster-token", "tok", "--allow-insecure-cluster"],
                       tmp_path / "coordinator.log")
    coordinator.wait_listening()
    worker = Proc("worker", [executable("kvgrid-worker"), "--model", MODEL_DIR, "--coordinator",
                             f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--cluster-token",
                             "tok", "--allow-insecure-cluster", *WORKER_ARGS], tmp_path / "worker.log")
    try:
        worker.wait_listening()
        t = tgrpc.InferenceServerClient(url=f"127.0.0.1:{port}")
        assert t.is_server_live()
        assert wait_until(t.is_server_ready, timeout=60), coordinator.describe()
        with pytest.raises(InferenceServerException) as e:
            t.infer(MODEL_ID, text_inputs(PROMPT, max_tokens=2))
        assert code_of(e.value) == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as e:
            t.get_model_metadata(MODEL_ID)
        assert code_of(e.value) == "StatusCode.UNAUTHENTICATED"
        r = t.infer(MODEL_ID, text_inputs(PROMPT, max_tokens=2),
                    headers={"authorization": "Bearer k1"})
        assert len(text_of(r)) > len(PROMPT)
    finally:
        worker.stop()
        coordinator.stop()


def test_reflection_alone_is_enough_to_call_model_infer(kc):
    """A dynamic client, as grpcurl is: descriptors from the server's reflection, no stubs."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
    with grpc.insecure_channel(kc.addr) as ch:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        method = pool.FindMethodByName("inference.GRPCInferenceService.ModelInfer")
        Request = message_factory.GetMessageClass(method.input_type)
        Response = message_factory.GetMessageClass(method.output_type)
        req = Request(model_name=MODEL_ID, id="dyn")
        text = PROMPT.encode()
        for name, dt, raw in [("text_input", "BYTES", len(text).to_bytes(4, "little") + text),
                              ("max_tokens", "INT32", (6).to_bytes(4, "little")),
                              ("temperature", "FP32", np.float32(0).tobytes()),
                              ("exclude_input_in_output", "BOOL", b"\x01")]:
            req.inputs.add(name=name, datatype=dt, shape=[1])
            req.raw_input_contents.append(raw)
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=Response.FromString)
        resp = call(req, timeout=60)
    assert resp.id == "dyn" and resp.outputs[0].name == "text_output"
    raw = resp.raw_output_contents[0]
    assert raw[4:].decode() == greedy(kc, PROMPT, 6)
    assert int.from_bytes(raw[:4], "little") == len(raw) - 4


def test_http_generate_and_generate_stream(kc):
    base = f"http://{kc.http}/v2"
    want = greedy(kc, PROMPT, 10)
    r = requests.post(f"{base}/models/{MODEL_ID}/generate", timeout=60,
                      json={"text_input": PROMPT, "id": "h1",
                            "parameters": {"max_tokens": 10, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == MODEL_ID and body["id"] == "h1"
    assert body["text_output"] == PROMPT + want
    r = requests.post(f"{base}/models/{MODEL_ID}/generate", timeout=60,
                      json={"text_input": PROMPT, "max_tokens": 10, "temperature": 0,
                            "exclude_input_in_output": True, "return_finish_reason": True})
    assert r.json()["text_output"] == want and r.json()["finish_reason"] == "length"
    # generate_stream: SSE events whose text_output deltas add up.
    with requests.post(f"{base}/models/{MODEL_ID}/generate_stream", stream=True, timeout=60,
                       json={"text_input": PROMPT, "parameters": {"max_tokens": 10,
                                                                  "temperature": 0}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == want
    # Errors: {"error": ...} with the HTTP status of the code.
    r = requests.post(f"{base}/models/{MODEL_ID}/generate", timeout=60,
                      json={"text_input": PROMPT, "parameters": {"top_p": 7}})
    assert r.status_code == 400 and "top_p" in r.json()["error"]
    r = requests.post(f"{base}/models/nope/generate", json={"text_input": "x"}, timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = requests.post(f"{base}/models/{MODEL_ID}/generate", data=b"{not json", timeout=60)
    assert r.status_code == 400 and "error" in r.json()


def test_http_health_and_metadata_with_tritonclient(kc):
    t = thttp.InferenceServerClient(url=kc.http)
    assert t.is_server_live() and t.is_server_ready() and t.is_model_ready(MODEL_ID)
    assert not t.is_model_ready("nope")
    assert t.get_server_metadata()["name"] == "kvgrid"
    m = t.get_model_metadata(MODEL_ID)
    assert m["name"] == MODEL_ID and m["inputs"][0] == {"name": "text_input",
                                                        "datatype": "BYTES", "shape": [1]}
    assert t.get_model_config(MODEL_ID)["model_transaction_policy"]["decoupled"] is True
    stats = t.get_inference_statistics(MODEL_ID)["model_stats"][0]
    assert stats["name"] == MODEL_ID and int(stats["inference_count"]) > 0
    t.close()
