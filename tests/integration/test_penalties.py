"""Presence and frequency penalties and logit_bias through a cluster: they reach the worker
(the cluster's tokens equal `kvgrid run`'s with the same flags, and `kvgrid generate`'s), a
+100 bias forces a token and -100 bans one, bad values are INVALID_ARGUMENT naming the field,
and a penalized stream that fails over mid-way goes on exactly as the unfailed one."""

import json
import subprocess

import grpc
import pytest

from .conftest import executable, rpc_error
from kvgrid_client import Completion

PROMPT = "And God said"
VOCAB = 4096  # models/kjv-tiny/config.json
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def one_worker(module_cluster):
    return module_cluster(workers=1, worker_args=WORKER_ARGS)


def test_penalized_tokens_equal_kvgrid_run(one_worker, kvgrid_run):
    flags = ["--temperature", 0.8, "--seed", 11, "--max-new-tokens", 24, "--ignore-eos",
             "--presence-penalty", 0.7, "--frequency-penalty", 1.3, "--logit-bias", "44:-3,304:2"]
    ref = kvgrid_run(PROMPT, *flags)
    plain = kvgrid_run(PROMPT, *flags[:7])
    assert ref["token_ids"] != plain["token_ids"], "the penalties changed nothing"
    done = one_worker.client.generate_text(
        PROMPT, temperature=0.8, seed=11, max_new_tokens=24, ignore_eos=True,
        presence_penalty=0.7, frequency_penalty=1.3, logit_bias={"44": -3, 304: 2})
    assert done.token_ids == ref["token_ids"]
    assert done.text == ref["text"]

    # kvgrid generate maps the same flags onto the request.
    argv = [str(executable("kvgrid")), "generate", "--addr", one_worker.addr, "--prompt", PROMPT,
            "--json", *[str(f) for f in flags]]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["token_ids"] == ref["token_ids"], p.stdout


def test_logit_bias_forces_and_bans(one_worker):
    client = one_worker.client
    forced = client.tokenize(" Egypt")[0]
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.5)):
        done = client.generate_text(PROMPT, max_new_tokens=10, ignore_eos=True,
                                    logit_bias={forced: 100}, **params)
        assert done.token_ids == [forced] * 10, (params, done.token_ids)
    greedy = client.generate_text(PROMPT, temperature=0, max_new_tokens=16, ignore_eos=True)
    banned = {t: -100 for t in set(greedy.token_ids[:3])}
    for params in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        done = client.generate_text(PROMPT, max_new_tokens=16, ignore_eos=True,
                                    logit_bias=banned, **params)
        assert not set(done.token_ids) & set(banned), (params, done.token_ids, banned)


# (case id, request fields, text the details must contain)
INVALID = [
    ("presence_above_2", dict(presence_penalty=3.0),
     "sampling.presence_penalty: must be in [-2, 2], got 3"),
    ("frequency_below_minus_2", dict(frequency_penalty=-2.5),
     "sampling.frequency_penalty: must be in [-2, 2], got -2.5"),
    ("frequency_nan", dict(frequency_penalty=float("nan")), "sampling.frequency_penalty"),
    ("bias_id_out_of_vocab", dict(logit_bias={VOCAB: 1.0}),
     f"sampling.logit_bias: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ("bias_id_negative", dict(logit_bias={-1: 1.0}), "sampling.logit_bias: token id -1"),
    ("bias_above_100", dict(logit_bias={5: 150.0}),
     "sampling.logit_bias[5]: must be in [-100, 100], got 150"),
    ("too_many_biases", dict(logit_bias={i: 1.0 for i in range(1025)}),
     "sampling.logit_bias: at most 1024 entries, got 1025"),
]


@pytest.mark.parametrize("fields,needle", [case[1:] for case in INVALID],
                         ids=[case[0] for case in INVALID])
def test_invalid_values_name_the_field(one_worker, fields, needle):
    e = rpc_error(lambda: list(one_worker.client.generate(PROMPT, max_new_tokens=4, timeout=30,
                                                         **fields)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert needle in e.details(), e.details()


def test_bounds_are_accepted(one_worker):
    done = one_worker.client.generate_text(
        PROMPT, max_new_tokens=4, presence_penalty=-2.0, frequency_penalty=2.0,
        logit_bias={i: (100.0 if i % 2 else -100.0) for i in range(1024)})
    assert len(done.token_ids) >= 1


def test_penalized_stream_fails_over_as_if_unfailed(cluster):
    """A seeded, penalized stream whose worker is killed after 10 tokens resumes elsewhere with
    its counts rebuilt from the tokens so far: the client sees exactly the unfailed tokens."""
    c = cluster(workers=2, worker_args=WORKER_ARGS,
                coordinator_args=["--heartbeat-timeout-ms", "2000"])
    params = dict(temperature=0.9, seed=5, max_new_tokens=120, ignore_eos=True,
                  presence_penalty=0.8, frequency_penalty=0.9, repetition_penalty=1.1,
                  logit_bias={44: -2})
    unfailed = c.client.generate_text(PROMPT, **params)
    assert len(unfailed.token_ids) == 120
    for _ in range(3):
        procs = {w.worker_id: c.worker_proc(w.worker_id) for w in c.serving_workers()}
        assert len(procs) == 2, c.status()
        done = Completion()
        victim_id = None
        for r in c.client.generate(PROMPT, **params):
            done.add(r)
            if victim_id is None and len(done.token_ids) >= 10:
                victim_id = r.worker_id
                procs[victim_id].popen.kill()
                procs[victim_id].popen.wait(timeout=10)
        assert victim_id is not None, done
        if done.worker_ids != [victim_id]:
            break
        # The victim had already generated everything: replace it and try again.
        c.add_worker(WORKER_ARGS)
        c.wait_serving(2)
    else:
        raise AssertionError(f"the kill never landed mid-stream: {done.worker_ids}")
    assert len(done.worker_ids) == 2 and done.worker_ids[0] == victim_id, done.worker_ids
    assert done.token_ids == unfailed.token_ids
    assert done.text == unfailed.text
