"""Many concurrent streams over two workers, some cancelled mid-stream: every other stream
finishes, and afterwards no KV block or in-flight request is left behind."""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from .conftest import collect, wait_until
from kvgrid_client import Completion, pb

PROMPTS = [
    "In the beginning",
    "And the LORD said unto Moses,",
    "Blessed are the meek: for they",
    "The LORD is my shepherd; I shall not want.",
    "And it came to pass, when",
    "Now the serpent was more subtil than",
    "For God so loved the world,",
    "Then said Jesus unto them,",
]
NUM_STREAMS = 32
MAX_NEW_TOKENS = 48
# Cancelled streams ask for many tokens, so they are surely still running when cancelled.
CANCELLED_MAX_NEW_TOKENS = 400


def test_concurrent_streams_with_cancellation(cluster):
    c = cluster(workers=2, worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"],
                coordinator_args=["--max-queue-depth", "64"])
    client = c.client
    start = threading.Barrier(NUM_STREAMS)

    def run(i):
        cancel = i % 4 == 3
        stream = client.generate(PROMPTS[i % len(PROMPTS)], temperature=0.9, seed=i,
                                 max_new_tokens=CANCELLED_MAX_NEW_TOKENS if cancel
                                 else MAX_NEW_TOKENS,
                                 ignore_eos=cancel)
        start.wait(timeout=60)
        if not cancel:
            return collect(stream)
        done = Completion()
        first = next(stream)
        done.add(first)
        assert first.token_ids, first
        assert first.finish_reason == pb.FINISH_REASON_UNSPECIFIED, (
            f"stream {i} finished in its first response; nothing to cancel: {first}")
        stream.cancel()
        try:
            for r in stream:
                done.add(r)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, (e.code(), e.details())
        assert not done.finish_reason, f"cancelled stream {i} finished: {done}"
        return done

    with ThreadPoolExecutor(max_workers=NUM_STREAMS) as pool:
        results = list(pool.map(run, range(NUM_STREAMS), timeout=240))

    workers_used = set()
    for i, done in enumerate(results):
        workers_used.update(done.worker_ids)
        if i % 4 == 3:
            continue
        assert done.finish_reason in ("stop", "length"), (i, done)
        assert 1 <= len(done.token_ids) <= MAX_NEW_TOKENS, (i, done)
        if done.finish_reason == "length":
            assert len(done.token_ids) == MAX_NEW_TOKENS, (i, done)
        assert done.usage.completion_tokens == len(done.token_ids), (i, done)
        assert done.usage.prompt_tokens == len(client.tokenize(PROMPTS[i % len(PROMPTS)]))
        assert len(done.worker_ids) == 1, (i, done.worker_ids)
    # 32 streams against two workers of 8 sequences each: placement uses both.
    assert len(workers_used) == 2, f"streams went to {workers_used} only"

    # Seeded sampling does not depend on the batch: stream 0 again, alone, gives the same.
    again = client.generate_text(PROMPTS[0], temperature=0.9, seed=0,
                                 max_new_tokens=MAX_NEW_TOKENS)
    assert again.token_ids == results[0].token_ids

    def idle():
        s = c.status()
        ok = (s.in_flight == 0 and len(s.workers) == 2 and
              all(w.in_flight == 0 and w.usage.blocks_used == 0 and
                  w.usage.num_running == 0 and w.usage.num_waiting == 0 for w in s.workers))
        return ok

    assert wait_until(idle, timeout=10, interval=0.2), (
        f"blocks or requests left behind 10 s after the streams ended:\n{c.status()}")
