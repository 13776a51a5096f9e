"""Shared fixtures for tests/integration: real kvgrid processes on loopback.

Environment (ctest sets all of them):
  KVGRID_BIN         directory with kvgrid, kvgrid-coordinator and kvgrid-worker
  KVGRID_SOURCE_DIR  repository root (the model is models/kjv-tiny, the client clients/python)
  KVGRID_PY_STUBS    where the Python gRPC modules are generated (default <root>/build/python-stubs)

`cluster(workers=N, worker_args=[...], coordinator_args=[...])` starts a coordinator and N
workers serving models/kjv-tiny, waits until the coordinator reports N workers SERVING, and
returns a `Cluster`. Every process is stopped when the test ends (SIGTERM, then SIGKILL), and
is started under `setpriv --pdeathsig KILL` so that it dies with the test process even if that
is killed. Each process's stdout and stderr go to a log file; the logs of a failed test are
printed with its report.
"""

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SOURCE_DIR = Path(os.environ.get("KVGRID_SOURCE_DIR", HERE.parent.parent)).resolve()
MODEL_DIR = SOURCE_DIR / "models" / "kjv-tiny"
MODEL_ID = "kjv-tiny"

sys.path.insert(0, str(SOURCE_DIR / "clients" / "python"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvgrid_client import Client, Completion, pb  # noqa: E402

# Seconds to wait for a process to print its address, and for N workers to be SERVING.
LISTEN_TIMEOUT_S = 30
SERVING_TIMEOUT_S = 60
# Seconds between SIGTERM and SIGKILL at teardown.
STOP_TIMEOUT_S = 10
# Default deadline of every client call.
CALL_TIMEOUT_S = 120

# Several clusters share this machine's few cores while ctest runs tests in parallel: OpenMP
# threads that spin while waiting would starve the other processes' threads.
_SHARED_MACHINE_ENV = {"OMP_WAIT_POLICY": "passive"}

_LISTENING = re.compile(r"kvgrid-(?:coordinator|worker): listening on (\S+)")
_SETPRIV = shutil.which("setpriv")


def bin_dir() -> Path:
    d = os.environ.get("KVGRID_BIN")
    if not d:
        pytest.fail("KVGRID_BIN is not set (ctest sets it to <build>/bin)")
    return Path(d).resolve()


def executable(name: str) -> Path:
    exe = bin_dir() / name
    if not exe.is_file():
        pytest.fail(f"{exe} does not exist: build the `{name}` target first")
    return exe


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_of(address: str) -> int:
    """"127.0.0.1:5000", "[::1]:5000", "localhost:5000" -> 5000."""
    return int(address.rsplit(":", 1)[1])


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """Calls predicate() until it returns something truthy (returned) or `timeout` passes
    (returns the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def rpc_error(fn) -> grpc.RpcError:
    """Runs fn() (which should fail with a gRPC error) and returns the error."""
    try:
        result = fn()
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"expected a gRPC error, got {str(result)[:2000]!r}")


def collect(stream) -> Completion:
    """Reads a single-continuation stream to its end."""
    c = Completion()
    for r in stream:
        c.add(r)
    return c


def health_stub(channel) -> health_pb2_grpc.HealthStub:
    return health_pb2_grpc.HealthStub(channel)


def health_check(channel, service: str = "", timeout: float = 5.0) -> int:
    """grpc.health.v1 Check(service): a HealthCheckResponse.ServingStatus value."""
    req = health_pb2.HealthCheckRequest(service=service)
    return health_stub(channel).Check(req, timeout=timeout).status


# Every process any test started, so that nothing outlives the session.
_all_procs = []


def _kill_leftovers():
    for p in _all_procs:
        if p.popen.poll() is None:
            p.popen.kill()
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


atexit.register(_kill_leftovers)


class Proc:
    """One kvgrid process; its stdout and stderr go to `log_path`."""

    def __init__(self, name: str, argv: list, log_path: Path, env: dict | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.address = None  # host:port it printed once listening
        with open(log_path, "wb") as log:
            prefix = [_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []
            self.popen = subprocess.Popen(prefix + self.argv, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **_SHARED_MACHINE_ENV, **(env or {})})
        _all_procs.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return port_of(self.address)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log()
        return text if len(text) <= chars else "..." + text[-chars:]

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited with {self.popen.returncode}"
        return (f"--- {self.name} (pid {self.pid}, {state}): $ {' '.join(self.argv)}\n"
                f"{self.log_tail()}")

    def wait_listening(self, timeout: float = LISTEN_TIMEOUT_S) -> str:
        """Waits for the "listening on HOST:PORT" line; returns and remembers HOST:PORT."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log())
            if m:
                self.address = m.group(1)
                return self.address
            if not self.alive():
                raise AssertionError(f"{self.name} exited before listening\n{self.describe()}")
            time.sleep(0.02)
        raise AssertionError(f"{self.name} printed no 'listening on' line in {timeout} s\n"
                             f"{self.describe()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        if self.popen.returncode is None:
            self.popen.wait()


class Cluster:
    """A coordinator and its workers. `client` talks to the coordinator at `addr`."""

    def __init__(self, log_dir: Path, coordinator_args=(), model_dir: Path = MODEL_DIR):
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.workers: list[Proc] = []
        self.coordinator = None
        self.client = None
        # The free port can be taken between the probe and the bind: retry a few times.
        for attempt in range(3):
            port = free_port()
            proc = Proc("coordinator", [executable("kvgrid-coordinator"), "--model", model_dir,
                                        "--listen", f"127.0.0.1:{port}", *coordinator_args],
                        log_dir / f"coordinator-{attempt}.log")
            try:
                proc.wait_listening()
            except AssertionError:
                proc.stop()
                if attempt == 2 or "in use" not in proc.log().lower():
                    raise
                continue
            self.coordinator = proc
            break
        assert port_of(self.coordinator.address) == port, (
            f"coordinator asked to listen on port {port} says {self.coordinator.address}")
        self.addr = f"127.0.0.1:{port}"
        self.client = Client(self.addr, timeout=CALL_TIMEOUT_S)

    def add_worker(self, worker_args=()) -> Proc:
        """Starts one more worker and waits until it listens (not until it is SERVING)."""
        n = len(self.workers)
        proc = Proc(f"worker-{n}", [executable("kvgrid-worker"), "--model", self.model_dir,
                                    "--coordinator", self.addr, "--listen", "127.0.0.1:0",
                                    *worker_args],
                    self.log_dir / f"worker-{n}.log")
        self.workers.append(proc)
        proc.wait_listening()
        return proc

    def status(self) -> pb.ClusterStatusResponse:
        return self.client.cluster_status(timeout=10)

    def serving_workers(self) -> list:
        return [w for w in self.status().workers if w.state == pb.WORKER_STATE_SERVING]

    def wait_serving(self, n: int, timeout: float = SERVING_TIMEOUT_S) -> None:
        """Waits until ClusterStatus lists `n` workers SERVING; fails early if a process dies."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            dead = [p for p in [self.coordinator] + self.workers
                    if not p.alive() and p.popen.returncode not in (-signal.SIGKILL,)]
            if dead:
                raise AssertionError(f"{dead[0].name} died while waiting for {n} serving "
                                     f"workers\n{self.describe()}")
            try:
                last = self.status()
                if sum(w.state == pb.WORKER_STATE_SERVING for w in last.workers) == n:
                    return
            except grpc.RpcError as e:
                last = e
            time.sleep(0.1)
        raise AssertionError(f"not {n} workers SERVING after {timeout} s; last ClusterStatus:"
                             f"\n{last}\n{self.describe()}")

    def worker_proc(self, worker_id: str) -> Proc:
        """The worker process that ClusterStatus calls `worker_id` (matched by port)."""
        info = [w for w in self.status().workers if w.worker_id == worker_id]
        assert info, f"worker_id {worker_id!r} is not in ClusterStatus:\n{self.status()}"
        port = port_of(info[0].address)
        procs = [p for p in self.workers if p.address and p.port == port]
        assert len(procs) == 1, (f"worker {worker_id} at {info[0].address}: no single started "
                                 f"worker has port {port} ({[p.address for p in self.workers]})")
        return procs[0]

    def describe(self) -> str:
        procs = ([self.coordinator] if self.coordinator else []) + self.workers
        return "\n".join(p.describe() for p in procs)

    def stop(self) -> None:
        """Stops every process: SIGTERM to all, then SIGKILL to any left after a timeout."""
        if self.client is not None:
            self.client.close()
        procs = self.workers + ([self.coordinator] if self.coordinator else [])
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()


class ClusterFactory:
    """Starts clusters; stops all of them at close()."""

    def __init__(self, log_root: Path):
        self.log_root = log_root
        self.clusters: list[Cluster] = []

    def __call__(self, workers: int = 1, worker_args=(), coordinator_args=(),
                 model_dir: Path = MODEL_DIR) -> Cluster:
        log_dir = self.log_root / f"cluster-{len(self.clusters)}"
        log_dir.mkdir(parents=True, exist_ok=True)
        c = Cluster(log_dir, coordinator_args=coordinator_args, model_dir=model_dir)
        self.clusters.append(c)
        for _ in range(workers):
            c.add_worker(worker_args)
        c.wait_serving(workers)
        return c

    def describe(self) -> str:
        return "\n".join(c.describe() for c in self.clusters)

    def close(self) -> None:
        for c in reversed(self.clusters):
            c.stop()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def cluster(request, tmp_path):
    """A factory: cluster(workers=1, worker_args=(), coordinator_args=()) -> Cluster.

    The processes live until the end of the test; a failed test prints their logs.
    """
    factory = ClusterFactory(tmp_path)
    try:
        yield factory
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"process logs ({tmp_path}):\n{factory.describe()}")
        factory.close()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    """Like `cluster`, but the processes live until the end of the test module: for tests
    that only read (tokenize, validation errors, greedy generation)."""
    factory = ClusterFactory(tmp_path_factory.mktemp("cluster"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="session")
def kvgrid_run():
    """kvgrid_run(prompt, *flags) -> the JSON object of `kvgrid run --json` on kjv-tiny."""
    exe = executable("kvgrid")

    def run(prompt: str, *flags):
        argv = [str(exe), "run", "--model", str(MODEL_DIR), "--prompt", prompt, "--json",
                *[str(f) for f in flags]]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"$ {' '.join(argv)}\nexit {p.returncode}\n{p.stderr[-3000:]}"
        return json.loads(p.stdout)

    return run
