"""Tensor-parallel groups over Gloo: a two-rank group generates exactly what one worker does
(trained and fixture models), a request too large for every single worker's KV pool goes to
the two-rank group (and is refused at once, with the numbers, by a cluster without one), and
losing either rank of a group takes the whole group down — no process hangs — while its
request finishes on another worker, and a frozen rank stalls the group, whose request moves
to another worker within the stall timeout."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

import pytest

from kvgrid_client import pb

from .conftest import (MODEL_DIR, Proc, collect, executable, health_check, rpc_error,
                       wait_until)

FOLLOWING = "following"


@pytest.fixture(scope="module")
def fixtures_dir():
    """The generated tiny models (ctest's tiny_models fixture makes them)."""
    d = os.environ.get("KVGRID_FIXTURES")
    if not d or not (Path(d) / "llama3-tiny" / "config.json").exists():
        pytest.fail("KVGRID_FIXTURES must hold the tiny fixture models (ctest sets it)")
    return Path(d)


def start_group(c, size: int, name: str, extra=(), size_flag="--tensor-parallel-size"):
    """Starts ranks 0..size-1 of group `name` registered with cluster `c` (a tensor-parallel
    group, or as `size_flag` says); returns the Procs (leader first) once the leader listens
    and every follower follows."""
    procs = []
    for rank in range(size):
        p = Proc(f"{name}-rank{rank}",
                 [executable("kvgrid-worker"), "--model", c.model_dir, "--coordinator", c.addr,
                  "--listen", "127.0.0.1:0", "--group", name, size_flag, size,
                  "--rank", rank, "--threads", "1", *extra],
                 c.log_dir / f"{name}-rank{rank}.log")
        c.workers.append(p)  # stopped with the cluster
        procs.append(p)
    procs[0].wait_listening()
    for p in procs[1:]:
        assert wait_until(lambda: FOLLOWING in p.log() or not p.alive(), timeout=60), p.describe()
        assert p.alive(), p.describe()
    return procs


def run_json(model_dir, *flags):
    argv = [str(executable("kvgrid")), "run", "--model", str(model_dir), "--json",
            *[str(f) for f in flags]]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_two_ranks_generate_what_one_worker_does(cluster, fixtures_dir):
    c = cluster(workers=0)
    start_group(c, 2, "tp2")
    c.wait_serving(1)
    group = [g for g in c.status().groups][0]
    assert group.size == 2
    for prompt in ["In the beginning", "And God said, Let there be light"]:
        got = c.client.generate_text(prompt, max_new_tokens=48, temperature=0, ignore_eos=True)
        want = run_json(MODEL_DIR, "--prompt", prompt, "--max-new-tokens", 48, "--temperature",
                        0, "--ignore-eos")
        assert got.token_ids == want["token_ids"], prompt
        assert got.text == want["text"]

    # The fixture model (bf16 weights, llama3 RoPE): token ids in, token ids out.
    model = fixtures_dir / "llama3-tiny"
    f = cluster(workers=0, model_dir=model)
    start_group(f, 2, "tp2f")
    f.wait_serving(1)
    ids = [5, 17, 33, 60, 91, 7, 12]
    got = f.client.generate_text(prompt_token_ids=ids, max_new_tokens=40, temperature=0,
                                 ignore_eos=True)
    want = run_json(model, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", 40,
                    "--temperature", 0, "--ignore-eos")
    assert got.token_ids == want["token_ids"]


# llama3-tiny keeps 512 bytes of fp32 KV per token: 512 KiB holds 1024 tokens on one worker,
# and 2048 on each rank of a two-rank group (half the KV heads each).
POOL = ["--kv-cache-memory", "512KiB"]
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(1400)]


def test_oversize_request_goes_to_the_two_rank_group(cluster, fixtures_dir):
    model = fixtures_dir / "llama3-tiny"
    small = cluster(workers=2, model_dir=model, worker_args=POOL + ["--threads", "1"])
    e = rpc_error(lambda: small.client.generate_text(prompt_token_ids=PROMPT, max_new_tokens=100,
                                                     temperature=0, ignore_eos=True))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert "1500 tokens" in e.details() and "1024 tokens" in e.details(), e.details()

    c = cluster(workers=2, model_dir=model, worker_args=POOL + ["--threads", "1"])
    leader = start_group(c, 2, "big", POOL)[0]
    c.wait_serving(3)
    status = c.status()
    big = [g for g in status.groups if g.size == 2][0]
    assert big.capacity.tokens_capacity == 2 * max(
        g.capacity.tokens_capacity for g in status.groups if g.size == 1)
    done = collect(c.client.generate(prompt_token_ids=PROMPT, max_new_tokens=100, temperature=0,
                                     ignore_eos=True))
    assert len(done.token_ids) == 100 and done.finish_reason == "length"
    assert set(done.worker_ids) == {w.worker_id for w in status.workers if w.group_id == "big"}
    want = run_json(model, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 100,
                    "--temperature", 0, "--ignore-eos", "--kv-cache-memory", "4MiB")
    assert done.token_ids == want["token_ids"]
    assert leader.alive()


def _stream_on_a_group_beside_a_worker(cluster, group_args=()):
    """A two-rank group streaming a greedy request (its first response read) and then a
    single worker to fail over to: (cluster, group procs, single worker, the uninterrupted
    run's tokens, the stream, its first response)."""
    c = cluster(workers=0)
    group = start_group(c, 2, "g", group_args)
    c.wait_serving(1)
    want = run_json(MODEL_DIR, "--prompt", "In the beginning", "--max-new-tokens", 300,
                    "--temperature", 0, "--ignore-eos")
    stream = c.client.generate("In the beginning", max_new_tokens=300, temperature=0,
                               ignore_eos=True)
    first = next(stream)
    other = c.add_worker(["--threads", "1"])
    c.wait_serving(2)
    return c, group, other, want, stream, first


def _fail_over_after_killing(cluster, victim_rank: int):
    # The group loses a rank mid-stream.
    c, group, _, want, stream, first = _stream_on_a_group_beside_a_worker(cluster)
    group[victim_rank].popen.send_signal(signal.SIGKILL)
    rest = collect(stream)
    tokens = list(first.token_ids) + rest.token_ids
    assert tokens == want["token_ids"], "tokens lost or repeated across the failover"
    assert rest.finish_reason == "length"
    # The surviving rank leaves by itself: no hang.
    survivor = group[1 - victim_rank]
    deadline = time.monotonic() + 60
    while survivor.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not survivor.alive(), survivor.describe()
    assert survivor.popen.returncode != 0, survivor.describe()


def test_losing_a_follower_takes_the_group_down_and_fails_over(cluster):
    _fail_over_after_killing(cluster, victim_rank=1)


def test_losing_the_leader_takes_the_group_down_and_fails_over(cluster):
    _fail_over_after_killing(cluster, victim_rank=0)


def test_a_frozen_follower_stalls_the_group_and_its_request_moves_within_the_stall_timeout(
        cluster):
    """A follower that freezes (SIGSTOP) leaves the leader's step waiting in a collective that
    would give up only after --collective-timeout-s (120 s here). The leader's stall watchdog
    sees it after --stall-timeout-s (2 s): the leader answers NOT_SERVING, ClusterStatus shows
    it STALLED and places nothing there, and the stream moves to the other worker with no token
    lost or repeated, long before the collective timeout. Thawed, the group finishes its step
    and serves again."""
    c, (leader, follower), other, want, stream, first = _stream_on_a_group_beside_a_worker(
        cluster, ["--stall-timeout-s", 2, "--collective-timeout-s", 120])
    leader_id = [w.worker_id for w in c.status().workers if w.group_id == "g"][0]
    follower.popen.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        rest = collect(stream)
        took = time.monotonic() - frozen_at
        assert list(first.token_ids) + rest.token_ids == want["token_ids"], \
            "tokens lost or repeated across the failover"
        assert rest.finish_reason == "length"
        assert took < 60, f"the stalled group held its request for {took:.1f} s"
        assert leader_id not in rest.worker_ids[-1:], rest.worker_ids
        with grpc.insecure_channel(leader.address) as ch:
            assert health_check(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert wait_until(lambda: any(w.worker_id == leader_id and
                                      w.state == pb.WORKER_STATE_STALLED
                                      for w in c.status().workers), timeout=10), c.status()
        # New requests go to the worker that can serve them, at once.
        done = c.client.generate_text("And God said", max_new_tokens=8, temperature=0)
        assert done.worker_ids and leader_id not in done.worker_ids, done.worker_ids
        assert follower.alive() and leader.alive()
    finally:
        follower.popen.send_signal(signal.SIGCONT)
    # The step finishes, the leader drops the request that moved away and serves again.
    with grpc.insecure_channel(leader.address) as ch:
        assert wait_until(lambda: health_check(ch) == health_pb2.HealthCheckResponse.SERVING,
                          timeout=60), leader.describe()
    c.wait_serving(2)
    assert "making progress again" in leader.log(), leader.describe()
    assert other.alive()
