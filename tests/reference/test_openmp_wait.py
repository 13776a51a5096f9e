"""The worker (and `kvgrid serve`, whose workers inherit it) chooses libgomp's wait policy
before its OpenMP threads start (kernels/cpu/openmp_wait.h): with neither OMP_WAIT_POLICY nor
GOMP_SPINCOUNT set, the process starts again (same pid) with GOMP_SPINCOUNT=300, also when it
was started through the dynamic loader (as tools/gpu-check.sh runs the GPU bundle); a policy the
user set is left alone; in-process CLI commands keep libgomp's default."""

import os
import socket
import subprocess
import time
from pathlib import Path

from conftest import SOURCE_DIR  # noqa: E402

BIN = Path(os.environ.get("KVGRID_BIN", SOURCE_DIR / "build" / "bin"))
MODEL = SOURCE_DIR / "models" / "kjv-tiny"
CHOICE = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVGRID_OMP_WAIT_CHOSEN")


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment_of(cmd, extra, expect_restart):
    """Starts `cmd` (which keeps running) and reads its environment once the restart, if one is
    expected, has happened."""
    env = {k: v for k, v in os.environ.items() if k not in CHOICE}
    env.update(extra)
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 20
        time.sleep(0.3)
        while True:
            assert p.poll() is None, f"{cmd[0]} exited with {p.returncode}"
            raw = Path(f"/proc/{p.pid}/environ").read_bytes()
            seen = dict(e.split("=", 1) for e in raw.decode().split("\0") if "=" in e)
            # A restart replaces the environment block; until then it is the one passed.
            if not expect_restart or "KVGRID_OMP_WAIT_CHOSEN" in seen:
                return seen
            assert time.monotonic() < deadline, "no restart within 20 s"
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()


def worker():
    # A coordinator that is not there: the worker keeps retrying its registration.
    return [str(BIN / "kvgrid-worker"), "--model", str(MODEL), "--coordinator",
            f"127.0.0.1:{closed_port()}", "--listen", "127.0.0.1:0"]


def test_a_worker_chooses_a_short_spin_by_restarting():
    env = environment_of(worker(), {}, expect_restart=True)
    assert env.get("GOMP_SPINCOUNT") == "300"
    assert env.get("KVGRID_OMP_WAIT_CHOSEN") == "1"
    assert "OMP_WAIT_POLICY" not in env


def interpreter(path):
    """The dynamic loader an ELF executable names (its PT_INTERP), or None."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return None
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    for i in range(phnum):
        ph = data[phoff + i * phentsize:phoff + (i + 1) * phentsize]
        if int.from_bytes(ph[0:4], "little") == 3:  # PT_INTERP
            off = int.from_bytes(ph[8:16], "little")
            size = int.from_bytes(ph[32:40], "little")
            return data[off:off + size].rstrip(b"\0").decode()
    return None


def test_a_worker_started_through_its_loader_restarts_through_it():
    loader = interpreter(BIN / "kvgrid-worker")
    assert loader and Path(loader).exists(), loader
    cmd = worker()
    env = environment_of([loader, "--library-path", "/nonexistent-dir", *cmd], {},
                         expect_restart=True)
    assert env.get("GOMP_SPINCOUNT") == "300"


def test_a_users_policy_is_kept():
    env = environment_of(worker(), {"OMP_WAIT_POLICY": "active"}, expect_restart=False)
    assert env.get("OMP_WAIT_POLICY") == "active"
    assert "GOMP_SPINCOUNT" not in env and "KVGRID_OMP_WAIT_CHOSEN" not in env


def test_in_process_commands_keep_the_default():
    env = environment_of([str(BIN / "kvgrid"), "tokenize", "--tokenizer",
                          str(MODEL / "tokenizer.json")], {}, expect_restart=False)
    assert not any(k in env for k in CHOICE)
