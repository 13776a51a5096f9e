"""The CUDA serving path on the CUDA emulator (tests/cuda_emu): `kvgrid-worker --device cuda`
loads the plugin built against the emulator, registers, and streams. Its greedy tokens must be
those `kvgrid run` gives on the CPU, for one worker (decode steps replayed from CUDA graphs),
for a two-rank tensor-parallel group on one card (collectives staged through host memory) and
for a two-rank context-parallel group on one card (each rank holding half the blocks).
`--load-format dummy` makes a model's random weights on the card, for one rank only. A worker
whose device faults while it serves (a sticky error: its CUDA context is lost) shuts down."""

import os
import time
from pathlib import Path

import grpc
import pytest

from .conftest import MODEL_DIR, Proc, bin_dir, executable
from .test_startup import weightless_model
from .test_tensor_parallel import run_json, start_group

PROMPT_IDS = [258, 900, 44, 267, 309]
CUDA_FLAGS = ["--device", "cuda", "--dtype", "fp32", "--kv-cache-dtype", "fp32",
              "--kv-cache-memory", "64MiB"]


@pytest.fixture(autouse=True)
def emulated_plugin(monkeypatch):
    plugin = bin_dir() / "libkvgrid_cuda_plugin_emu.so"
    if not plugin.exists():
        pytest.skip(f"{plugin} not built (the CUDA toolkit's headers were not found)")
    # Workers started by the test inherit it.
    monkeypatch.setenv("KVGRID_CUDA_PLUGIN", str(plugin))


def cpu_tokens():
    return run_json(MODEL_DIR, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--temperature",
                    0, "--max-new-tokens", 24, "--ignore-eos")["token_ids"]


def generate(c):
    got = c.client.generate_text(prompt_token_ids=PROMPT_IDS, max_new_tokens=24, temperature=0,
                                 ignore_eos=True)
    return list(got.token_ids)


def test_one_worker_serves_the_cpu_tokens(cluster):
    c = cluster(workers=0)
    w = c.add_worker(CUDA_FLAGS)
    c.wait_serving(1)
    assert generate(c) == cpu_tokens()
    log = w.log()
    assert "kvgrid CUDA emulator" in log, w.describe()  # it ran on the emulated card
    assert "decode steps from CUDA graphs" in log, w.describe()


def test_two_ranks_on_one_card_serve_the_cpu_tokens(cluster):
    c = cluster(workers=0)
    procs = start_group(c, 2, "emu2", CUDA_FLAGS)
    c.wait_serving(1)
    assert generate(c) == cpu_tokens()
    for p in procs:  # NCCL refuses ranks sharing a card: host-staged collectives, no graphs
        assert "no CUDA graphs (the group's collectives cannot be captured" in p.log(), p.describe()


def test_context_parallel_ranks_on_one_card_serve_the_cpu_tokens(cluster):
    from .test_context_parallel import start_cp_group

    c = cluster(workers=0)
    # The 29-token sequence's two blocks of 16 lie one on each rank: both attend, and merge.
    procs = start_cp_group(c, 2, "emucp2", CUDA_FLAGS)
    c.wait_serving(1)
    assert generate(c) == cpu_tokens()
    for p in procs:
        assert "kvgrid CUDA emulator" in p.log(), p.describe()
        assert "no CUDA graphs (the group's collectives cannot be captured" in p.log(), p.describe()


def test_dummy_weights_are_made_on_the_card(cluster, tmp_path):
    c = cluster(workers=0, model_dir=weightless_model(tmp_path))
    w = c.add_worker([*CUDA_FLAGS, "--load-format", "dummy"])
    c.wait_serving(1)
    runs = [c.client.generate_text(prompt_token_ids=PROMPT_IDS, max_new_tokens=8, temperature=0,
                                   ignore_eos=True) for _ in range(2)]
    assert len(runs[0].token_ids) == 8
    assert list(runs[0].token_ids) == list(runs[1].token_ids)
    assert "kvgrid CUDA emulator" in w.log(), w.describe()
    # A group's ranks would each need their shard of one random model: refused.
    rank = Proc("dummy-rank0", [executable("kvgrid-worker"), "--model", c.model_dir,
                                "--coordinator", c.addr, "--group", "dummy2",
                                "--tensor-parallel-size", "2", "--rank", "0", *CUDA_FLAGS,
                                "--load-format", "dummy"],
                c.log_dir / "dummy-rank0.log")
    assert rank.popen.wait(timeout=60) != 0, rank.describe()
    assert "needs a checkpoint" in rank.log(), rank.describe()


@pytest.mark.parametrize("streams", ["deferred", "eager"])
def test_a_worker_whose_device_faults_shuts_down(cluster, tmp_path, monkeypatch, streams):
    # Deferred, the fault shows at the step's synchronization; eager, at the next launch or
    # cuBLAS call, whose own status the executor still reads as a lost context.
    fault = tmp_path / "fault"
    monkeypatch.setenv("KVGRID_CUDA_EMU_FAULT_FILE", str(fault))
    if streams == "eager":
        monkeypatch.setenv("KVGRID_CUDA_EMU_STREAMS", "eager")
    c = cluster(workers=0)
    w = c.add_worker(CUDA_FLAGS)
    c.wait_serving(1)
    assert generate(c) == cpu_tokens()
    fault.touch()  # the next kernel faults, as an illegal address would on a card
    with pytest.raises(grpc.RpcError):
        generate(c)
    deadline = time.monotonic() + 60
    while w.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not w.alive(), w.describe()  # not left registered, failing every request
    assert w.popen.returncode != 0, w.describe()
    log = w.log()
    assert "this worker cannot run steps" in log, w.describe()
    assert "must restart" in log, w.describe()
