"""Context-parallel groups over Gloo: two ranks that each hold the whole model and every
other KV block of each sequence serve a request that no single worker of the same memory can
hold, with the greedy tokens of one worker that holds it all; the group registers twice a
worker's capacity; and losing either rank mid-stream takes the group down while the request
finishes on another worker without a token lost or repeated."""

import signal
import time

import grpc

from .conftest import Proc, collect, executable, rpc_error, wait_until
from .test_tensor_parallel import FOLLOWING, fixtures_dir, run_json  # noqa: F401 (fixture)

# llama3-tiny keeps 512 bytes of fp32 KV per token: 512 KiB holds 1024 tokens on one worker,
# and 2048 across the two ranks of a context-parallel group (each holds half the blocks).
POOL = ["--kv-cache-memory", "512KiB"]
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(1400)]


def start_cp_group(c, size: int, name: str, extra=()):
    """Ranks 0..size-1 of context-parallel group `name` registered with cluster `c`; returns
    the Procs (leader first) once the leader listens and every follower follows."""
    procs = []
    for rank in range(size):
        p = Proc(f"{name}-rank{rank}",
                 [executable("kvgrid-worker"), "--model", c.model_dir, "--coordinator", c.addr,
                  "--listen", "127.0.0.1:0", "--group", name, "--context-parallel-size", size,
                  "--rank", rank, "--threads", "1", *extra],
                 c.log_dir / f"{name}-rank{rank}.log")
        c.workers.append(p)  # stopped with the cluster
        procs.append(p)
    procs[0].wait_listening()
    for p in procs[1:]:
        assert wait_until(lambda: FOLLOWING in p.log() or not p.alive(), timeout=60), p.describe()
        assert p.alive(), p.describe()
    return procs


def test_oversize_request_goes_to_the_context_parallel_group(cluster, fixtures_dir):
    model = fixtures_dir / "llama3-tiny"
    small = cluster(workers=1, model_dir=model, worker_args=POOL + ["--threads", "1"])
    e = rpc_error(lambda: small.client.generate_text(prompt_token_ids=PROMPT, max_new_tokens=100,
                                                     temperature=0, ignore_eos=True))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert "1500 tokens" in e.details() and "1024 tokens" in e.details(), e.details()

    c = cluster(workers=1, model_dir=model, worker_args=POOL + ["--threads", "1"])
    leader = start_cp_group(c, 2, "cp", POOL)[0]
    c.wait_serving(2)
    status = c.status()
    big = [g for g in status.groups if g.size == 2][0]
    single = [g for g in status.groups if g.size == 1][0]
    assert big.capacity.tokens_capacity == 2 * single.capacity.tokens_capacity == 2048
    done = collect(c.client.generate(prompt_token_ids=PROMPT, max_new_tokens=100, temperature=0,
                                     ignore_eos=True))
    assert len(done.token_ids) == 100 and done.finish_reason == "length"
    assert set(done.worker_ids) == {w.worker_id for w in status.workers if w.group_id == "cp"}
    want = run_json(model, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 100,
                    "--temperature", 0, "--ignore-eos", "--kv-cache-memory", "4MiB")
    assert done.token_ids == want["token_ids"]
    assert leader.alive()


def _fail_over_after_killing(cluster, fixtures_dir, victim_rank: int):
    model = fixtures_dir / "llama3-tiny"
    c = cluster(workers=0, model_dir=model)
    group = start_cp_group(c, 2, "cpg", ["--block-size", "8"])
    c.wait_serving(1)
    ids = [5, 17, 33, 60, 91, 7, 12]
    want = run_json(model, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", 300,
                    "--temperature", 0, "--ignore-eos")
    stream = c.client.generate(prompt_token_ids=ids, max_new_tokens=300, temperature=0,
                               ignore_eos=True)
    first = next(stream)
    c.add_worker(["--threads", "1"])
    c.wait_serving(2)
    group[victim_rank].popen.send_signal(signal.SIGKILL)
    rest = collect(stream)
    assert list(first.token_ids) + rest.token_ids == want["token_ids"], \
        "tokens lost or repeated across the failover"
    assert rest.finish_reason == "length"
    survivor = group[1 - victim_rank]
    deadline = time.monotonic() + 60
    while survivor.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not survivor.alive(), survivor.describe()
    assert survivor.popen.returncode != 0, survivor.describe()


def test_losing_a_context_parallel_follower_fails_the_request_over(cluster, fixtures_dir):
    _fail_over_after_killing(cluster, fixtures_dir, victim_rank=1)


def test_losing_the_context_parallel_leader_fails_the_request_over(cluster, fixtures_dir):
    _fail_over_after_killing(cluster, fixtures_dir, victim_rank=0)
