"""Request ids: a client's ids are its own to choose, so two calls that carry the same id at
once both run (the coordinator gives each attempt its own worker-side id), and an abort by id
on a worker ends that request's stream (ABORTED) instead of leaving it open."""

import threading
import time

import grpc

from kvgrid.v1 import worker_pb2, worker_pb2_grpc

from .conftest import wait_until

PROMPT = "In the beginning"
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"]


def test_concurrent_calls_with_the_same_request_id_both_finish(cluster):
    c = cluster(workers=1, worker_args=WORKER_ARGS)
    params = dict(temperature=0, max_new_tokens=120, ignore_eos=True)
    alone = c.client.generate_text(PROMPT, **params)
    assert len(alone.token_ids) == 120

    results, errors = [None, None], []
    start = threading.Barrier(2)

    def run(i):
        try:
            start.wait(timeout=30)
            results[i] = c.client.generate_text(PROMPT, request_id="same-id", **params)
        except grpc.RpcError as e:
            errors.append((i, e.code(), e.details()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for done in results:
        assert done is not None
        assert done.request_id == "same-id"  # echoed as the client sent it
        assert done.token_ids == alone.token_ids
    # A retry with the id of a call cancelled a moment ago is a new request too.
    first = c.client.generate(PROMPT, request_id="retried", **params)
    next(first)
    first.cancel()
    again = c.client.generate_text(PROMPT, request_id="retried", **params)
    assert again.token_ids == alone.token_ids


def test_worker_abort_ends_the_stream_and_frees_its_blocks(cluster):
    c = cluster(workers=1, worker_args=WORKER_ARGS)
    worker_addr = c.serving_workers()[0].address
    prompt_ids = c.client.tokenize(PROMPT)
    with grpc.insecure_channel(worker_addr) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        # The request runs to the model's 512-token context, a fraction of a second on an idle
        # machine: should it finish before the abort lands, it runs again.
        for attempt in range(3):
            request_id = f"direct-{attempt}"
            req = worker_pb2.WorkerGenerateRequest(request_id=request_id,
                                                   prompt_token_ids=prompt_ids)
            req.sampling.temperature = 0
            req.stopping.max_new_tokens = 100000
            req.stopping.ignore_eos = True
            stream = stub.Generate(req, timeout=60)
            assert next(stream).token_ids
            stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=10)
            started = time.monotonic()
            try:
                for r in stream:
                    pass
                print(f"attempt {attempt}: finished before the abort")
                continue
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.ABORTED, (e.code(), e.details())
            # Ended by the abort, not by the call's 60 s deadline.
            assert time.monotonic() - started < 30
            break
        else:
            raise AssertionError("3 times the request finished before its abort arrived")
        assert wait_until(lambda: stub.GetStats(worker_pb2.GetStatsRequest(),
                                                timeout=10).usage.blocks_used == 0,
                          timeout=10)
        # Aborting an unknown or finished id is fine.
        stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=10)
        stub.Abort(worker_pb2.AbortRequest(request_id="never-was"), timeout=10)
    done = c.client.generate_text(PROMPT, temperature=0, max_new_tokens=4)
    assert done.finish_reason == "length"
