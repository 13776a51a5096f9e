#!/usr/bin/env python3
"""Faults injected into a running cluster and what the clients saw: for each fault, N greedy
streaming requests are started, the fault lands while they stream, and every request is
counted as completed (exactly the tokens of an unfailed run), failed (an error at the client
after its retries), or duplicated (a token repeated or the stream longer than asked);
`failed_over` counts the streams the coordinator moved to another worker mid-way.

  worker_kill         2 workers, one coordinator; one worker SIGKILLed mid-stream (the
                      coordinator fails its sequences over to the other).
  worker_freeze       as above, one worker SIGSTOPped mid-stream (keep-alive pings break its
                      streams; the coordinator fails them over), SIGCONTed at the end.
  coordinator_kill    2 coordinators A and B over the same 2 workers (--coordinator A,B); A
                      SIGKILLed mid-stream; its clients get UNAVAILABLE and retry on B from
                      the start (counted in `retried`).
  rank_loss           a two-rank tensor-parallel group (Gloo) serves the requests; a single
                      worker joins, then the group's follower rank is SIGKILLed mid-stream
                      (the leader's collective fails, the group leaves, the coordinator fails
                      its sequences over to the single worker).
  rank_freeze         as rank_loss, but the follower is SIGSTOPped (its process and sockets
                      stay up, so no collective fails before --collective-timeout-s, 120 s
                      here); the leader's stall watchdog (--stall-timeout-s 3) ends its
                      requests and the coordinator fails them over; SIGCONTed at the end.

Usage: bench/fault_injection.py [--json] [--build build] [--requests 8] [--tokens 120]
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))

import grpc  # noqa: E402
from kvgrid_client import Client, Completion, pb  # noqa: E402

MODEL = ROOT / "models" / "kjv-tiny"
PROMPT = "In the beginning"
LISTENING = re.compile(r"kvgrid-(?:coordinator|worker): listening on (\S+)")
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, build: Path, logs: Path, coordinators: int, group: bool = False,
                 group_args=()):
        self.build, self.logs = build, logs
        self.procs = []
        self.addrs = [f"127.0.0.1:{free_port()}" for _ in range(coordinators)]
        self.coordinators = [self.start("kvgrid-coordinator", "--model", MODEL, "--listen", a,
                                        "--heartbeat-interval-ms", "500",
                                        "--heartbeat-timeout-ms", "2000")
                             for a in self.addrs]
        if group:  # ranks 0 and 1 of one group; the single worker comes later (add_worker)
            self.workers = [self.start("kvgrid-worker", "--model", MODEL, "--coordinator",
                                       self.addrs[0], "--listen", "127.0.0.1:0", "--group", "g",
                                       "--tensor-parallel-size", "2", "--rank", str(rank),
                                       "--threads", "1", *WORKER_ARGS, *group_args,
                                       listening=False)
                            for rank in range(2)]
            # The leader listens once its follower has joined: both must be started first.
            self.wait_listening(self.workers[0])
            self.wait_serving(self.addrs[0], 1)
            return
        self.workers = [self.add_worker() for _ in range(2)]
        for a in self.addrs:
            self.wait_serving(a, 2)

    def add_worker(self):
        return self.start("kvgrid-worker", "--model", MODEL, "--coordinator", ",".join(self.addrs),
                          "--listen", "127.0.0.1:0", *WORKER_ARGS)

    def start(self, program, *args, listening=True):
        log = open(self.logs / f"{program}-{len(self.procs)}.log", "wb")
        p = subprocess.Popen([str(self.build / "bin" / program), *map(str, args)],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, "OMP_WAIT_POLICY": "passive"})
        p.log_path = log.name
        self.procs.append(p)
        if listening:
            self.wait_listening(p)
        return p

    def wait_listening(self, p):
        deadline = time.monotonic() + 60
        while not LISTENING.search(Path(p.log_path).read_text(errors="replace")):
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{p.args[0]} did not start; see {p.log_path}")
            time.sleep(0.02)

    def wait_serving(self, addr, n):
        deadline = time.monotonic() + 60
        with Client(addr, timeout=10) as c:
            while time.monotonic() < deadline:
                try:
                    if sum(w.state == pb.WORKER_STATE_SERVING
                           for w in c.cluster_status().workers) == n:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise SystemExit(f"{addr}: not {n} workers serving")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


def run_fault(build, logs, fault, n, tokens):
    cluster = Cluster(build, logs, coordinators=2 if fault == "coordinator_kill" else 1,
                      group=fault in ("rank_loss", "rank_freeze"),
                      group_args=["--stall-timeout-s", "3", "--collective-timeout-s", "120"]
                      if fault == "rank_freeze" else [])
    clients = [Client(a, timeout=120) for a in cluster.addrs]
    try:
        params = dict(temperature=0, max_new_tokens=tokens, ignore_eos=True)
        expected = clients[-1].generate_text(PROMPT, **params).token_ids
        results = [None] * n
        retried = [0] * n
        streaming = threading.Semaphore(0)

        def one(k):
            for attempt, client in enumerate(clients):
                got = Completion()
                try:
                    for r in client.generate(PROMPT, timeout=120, **params):
                        if not got.token_ids and r.token_ids:
                            streaming.release()
                        got.add(r)
                    results[k] = got
                    return
                except grpc.RpcError as e:
                    results[k] = e
                    if attempt + 1 < len(clients):
                        retried[k] += 1

        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for _ in range(n):  # every request has its first token: the fault lands mid-stream
            streaming.acquire(timeout=60)
        if fault == "worker_kill":
            cluster.workers[0].kill()
        elif fault == "worker_freeze":
            cluster.workers[0].send_signal(signal.SIGSTOP)
        elif fault in ("rank_loss", "rank_freeze"):
            cluster.add_worker()  # somewhere to fail over to
            cluster.wait_serving(cluster.addrs[0], 2)
            if fault == "rank_loss":
                cluster.workers[1].kill()
            else:
                cluster.workers[1].send_signal(signal.SIGSTOP)
        else:
            cluster.coordinators[0].kill()
        t0 = time.monotonic()
        for t in threads:
            t.join(timeout=180)
        elapsed = time.monotonic() - t0
        hung = sum(t.is_alive() for t in threads)
        completed = failed = duplicated = wrong = 0
        failed_over = sum(isinstance(r, Completion) and len(r.worker_ids) > 1 for r in results)
        for r in results:
            if not isinstance(r, Completion):
                failed += 1
            elif len(r.token_ids) > tokens:
                duplicated += 1
            elif r.token_ids == expected:
                completed += 1
            else:
                wrong += 1
        return {"fault": fault, "requests": n, "tokens_each": tokens, "completed": completed,
                "failed": failed, "duplicated": duplicated, "wrong_tokens": wrong,
                "hung": hung, "failed_over": failed_over, "retried": sum(retried),
                "seconds_after_fault": round(elapsed, 2)}
    finally:
        for c in clients:
            c.close()
        cluster.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--faults",
                    default="worker_kill,worker_freeze,coordinator_kill,rank_loss,rank_freeze")
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory(prefix="kvgrid-faults-") as tmp:
        for fault in args.faults.split(","):
            logs = Path(tmp) / fault
            logs.mkdir()
            out.append(run_fault(args.build, logs, fault, args.requests, args.tokens))
            if not args.json:
                print(" ".join(f"{k}={v}" for k, v in out[-1].items()), flush=True)
    if args.json:
        print(json.dumps({"machine": f"{os.cpu_count()} cores", "results": out}, indent=2))


if __name__ == "__main__":
    main()
