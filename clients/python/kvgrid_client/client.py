"""A blocking client for the kvgrid `Generation` service (proto/kvgrid/v1/generation.proto).

Errors are raised as `grpc.RpcError`; `e.code()` is a `grpc.StatusCode` and `e.details()` the
server's message (INVALID_ARGUMENT names the offending field).

Thread-safety: one `Client` (one channel) may be used from many threads at once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grpc

from kvgrid_client import _gen

_gen.ensure_importable()

from kvgrid.v1 import generation_pb2 as pb  # noqa: E402
from kvgrid.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402

# Responses and requests carry whole token lists; keep well above gRPC's 4 MiB default.
_MAX_MESSAGE_BYTES = 64 << 20


def finish_reason_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop", FINISH_REASON_LENGTH -> "length", unset -> ""."""
    if reason == pb.FINISH_REASON_UNSPECIFIED:
        return ""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclasses.dataclass
class Completion:
    """One finished continuation, assembled from its stream of responses."""

    request_id: str = ""
    index: int = 0
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    # "stop" or "length" (as printed by `kvgrid run --json`); "" if the stream ended early.
    finish_reason: str = ""
    usage: pb.Usage | None = None
    timings: pb.Timings | None = None
    # One per token when logprobs were requested.
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)
    # Workers that served the tokens, in order (more than one after a failover).
    worker_ids: list[str] = dataclasses.field(default_factory=list)

    def add(self, r: pb.GenerateResponse) -> None:
        """Appends one response of this continuation."""
        self.request_id = r.request_id
        self.index = r.index
        self.text += r.text
        self.token_ids.extend(r.token_ids)
        self.logprobs.extend(r.logprobs)
        if r.worker_id and (not self.worker_ids or self.worker_ids[-1] != r.worker_id):
            self.worker_ids.append(r.worker_id)
        if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = finish_reason_name(r.finish_reason)
            self.usage = r.usage
            self.timings = r.timings


def chat_message(message: Mapping[str, Any] | pb.ChatMessage) -> pb.ChatMessage:
    """A ChatMessage from an OpenAI-style message dict: "role", "content" (a string, None, or a
    list of {"type": "text", "text": ...} parts), "name", "tool_calls" ([{"id", "type",
    "function": {"name", "arguments"}}], arguments as JSON text or as a dict, which is sent as
    JSON), "tool_call_id", "reasoning_content". A ChatMessage is returned as it is."""
    if isinstance(message, pb.ChatMessage):
        return message
    m = pb.ChatMessage(role=message.get("role") or "", name=message.get("name") or "",
                       tool_call_id=message.get("tool_call_id") or "")
    content = message.get("content")
    if isinstance(content, str):
        m.content = content
    elif content is not None:
        for part in content:
            m.content_parts.add(type=part.get("type", ""), text=part.get("text") or "")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        m.tool_calls.add(id=call.get("id") or "", type=call.get("type") or "",
                         function=pb.FunctionCall(name=function.get("name") or "",
                                                  arguments=arguments))
    if message.get("reasoning_content") is not None:
        m.reasoning_content = message["reasoning_content"]
    return m


def build_request(prompt: str | None = None,
                  prompt_token_ids: Sequence[int] | None = None,
                  *,
                  messages: Sequence[Mapping[str, Any] | pb.ChatMessage] | None = None,
                  tools: Sequence[Mapping[str, Any]] | None = None,
                  documents: Sequence[Mapping[str, Any]] | None = None,
                  add_generation_prompt: bool | None = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None,
                  model: str = "",
                  max_new_tokens: int | None = None,
                  temperature: float | None = None,
                  top_p: float | None = None,
                  top_k: int = 0,
                  min_p: float = 0.0,
                  repetition_penalty: float | None = None,
                  presence_penalty: float | None = None,
                  frequency_penalty: float | None = None,
                  logit_bias: Mapping[int, float] | None = None,
                  seed: int | None = None,
                  stop: str | Iterable[str] | None = None,
                  stop_token_ids: Iterable[int] | None = None,
                  logprobs: int | None = None,
                  n: int | None = None,
                  min_tokens: int = 0,
                  ignore_eos: bool = False,
                  include_stop_str_in_output: bool = False,
                  add_bos: bool = False,
                  priority: int = 0,
                  request_id: str = "") -> pb.GenerateRequest:
    """A GenerateRequest; None leaves an optional field unset (the server's default).

    A chat request gives `messages` (OpenAI-style dicts, see chat_message) instead of a
    prompt, and optionally `tools` and `documents` (lists, sent as JSON),
    `add_generation_prompt` (the server's default: True) and `chat_template_kwargs` (extra
    template variables, e.g. {"enable_thinking": False}); a string for tools, documents or
    chat_template_kwargs is sent as the JSON text it is.

    No validation happens here: the server's answer to a bad request is the reference.
    """
    req = pb.GenerateRequest(model=model, add_bos=add_bos, priority=priority,
                             request_id=request_id)
    if prompt is not None:
        req.prompt = prompt
    if prompt_token_ids is not None:
        req.prompt_token_ids.extend(prompt_token_ids)
    if messages is not None:
        req.messages.extend(chat_message(m) for m in messages)

    def as_json(value):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    if tools is not None:
        req.tools_json = as_json(tools)
    if documents is not None:
        req.documents_json = as_json(documents)
    if add_generation_prompt is not None:
        req.add_generation_prompt = add_generation_prompt
    if chat_template_kwargs is not None:
        req.chat_template_kwargs_json = as_json(chat_template_kwargs)
    if n is not None:
        req.n = n
    s = req.sampling
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    s.top_k = top_k
    s.min_p = min_p
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    if presence_penalty is not None:
        s.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        s.frequency_penalty = frequency_penalty
    if logit_bias is not None:
        # OpenAI's JSON has the ids as strings: accept those too.
        for token_id, bias in logit_bias.items():
            s.logit_bias[int(token_id)] = bias
    if seed is not None:
        s.seed = seed
    if logprobs is not None:
        s.logprobs = logprobs
    st = req.stopping
    if max_new_tokens is not None:
        st.max_new_tokens = max_new_tokens
    st.min_tokens = min_tokens
    st.ignore_eos = ignore_eos
    st.include_stop_str_in_output = include_stop_str_in_output
    if stop is not None:
        st.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        st.stop_token_ids.extend(stop_token_ids)
    return req


class _BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <key>` to every call."""

    def __init__(self, key: str):
        self._header = ("authorization", f"Bearer {key}")

    def _with_key(self, details):
        metadata = list(details.metadata or []) + [self._header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


class _CallDetails(
        collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class Client:
    """A connection to a kvgrid coordinator at `addr` ("host:port").

    `timeout`: default deadline in seconds for every call (None: no deadline); each method
    takes its own `timeout` too.
    """

    def __init__(self, addr: str, timeout: float | None = None, *,
                 options: Sequence[tuple[str, object]] = (), api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None):
        """`api_key` is sent as `authorization: Bearer <key>` on every call. `tls` (implied by
        `root_certificates`) connects with TLS, verifying the server against
        `root_certificates` (system roots when None); `private_key` and `certificate_chain`
        present a client certificate (mTLS)."""
        self.addr = addr
        self.timeout = timeout
        opts = [("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)]
        opts += list(options)
        if tls or root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                                 private_key=private_key,
                                                 certificate_chain=certificate_chain)
            self._raw_channel = grpc.secure_channel(addr, creds, options=opts)
        else:
            self._raw_channel = grpc.insecure_channel(addr, options=opts)
        self.channel = self._raw_channel
        if api_key:
            self.channel = grpc.intercept_channel(self._raw_channel, _BearerInterceptor(api_key))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel; calls still running are cancelled."""
        self._raw_channel.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel is connected; grpc.FutureTimeoutError after `timeout`."""
        grpc.channel_ready_future(self._raw_channel).result(timeout=timeout)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate(self, prompt: str | None = None,
                 prompt_token_ids: Sequence[int] | None = None,
                 *, timeout: float | None = None, metadata=None,
                 **params) -> Iterator[pb.GenerateResponse]:
        """Starts a Generate call; returns its stream of GenerateResponse messages.

        `params` are build_request()'s keyword arguments (max_new_tokens, temperature, top_p,
        top_k, seed, stop, logprobs, n, ...; messages=[{"role": "user", "content": ...}]
        instead of a prompt for a chat request). The returned object is an iterator that is also a
        grpc.Call: `.cancel()` ends the stream (the server frees the request's KV blocks), and
        iterating raises grpc.RpcError when the call fails.
        """
        req = build_request(prompt, prompt_token_ids, **params)
        return self.stub.Generate(req, timeout=self._timeout(timeout), metadata=metadata)

    def generate_completions(self, prompt: str | None = None,
                             prompt_token_ids: Sequence[int] | None = None,
                             *, timeout: float | None = None, **params) -> list[Completion]:
        """Runs a Generate call to the end; one Completion per continuation, by index."""
        by_index: dict[int, Completion] = {}
        for r in self.generate(prompt, prompt_token_ids, timeout=timeout, **params):
            by_index.setdefault(r.index, Completion()).add(r)
        return [by_index[i] for i in sorted(by_index)]

    def generate_text(self, prompt: str | None = None,
                      prompt_token_ids: Sequence[int] | None = None,
                      *, timeout: float | None = None, **params) -> Completion:
        """Runs a single-continuation Generate call to the end: text, token ids, finish reason,
        usage. For n > 1 use generate_completions()."""
        if params.get("n") not in (None, 0, 1):
            raise ValueError("generate_text returns one continuation; use generate_completions "
                             "for n > 1")
        completions = self.generate_completions(prompt, prompt_token_ids, timeout=timeout,
                                                **params)
        return completions[0] if completions else Completion()

    def tokenize(self, text: str, *, add_bos: bool = False, model: str = "",
                 timeout: float | None = None) -> list[int]:
        """Token ids of `text` with the model's tokenizer."""
        r = self.stub.Tokenize(pb.TokenizeRequest(model=model, text=text, add_bos=add_bos),
                               timeout=self._timeout(timeout))
        return list(r.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   model: str = "", timeout: float | None = None) -> str:
        """Text of `token_ids`."""
        req = pb.DetokenizeRequest(model=model, token_ids=list(token_ids),
                                   skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, timeout=self._timeout(timeout)).text

    def list_models(self, *, timeout: float | None = None) -> list[pb.ModelInfo]:
        """The models the cluster serves."""
        return list(self.stub.ListModels(pb.ListModelsRequest(),
                                         timeout=self._timeout(timeout)).models)

    def cluster_status(self, *, timeout: float | None = None) -> pb.ClusterStatusResponse:
        """Workers, groups, KV capacity and usage, queue depths."""
        return self.stub.ClusterStatus(pb.ClusterStatusRequest(),
                                       timeout=self._timeout(timeout))
