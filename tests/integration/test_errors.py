"""Bad requests are refused at once with INVALID_ARGUMENT (NOT_FOUND for an unknown model)
whose message names the field; a sequence no worker's KV pool can ever hold is refused with
the numbers, never left to hang."""

import grpc
import pytest

from .conftest import rpc_error, wait_until

VOCAB = 4096  # models/kjv-tiny/config.json


@pytest.fixture(scope="module")
def one_worker(module_cluster):
    return module_cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"])


def generate_error(client, **request):
    """The error of a Generate call (raised by the first read of the stream)."""
    return rpc_error(lambda: list(client.generate(timeout=30, **request)))


# (case id, request, code, text the details must contain)
INVALID = [
    ("empty_prompt", dict(prompt="", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    ("no_prompt", dict(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("prompt_and_ids", dict(prompt="In the beginning", prompt_token_ids=[10, 11],
                            max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt"),
    ("top_p_above_1", dict(prompt="In the beginning", top_p=1.5),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("top_p_zero", dict(prompt="In the beginning", top_p=0.0),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ("token_id_out_of_vocab", dict(prompt_token_ids=[10, VOCAB, 11]),
     grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    ("negative_token_id", dict(prompt_token_ids=[10, -1]), grpc.StatusCode.INVALID_ARGUMENT,
     "prompt_token_ids"),
    ("max_new_tokens_zero", dict(prompt="In the beginning", max_new_tokens=0),
     grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    ("max_new_tokens_negative", dict(prompt="In the beginning", max_new_tokens=-3),
     grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    ("negative_temperature", dict(prompt="In the beginning", temperature=-0.5),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ("min_p_above_1", dict(prompt="In the beginning", min_p=1.5),
     grpc.StatusCode.INVALID_ARGUMENT, "min_p"),
    ("repetition_penalty_zero", dict(prompt="In the beginning", repetition_penalty=0.0),
     grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty"),
    ("logprobs_above_20", dict(prompt="In the beginning", logprobs=21),
     grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ("unknown_model", dict(prompt="In the beginning", model="no-such-model"),
     grpc.StatusCode.NOT_FOUND, "no-such-model"),
]


@pytest.mark.parametrize("request_fields,code,needle", [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_invalid_request(one_worker, request_fields, code, needle):
    e = generate_error(one_worker.client, **request_fields)
    assert e.code() == code, (e.code(), e.details())
    assert needle in e.details(), e.details()


def test_cluster_still_serves_after_errors(one_worker):
    done = one_worker.client.generate_text("In the beginning", max_new_tokens=4, seed=1)
    assert done.finish_reason and done.token_ids

    def idle():
        s = one_worker.status()
        return s.in_flight == 0 and s.workers[0].in_flight == 0

    assert wait_until(idle, timeout=5), one_worker.status()


def test_unknown_model_in_unary_calls(one_worker):
    for call in (lambda: one_worker.client.tokenize("x", model="no-such-model"),
                 lambda: one_worker.client.detokenize([10], model="no-such-model")):
        e = rpc_error(call)
        assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())
    e = rpc_error(lambda: one_worker.client.detokenize([VOCAB]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert "token_ids" in e.details()


def test_sequence_larger_than_every_pool(cluster):
    # 256 KiB of KV: 4 to 8 blocks of 16 tokens (fp32 or bf16 rows), at most 128 tokens.
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "256KiB"])
    client = c.client
    cap = c.status().workers[0].capacity
    assert 0 < cap.tokens_capacity <= 128, cap

    # A request that fits runs.
    small = client.generate_text("In the beginning", max_new_tokens=8, seed=1, timeout=30)
    assert small.finish_reason and small.token_ids

    e = generate_error(client, prompt="In the beginning", max_new_tokens=300, ignore_eos=True)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert "block" in e.details(), e.details()
    # The numbers: blocks needed for prompt + 300 tokens, and the largest pool.
    prompt_tokens = len(client.tokenize("In the beginning"))
    needed = -(-(prompt_tokens + 300) // cap.block_size)
    assert str(needed) in e.details() and str(cap.blocks_total) in e.details(), e.details()
