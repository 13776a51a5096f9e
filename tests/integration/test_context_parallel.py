"""Context-parallel groups over Gloo: two ranks that each hold the whole model and every
other KV block of each sequence serve a request that no single worker of the same memory can
hold, with the greedy tokens of one worker that holds it all; the group registers twice a
worker's capacity; losing either rank mid-stream takes the group down while the request
finishes on another worker without a token lost or repeated; and `kvgrid serve --tp 2 --cp 2`
on kjv-tiny (2 KV heads) serves what `--tp 4 --cp 1` of the same memory per rank refuses, and
`--tp 4` alone (`--cp auto`, the default) becomes that 2 x 2 group."""

import signal
import time

import grpc

from kvgrid_client import Client

from .conftest import (MODEL_DIR, Proc, collect, executable, free_port, rpc_error,
                       wait_until)
from .test_tensor_parallel import fixtures_dir, run_json, start_group  # noqa: F401 (fixture)

# llama3-tiny keeps 512 bytes of fp32 KV per token: 512 KiB holds 1024 tokens on one worker,
# and 2048 across the two ranks of a context-parallel group (each holds half the blocks).
POOL = ["--kv-cache-memory", "512KiB"]
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(1400)]


def start_cp_group(c, size: int, name: str, extra=()):
    """Ranks 0..size-1 of context-parallel group `name` registered with cluster `c`; returns
    the Procs (leader first) once the leader listens and every follower follows."""
    return start_group(c, size, name, extra, size_flag="--context-parallel-size")


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
    assert big.capacity.context_parallel_size == 2
    # ClusterStatus shows each rank's pool (the leader's heartbeats carry them).
    def rank_pools():
        leader_info = [w for w in c.status().workers if w.group_id == "cp"][0]
        return [(r.blocks_total, r.blocks_used) for r in leader_info.usage.ranks]
    assert wait_until(lambda: rank_pools() == [(64, 0), (64, 0)], timeout=30), rank_pools()
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


def _serve(tmp_path, name, *flags):
    port = free_port()
    serve = Proc(name, [executable("kvgrid"), "serve", "--model", MODEL_DIR, "--port", port,
                        "--http-port", "0", "--threads", "1", "--drain-timeout-s", "2", *flags],
                 tmp_path / f"{name}.log")
    assert wait_until(lambda: "kvgrid serve: ready" in serve.log() or not serve.alive(),
                      timeout=180), serve.describe()
    assert serve.alive(), serve.describe()
    return serve, Client(f"127.0.0.1:{port}", timeout=120)


def test_serve_tp2_cp2_holds_what_tp4_refuses(tmp_path):
    # kjv-tiny keeps 2 KiB of fp32 KV per token for each of its 2 KV heads. At 512 KiB per
    # rank a --tp 4 group (each rank one head, so each head twice) holds 256 tokens of a
    # sequence; a --tp 2 --cp 2 group (each rank one head and half the blocks) holds 512.
    pool = ["--kv-cache-memory", "512KiB"]
    prompt = "And God said, Let there be light: and there was light. " * 24
    tp4, client = _serve(tmp_path, "tp4", "--tp", "4", "--cp", "1", *pool)
    try:
        assert client.cluster_status(timeout=10).groups[0].capacity.tokens_capacity == 256
        e = rpc_error(lambda: client.generate_text(prompt, max_new_tokens=100, temperature=0,
                                                   ignore_eos=True))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert "256 tokens" in e.details(), e.details()
    finally:
        client.close()
        tp4.stop()
    tpcp, client = _serve(tmp_path, "tp2cp2", "--tp", "2", "--cp", "2", *pool)
    try:
        group = client.cluster_status(timeout=10).groups[0]
        assert group.size == 4 and group.capacity.tokens_capacity == 512
        got = client.generate_text(prompt, max_new_tokens=100, temperature=0, ignore_eos=True)
        assert len(got.token_ids) == 100 and got.finish_reason == "length"
        want = run_json(MODEL_DIR, "--prompt", prompt, "--max-new-tokens", 100,
                        "--temperature", 0, "--ignore-eos")
        assert got.token_ids == want["token_ids"]
    finally:
        client.close()
        tpcp.stop()


def test_serve_cp_auto_turns_replicas_into_context_parallel_ranks(tmp_path):
    # --cp auto is the default: --tp 4 on 2 KV heads becomes 2 x 2, not replicated heads.
    serve, client = _serve(tmp_path, "tp4auto", "--tp", "4", "--kv-cache-memory", "512KiB")
    try:
        assert "group 0 is 2 x 2 (tp x cp) for 2 KV heads" in serve.log(), serve.describe()
        group = client.cluster_status(timeout=10).groups[0]
        assert group.size == 4 and group.capacity.context_parallel_size == 2
        assert group.capacity.tokens_capacity == 512
    finally:
        client.close()
        serve.stop()
