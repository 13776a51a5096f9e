"""A sliding-window model served by a cluster: the worker registers its window and step size,
so the coordinator places a sequence far longer than the KV pool (it holds only the window
and one step), which a full-attention model's pool of the same size refuses; a worker killed
mid-stream hands such a sequence to another whose pool is smaller than the sequence."""

import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from .conftest import executable

BYTES_PER_TOKEN = 512  # both fixtures: 2 layers x 2 KV heads x 16 channels x fp32 x (K, V)
# 8 blocks of 16 tokens: 128 tokens of KV.
WORKER_ARGS = ["--kv-cache-memory", str(8 * 16 * BYTES_PER_TOKEN), "--kv-cache-dtype", "fp32",
               "--block-size", "16", "--max-num-batched-tokens", "16", "--threads", "1"]


@pytest.fixture(scope="module")
def fixtures_dir():
    d = os.environ.get("KVGRID_FIXTURES")
    if not d or not (Path(d) / "mistral-window-tiny" / "config.json").exists():
        pytest.fail("KVGRID_FIXTURES must hold the tiny fixture models (ctest sets it)")
    return Path(d)


PROMPT = [100 + (i * 37) % 5000 for i in range(60)]


def test_window_model_serves_sequences_longer_than_the_pool(cluster, fixtures_dir):
    model = fixtures_dir / "mistral-window-tiny"
    c = cluster(workers=1, model_dir=model, worker_args=WORKER_ARGS)
    cap = c.status().workers[0].capacity
    assert (cap.blocks_total, cap.block_size, cap.kv_window, cap.max_num_batched_tokens) == \
        (8, 16, 24, 16), cap
    # 60 + 200 tokens: 17 blocks without the window, at most 4 with it.
    out = c.client.generate_text(prompt_token_ids=PROMPT, max_new_tokens=200, temperature=0,
                                 ignore_eos=True, timeout=120)
    assert out.finish_reason and len(out.token_ids) == 200
    # The same tokens as a local run with room for everything.
    local = subprocess.run(
        [str(executable("kvgrid")), "run", "--model", str(model), "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-new-tokens", "200", "--temperature", "0",
         "--ignore-eos", "--kv-cache-dtype", "fp32", "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    assert list(out.token_ids) == json.loads(local.stdout)["token_ids"]
    assert c.status().workers[0].usage.blocks_used == 0


def test_full_attention_pool_of_the_same_size_refuses(cluster, fixtures_dir):
    c = cluster(workers=1, model_dir=fixtures_dir / "llama3-tiny", worker_args=WORKER_ARGS)
    assert c.status().workers[0].capacity.kv_window == 0
    with pytest.raises(grpc.RpcError) as e:
        c.client.generate_text(prompt_token_ids=PROMPT, max_new_tokens=200, temperature=0,
                               ignore_eos=True, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "17 KV blocks" in e.value.details(), e.value.details()


def test_failover_resumes_a_windowed_sequence_in_a_pool_smaller_than_it(cluster, fixtures_dir):
    # A 150-token prompt in 128-token pools: the survivor re-prefills prompt + the tokens
    # streamed so far in chunks, within the window's blocks, and the stream goes on unchanged.
    model = fixtures_dir / "mistral-window-tiny"
    c = cluster(workers=2, model_dir=model, worker_args=WORKER_ARGS,
                coordinator_args=["--heartbeat-timeout-ms", "2000"])
    prompt = [100 + (i * 53) % 5000 for i in range(150)]
    params = dict(prompt_token_ids=prompt, temperature=0, max_new_tokens=300, ignore_eos=True)
    unfailed = c.client.generate_text(**params, timeout=120)
    assert len(unfailed.token_ids) == 300
    for _ in range(3):  # the kill must land mid-stream; on a loaded machine it may not
        procs = {w.worker_id: c.worker_proc(w.worker_id) for w in c.serving_workers()}
        assert len(procs) == 2, c.status()
        tokens, workers, victim_id = [], [], None
        for r in c.client.generate(**params, timeout=120):
            tokens.extend(r.token_ids)
            if r.worker_id and (not workers or workers[-1] != r.worker_id):
                workers.append(r.worker_id)
            if victim_id is None and len(tokens) >= 20:
                victim_id = r.worker_id
                procs[victim_id].popen.kill()
                procs[victim_id].popen.wait(timeout=10)
        if workers != [victim_id]:
            break
        c.add_worker(WORKER_ARGS)
        c.wait_serving(2)
    assert len(workers) == 2 and workers[0] == victim_id, workers
    assert tokens == list(unfailed.token_ids)
