"""The coordinator is no single point of failure.

(a) A coordinator killed (SIGKILL) and restarted on the same port under two live workers has
both back within a bound of one heartbeat plus slack (ids carry the coordinator's epoch, so
no worker keeps another's entry fresh), and generates on both.
(b) Workers given `--coordinator A,B` register with both; both coordinators serve; A killed,
B keeps serving, and every request sent to B while A dies completes.
(c) A stream through a coordinator killed mid-stream fails UNAVAILABLE at the client (no hang),
and a client that retries on the other coordinator completes every request, once each.
(d) Each coordinator counts only what it placed, so the workers' own bound (--max-num-seqs +
--max-queue-depth) holds across both: a request that finds its worker full moves to another,
and with none left the client gets RESOURCE_EXHAUSTED at once.

Each test prints its fault-injection figures (completed / failed / duplicated) as a JSON line
starting with FAULTS, for bench/RESULTS.md."""

import json
import signal
import threading
import time

import grpc

from .conftest import (CALL_TIMEOUT_S, MODEL_DIR, Proc, collect, executable, free_port,
                       rpc_error, wait_until)
from kvgrid_client import Client, Completion, pb

HEARTBEAT_MS = 500
# A restarted coordinator must have every live worker back within one heartbeat interval;
# the slack covers the reconnect back-off (at most 500 ms), the registration call and a loaded
# 2-core machine.
BACK_WITHIN_S = 3.0
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"]
PROMPTS = ["In the beginning", "And God said", "The LORD is my", "Blessed are the",
           "And it came to pass", "Now these are the", "Hear, O Israel", "Let there be"]


def faults(**figures):
    print("FAULTS " + json.dumps(figures, sort_keys=True))


class Coordinators:
    """Coordinators at fixed ports (so one can be restarted where it was) and workers that
    register with all of them."""

    def __init__(self, log_dir, n_coordinators=1):
        self.log_dir = log_dir
        self.ports = [free_port() for _ in range(n_coordinators)]
        self.coordinators = [None] * n_coordinators
        self.workers = []
        self.starts = 0
        for i in range(n_coordinators):
            self.start_coordinator(i)

    def addr(self, i):
        return f"127.0.0.1:{self.ports[i]}"

    def start_coordinator(self, i):
        self.starts += 1
        proc = Proc(f"coordinator-{i}", [executable("kvgrid-coordinator"), "--model", MODEL_DIR,
                                         "--listen", self.addr(i),
                                         "--heartbeat-interval-ms", str(HEARTBEAT_MS),
                                         "--heartbeat-timeout-ms", "2000"],
                    self.log_dir / f"coordinator-{i}-{self.starts}.log")
        proc.wait_listening()
        self.coordinators[i] = proc
        return proc

    def kill_coordinator(self, i):
        p = self.coordinators[i]
        p.popen.kill()
        p.popen.wait(timeout=10)

    def add_worker(self, args=WORKER_ARGS):
        n = len(self.workers)
        proc = Proc(f"worker-{n}", [executable("kvgrid-worker"), "--model", MODEL_DIR,
                                    "--coordinator", ",".join(self.addr(i) for i in
                                                              range(len(self.ports))),
                                    "--listen", "127.0.0.1:0", *args],
                    self.log_dir / f"worker-{n}.log")
        self.workers.append(proc)
        proc.wait_listening()
        return proc

    def client(self, i):
        return Client(self.addr(i), timeout=CALL_TIMEOUT_S)

    def serving(self, i):
        with self.client(i) as c:
            return [w for w in c.cluster_status(timeout=5).workers
                    if w.state == pb.WORKER_STATE_SERVING]

    def wait_serving(self, i, n, timeout=60.0):
        def ready():
            for p in self.workers:
                assert p.alive(), p.describe()
            try:
                return len(self.serving(i)) == n
            except grpc.RpcError:
                return False
        assert wait_until(ready, timeout=timeout, interval=0.05), self.describe()

    def describe(self):
        return "\n".join(p.describe() for p in [*self.coordinators, *self.workers] if p)

    def stop(self):
        for p in [*self.workers, *self.coordinators]:
            if p:
                p.stop()


def run_test(tmp_path, n_coordinators, body):
    cs = Coordinators(tmp_path, n_coordinators)
    try:
        body(cs)
    except BaseException:
        print(f"process logs ({tmp_path}):\n{cs.describe()}")
        raise
    finally:
        cs.stop()


def generate_all(client, prompts, max_new_tokens=24):
    """Runs one greedy request per prompt at once; returns their Completions (or errors)."""
    results = [None] * len(prompts)

    def one(k):
        try:
            results[k] = client.generate_text(prompts[k], temperature=0,
                                              max_new_tokens=max_new_tokens, ignore_eos=True)
        except grpc.RpcError as e:
            results[k] = e

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=CALL_TIMEOUT_S)
    return results


def test_coordinator_restart_gets_every_worker_back(tmp_path):
    def body(cs):
        cs.add_worker()
        cs.add_worker()
        cs.wait_serving(0, 2)
        with cs.client(0) as c:
            unfailed = {p: c.generate_text(p, temperature=0, max_new_tokens=24,
                                           ignore_eos=True).token_ids for p in PROMPTS}
        seen_ids = {w.worker_id for w in cs.serving(0)}
        back_s = []
        completed = failed = 0
        for restart in range(3):
            cs.kill_coordinator(0)
            cs.start_coordinator(0)
            t0 = time.monotonic()
            cs.wait_serving(0, 2, timeout=30)
            back_s.append(time.monotonic() - t0)
            ids = {w.worker_id for w in cs.serving(0)}
            ports = {w.address.rsplit(":", 1)[1] for w in cs.serving(0)}
            assert len(ids) == 2 and len(ports) == 2, cs.serving(0)
            assert not ids & seen_ids, f"restart {restart} reused ids {ids & seen_ids}"
            seen_ids |= ids
            # Still both after a few more heartbeats: no stale entry kept fresh by another.
            time.sleep(3 * HEARTBEAT_MS / 1000)
            assert len(cs.serving(0)) == 2, cs.serving(0)
            with cs.client(0) as c:
                results = generate_all(c, PROMPTS)
            served_by = set()
            for p, r in zip(PROMPTS, results):
                assert isinstance(r, Completion), r
                assert r.token_ids == unfailed[p], p
                served_by.update(r.worker_ids)
                completed += 1
            assert served_by == ids, (served_by, ids)
        print(f"workers back after each coordinator restart: {[round(s, 2) for s in back_s]} s")
        assert max(back_s) < BACK_WITHIN_S, back_s
        faults(fault="coordinator SIGKILL + restart on the same port, 2 workers",
               restarts=3, back_within_s=round(max(back_s), 2), completed=completed,
               failed=failed, duplicated=0)
    run_test(tmp_path, 1, body)


def test_two_coordinators_serve_the_same_workers(tmp_path):
    def body(cs):
        cs.add_worker()
        cs.add_worker()
        cs.wait_serving(0, 2)
        cs.wait_serving(1, 2)
        a, b = cs.client(0), cs.client(1)
        try:
            ra = a.generate_text(PROMPTS[0], temperature=0, max_new_tokens=24, ignore_eos=True)
            rb = b.generate_text(PROMPTS[0], temperature=0, max_new_tokens=24, ignore_eos=True)
            assert ra.token_ids == rb.token_ids and len(ra.token_ids) == 24
            expected = {p: b.generate_text(p, temperature=0, max_new_tokens=48,
                                           ignore_eos=True).token_ids for p in PROMPTS}

            # Requests to B while A dies: none may be lost.
            results = [None] * len(PROMPTS)
            def send():
                results[:] = generate_all(b, PROMPTS, max_new_tokens=48)
            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(0.05)
            cs.kill_coordinator(0)
            sender.join(timeout=CALL_TIMEOUT_S)
            completed = sum(isinstance(r, Completion) and r.token_ids == expected[p]
                            for p, r in zip(PROMPTS, results))
            failed = len(PROMPTS) - completed
            faults(fault="one of two coordinators SIGKILLed while the other serves",
                   requests=len(PROMPTS), completed=completed, failed=failed, duplicated=0)
            assert failed == 0, results
            # B still serves both workers afterwards.
            assert len(cs.serving(1)) == 2
            after = generate_all(b, PROMPTS[:2])
            assert all(isinstance(r, Completion) and len(r.token_ids) == 24 for r in after)
        finally:
            a.close()
            b.close()
    run_test(tmp_path, 2, body)


def test_stream_through_a_killed_coordinator_fails_and_retries_on_the_other(tmp_path):
    def body(cs):
        cs.add_worker()
        cs.add_worker()
        cs.wait_serving(0, 2)
        cs.wait_serving(1, 2)
        clients = [cs.client(0), cs.client(1)]
        max_new = 200
        try:
            expected = clients[1].generate_text(PROMPTS[0], temperature=0,
                                                max_new_tokens=max_new, ignore_eos=True)
            n = 4
            done = [None] * n
            first_try_failed = [None] * n
            attempts = [0] * n
            killed = threading.Event()

            def one(k):
                # A client with a coordinator list: the first one, then the other on failure.
                for target in (0, 1):
                    attempts[k] += 1
                    got = Completion()
                    try:
                        for r in clients[target].generate(PROMPTS[0], temperature=0,
                                                          max_new_tokens=max_new,
                                                          ignore_eos=True, timeout=60):
                            got.add(r)
                            if target == 0 and k == 0 and len(got.token_ids) >= 10:
                                killed.set()
                        done[k] = got
                        return
                    except grpc.RpcError as e:
                        if target == 0:
                            first_try_failed[k] = e.code()
                        else:
                            done[k] = e

            threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            assert killed.wait(timeout=60), "no tokens streamed through coordinator A"
            cs.kill_coordinator(0)
            for t in threads:
                t.join(timeout=90)
            assert not any(t.is_alive() for t in threads), "a client hung"
            elapsed = time.monotonic() - t0
            completed = sum(isinstance(d, Completion) and d.token_ids == expected.token_ids
                            for d in done)
            failed = n - completed
            retried = sum(c is not None for c in first_try_failed)
            # A retry starts the request over; the client keeps one completion per request.
            duplicated = sum(isinstance(d, Completion) and len(d.token_ids) > max_new
                             for d in done)
            faults(fault="coordinator SIGKILLed mid-stream, client retries on the other",
                   requests=n, completed=completed, failed=failed, retried=retried,
                   duplicated=duplicated, seconds=round(elapsed, 1))
            assert first_try_failed[0] == grpc.StatusCode.UNAVAILABLE, first_try_failed
            assert all(c in (None, grpc.StatusCode.UNAVAILABLE) for c in first_try_failed), \
                first_try_failed
            assert completed == n and duplicated == 0, done
        finally:
            for c in clients:
                c.close()
    run_test(tmp_path, 2, body)


def test_two_coordinators_never_overfill_a_worker(tmp_path):
    slot = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "1", "--max-queue-depth", "0"]
    # Several KV blocks long, so that each coordinator's prefix affinity remembers its worker.
    prompt = " ".join(["And God said, Let there be light: and there was light."] * 3)

    def body(cs):
        w1 = cs.add_worker(slot)
        cs.wait_serving(0, 1)
        cs.wait_serving(1, 1)
        a, b = cs.client(0), cs.client(1)
        try:
            for c in (a, b):  # both have seen the prompt on w1
                assert len(c.generate_text(prompt, max_new_tokens=2, temperature=0).token_ids)
            long = a.generate(prompt, max_new_tokens=400, temperature=0, ignore_eos=True)
            first = next(long)  # w1's one slot is taken through A
            # B's own count says w1 is free; w1 says it is full.
            t0 = time.monotonic()
            e = rpc_error(lambda: b.generate_text(prompt, max_new_tokens=4, temperature=0,
                                                  timeout=30))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
            assert "queue is full" in e.details(), e.details()
            assert time.monotonic() - t0 < 10
            # With a second worker, B's request tries w1 (its affinity), is refused there and
            # runs on w2.
            w2 = cs.add_worker(slot)
            cs.wait_serving(1, 2)
            done = b.generate_text(prompt, max_new_tokens=4, temperature=0, timeout=30)
            assert len(done.token_ids) == 4
            w2_id = [w.worker_id for w in cs.serving(1) if w.address == w2.address]
            assert done.worker_ids == w2_id, (done.worker_ids, w2_id)
            rest = collect(long)
            assert len(first.token_ids) + len(rest.token_ids) == 400
            assert rest.finish_reason == "length"
        finally:
            a.close()
            b.close()
    run_test(tmp_path, 2, body)
