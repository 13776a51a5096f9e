"""SIGTERM on the coordinator drains it: health turns NOT_SERVING (or the port closes), new
requests are refused, the stream already running finishes, and the process exits 0 within
its drain timeout."""

import signal
import threading
import time

import grpc

from .conftest import health_check, rpc_error, wait_until
from kvgrid_client import Client, Completion
from grpc_health.v1 import health_pb2

DRAIN_TIMEOUT_S = 20
LONG_NEW_TOKENS = 450


def test_sigterm_drains_coordinator(cluster):
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"],
                coordinator_args=["--drain-timeout-s", DRAIN_TIMEOUT_S])
    prompt_ids = c.client.tokenize("In the beginning")
    # A second connection, established now, to watch health during the drain.
    watcher = Client(c.addr, timeout=5)
    try:
        assert health_check(watcher.channel) == health_pb2.HealthCheckResponse.SERVING

        done = Completion()
        first_token = threading.Event()
        errors = []

        def read():
            try:
                for r in c.client.generate(prompt_token_ids=prompt_ids, temperature=0,
                                           max_new_tokens=LONG_NEW_TOKENS, ignore_eos=True):
                    done.add(r)
                    first_token.set()
            except grpc.RpcError as e:
                errors.append(e)
            finally:
                first_token.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first_token.wait(timeout=60)
        c.coordinator.popen.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        tokens_at_sigterm = len(done.token_ids)
        assert 0 < tokens_at_sigterm < LONG_NEW_TOKENS, (tokens_at_sigterm, errors)

        # Health flips (or the coordinator is already gone).
        seen = []

        def health_flipped():
            try:
                status = health_check(watcher.channel, timeout=2)
            except grpc.RpcError as e:
                seen.append(e.code())
                return e.code() == grpc.StatusCode.UNAVAILABLE
            seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            return status == health_pb2.HealthCheckResponse.NOT_SERVING

        deadline = time.monotonic() + 5
        while not health_flipped():
            assert time.monotonic() < deadline, f"health after SIGTERM: {seen}"
            time.sleep(0.01)

        print(f"health after SIGTERM ({tokens_at_sigterm} tokens read): {seen}")

        # New work is refused.
        e = rpc_error(lambda: list(watcher.generate("And the LORD said", max_new_tokens=4,
                                                    seed=1)))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())

        reader.join(timeout=60)
        assert not reader.is_alive()
        assert not errors, [(x.code(), x.details()) for x in errors]
        assert done.finish_reason == "length", done
        assert len(done.token_ids) == LONG_NEW_TOKENS

        rc = c.coordinator.popen.wait(timeout=DRAIN_TIMEOUT_S + 5)
        elapsed = time.monotonic() - sent
        assert rc == 0, f"coordinator exit status {rc}\n{c.coordinator.describe()}"
        assert elapsed <= DRAIN_TIMEOUT_S + 2, elapsed
    finally:
        watcher.close()


def test_drain_timeout_cancels_what_is_left_and_exits(cluster):
    """Streams still running when the drain timeout passes end with an error (none hangs),
    their worker requests are cancelled, and the coordinator exits 0 at once."""
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "1"],
                coordinator_args=["--drain-timeout-s", "0.5", "--max-queue-depth", "64"])
    prompt_ids = c.client.tokenize("In the beginning")
    streams = 24
    started = threading.Barrier(streams + 1)
    outcomes = []

    def read():
        done = Completion()
        try:
            stream = c.client.generate(prompt_token_ids=prompt_ids, temperature=0,
                                       max_new_tokens=500, ignore_eos=True, timeout=60)
            started.wait(timeout=30)
            for r in stream:
                done.add(r)
            outcomes.append(("ok", len(done.token_ids)))
        except grpc.RpcError as e:
            outcomes.append((e.code(), len(done.token_ids)))

    # 24 requests of 500 tokens on one sequence slot: 12000 decode steps in a row (seconds,
    # at a fraction of a millisecond each), far more than the half second the drain allows
    # plus the second the server's shutdown gives open calls.
    readers = [threading.Thread(target=read) for _ in range(streams)]
    for t in readers:
        t.start()
    started.wait(timeout=30)
    # Every call placed before the drain starts (later ones would just be refused).
    assert wait_until(lambda: c.status().in_flight == streams, timeout=30), c.status()
    c.coordinator.popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    for t in readers:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in readers), outcomes
    rc = c.coordinator.popen.wait(timeout=15)
    assert rc == 0, f"coordinator exit status {rc}\n{c.coordinator.describe()}"
    assert time.monotonic() - sent < 10
    assert len(outcomes) == streams, outcomes
    errors = [code for code, _ in outcomes if code != "ok"]
    assert errors, f"every stream finished inside the drain timeout: {outcomes}"
    assert set(errors) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, outcomes
    assert "worker streams still open" not in c.coordinator.log(), c.coordinator.log_tail()
