#!/usr/bin/env python3
"""The OpenAI HTTP front door against the gRPC one, on one cluster it starts itself
(kvgrid-coordinator --http-listen plus workers serving models/kjv-tiny):

  1. added latency: the same greedy streaming request, alternately over gRPC
     (Generation.Generate, the Python client) and over HTTP (/v1/completions with
     stream=true, on a kept-alive connection, SSE parsed as it arrives); time to the first
     token (p50, p90) and per token after it (mean inter-chunk time), and the HTTP-minus-gRPC
     differences of the p50s.
  2. many slow readers: N concurrent SSE streams opened on one coordinator, each read a little
     at a time with pauses (so the coordinator's flow control, not the client, sets the pace);
     the coordinator's thread count and RSS (from /proc) before and at the peak, the peak of
     streams open at once, and tokens relayed per second.

Usage: bench/http_bench.py [--json] [--build build] [--requests 200] [--streams 1000]
Both clients run in this process, so the figures include Python's share on each side; the
comparison is as ratios measured side by side.
"""

import argparse
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "clients" / "python"))

from kvgrid_client import Client  # noqa: E402

MODEL = ROOT / "models" / "kjv-tiny"
PROMPT = "In the beginning"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stats(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS"):
            out[key] = int(value.split()[0])
    return {"threads": out["Threads"], "rss_mib": out["VmRSS"] / 1024}


class Cluster:
    def __init__(self, build: Path, workers: int, worker_args: list, logs: Path):
        self.grpc_port, self.http_port = free_port(), free_port()
        self.procs = []
        env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
        self.coordinator = subprocess.Popen(
            [build / "bin" / "kvgrid-coordinator", "--model", MODEL, "--listen",
             f"127.0.0.1:{self.grpc_port}", "--http-listen", f"127.0.0.1:{self.http_port}",
             "--max-queue-depth", "4096"],
            stdout=open(logs / "coordinator.log", "wb"), stderr=subprocess.STDOUT, env=env)
        self.procs.append(self.coordinator)
        time.sleep(0.5)
        for i in range(workers):
            self.procs.append(subprocess.Popen(
                [build / "bin" / "kvgrid-worker", "--model", MODEL, "--coordinator",
                 f"127.0.0.1:{self.grpc_port}", "--listen", "127.0.0.1:0", *worker_args],
                stdout=open(logs / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT, env=env))
        self.client = Client(f"127.0.0.1:{self.grpc_port}", timeout=600)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if sum(w.state == 1 for w in self.client.cluster_status().workers) == workers:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"cluster not up; logs in {logs}")

    def stop(self):
        self.client.close()
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def request_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def http_stream_times(sock: socket.socket, body: dict) -> list:
    """Sends one streaming request on a kept-alive connection; returns the arrival time of
    each content chunk (SSE event with text)."""
    t0 = time.perf_counter()
    sock.sendall(request_bytes(body))
    buf = b""
    times = []
    head_done = False
    while True:
        data = sock.recv(65536)
        if not data:
            raise RuntimeError("connection closed")
        now = time.perf_counter()
        buf += data
        if not head_done:
            if b"\r\n\r\n" not in buf:
                continue
            _, buf = buf.split(b"\r\n\r\n", 1)
            head_done = True
        # Chunked framing: events appear whole inside; count the text events in what arrived.
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            i = event.find(b"data: ")
            if i < 0:
                continue
            payload = event[i + 6:]
            if payload == b"[DONE]":
                # The last chunk's terminator ("\r\n0\r\n\r\n") follows.
                while not buf.endswith(b"0\r\n\r\n"):
                    buf += sock.recv(65536)
                return [t - t0 for t in times]
            times.append(now)


def grpc_stream_times(client: Client, **params) -> list:
    t0 = time.perf_counter()
    times = []
    for r in client.generate(PROMPT, **params):
        if r.token_ids:
            times.append(time.perf_counter() - t0)
    return times


def latency(cluster: Cluster, requests: int, tokens: int) -> dict:
    sock = socket.create_connection(("127.0.0.1", cluster.http_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    params = dict(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    for _ in range(5):  # warm-up
        http_stream_times(sock, body)
        grpc_stream_times(cluster.client, **params)
    res = {"grpc": {"ttft": [], "tpot": []}, "http": {"ttft": [], "tpot": []}}
    for i in range(requests):
        for api in (("grpc", "http") if i % 2 == 0 else ("http", "grpc")):
            t = (grpc_stream_times(cluster.client, **params) if api == "grpc"
                 else http_stream_times(sock, body))
            res[api]["ttft"].append(t[0])
            if len(t) > 1:
                res[api]["tpot"].append((t[-1] - t[0]) / (len(t) - 1))
    sock.close()
    out = {}
    for api, r in res.items():
        tt = sorted(r["ttft"])
        out[api] = {"ttft_p50_ms": statistics.median(tt) * 1e3,
                    "ttft_p90_ms": tt[int(0.9 * (len(tt) - 1))] * 1e3,
                    "per_token_ms": statistics.mean(r["tpot"]) * 1e3}
    out["added_ttft_p50_ms"] = out["http"]["ttft_p50_ms"] - out["grpc"]["ttft_p50_ms"]
    out["added_per_token_ms"] = out["http"]["per_token_ms"] - out["grpc"]["per_token_ms"]
    out["requests_each"] = requests
    out["max_tokens"] = tokens
    return out


def slow_streams(cluster: Cluster, n: int, tokens: int, read_bytes: int, pause_s: float,
                 rcvbuf: int = 0) -> dict:
    pid = cluster.coordinator.pid
    before = proc_stats(pid)
    sel = selectors.DefaultSelector()
    body = request_bytes({"prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                          "ignore_eos": True, "stream": True})
    state = {}
    t0 = time.perf_counter()
    for i in range(n):
        s = socket.socket()
        if rcvbuf:
            # A small window: the stream backs up into the coordinator, not the kernel.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", cluster.http_port))
        s.sendall(body)
        s.setblocking(False)
        state[s] = {"buf": b"", "events": 0, "done": False, "head": False}
        sel.register(s, selectors.EVENT_READ)
    peak = dict(before)
    peak_open = 0
    peak_in_flight = 0
    total_events = 0
    done = 0
    last_sample = 0.0
    while done < n:
        # Slow readers: every stream gets at most read_bytes per round, then a pause.
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            st = state[s]
            try:
                data = s.recv(read_bytes)
            except BlockingIOError:
                continue
            if not data:
                raise RuntimeError("a stream closed early")
            st["buf"] += data
            st["head"] = True
            c = st["buf"].count(b"data: ")
            if c:
                st["events"] += c
                total_events += c
                st["buf"] = st["buf"][st["buf"].rfind(b"data: ") + 6:]
            if b"[DONE]" in st["buf"] or st["buf"].startswith(b"[DONE]"):
                st["done"] = True
                done += 1
                sel.unregister(s)
                s.close()
        now = time.perf_counter()
        if now - last_sample > 0.5:
            last_sample = now
            cur = proc_stats(pid)
            peak["threads"] = max(peak["threads"], cur["threads"])
            peak["rss_mib"] = max(peak["rss_mib"], cur["rss_mib"])
            peak_open = max(peak_open, n - done)
            try:
                peak_in_flight = max(peak_in_flight,
                                     cluster.client.cluster_status(timeout=5).in_flight)
            except Exception:  # noqa: BLE001
                pass
        time.sleep(pause_s)
    elapsed = time.perf_counter() - t0
    after = proc_stats(pid)
    # Events counted include the [DONE] of each stream: tokens are the rest.
    tokens_relayed = total_events - n
    return {"streams": n, "max_tokens": tokens, "read_bytes_per_round": read_bytes,
            "pause_ms": pause_s * 1e3, "client_rcvbuf": rcvbuf, "elapsed_s": elapsed,
            "coordinator_before": before, "coordinator_peak": peak, "coordinator_after": after,
            "rss_growth_mib": peak["rss_mib"] - before["rss_mib"],
            "thread_growth": peak["threads"] - before["threads"],
            "peak_streams_open": peak_open, "peak_relays_in_flight": peak_in_flight,
            "chunks_relayed": tokens_relayed, "chunks_per_s": tokens_relayed / elapsed,
            # ignore_eos: every stream runs to max_tokens (chunks merge tokens for slow readers).
            "tokens_relayed": n * tokens, "tokens_per_s": n * tokens / elapsed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--read-bytes", type=int, default=256)
    ap.add_argument("--pause-ms", type=float, default=20)
    ap.add_argument("--rcvbuf", type=int, default=0, help="SO_RCVBUF of the slow readers")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="http-bench-"))
    cluster = Cluster(Path(args.build), args.workers,
                      ["--kv-cache-memory", "1GiB", "--max-num-seqs", "256", "--threads",
                       str(max(1, (os.cpu_count() or 2) // 2))], logs)
    try:
        result = {"machine": f"{os.cpu_count()} vCPU", "model": "kjv-tiny",
                  "latency": latency(cluster, args.requests, args.tokens),
                  "slow_streams": slow_streams(cluster, args.streams, args.stream_tokens,
                                               args.read_bytes, args.pause_ms / 1e3,
                                               args.rcvbuf)}
    finally:
        cluster.stop()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        lat, ss = result["latency"], result["slow_streams"]
        print(f"TTFT p50: grpc {lat['grpc']['ttft_p50_ms']:.2f} ms, http "
              f"{lat['http']['ttft_p50_ms']:.2f} ms (added {lat['added_ttft_p50_ms']:.2f} ms)")
        print(f"per token: grpc {lat['grpc']['per_token_ms']:.3f} ms, http "
              f"{lat['http']['per_token_ms']:.3f} ms")
        print(f"{ss['streams']} slow streams: peak open {ss['peak_streams_open']}, threads "
              f"+{ss['thread_growth']}, RSS +{ss['rss_growth_mib']:.1f} MiB, "
              f"{ss['tokens_per_s']:.0f} tokens/s ({ss['chunks_per_s']:.0f} chunks/s)")


if __name__ == "__main__":
    main()
