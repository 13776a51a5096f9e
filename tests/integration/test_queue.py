"""Admission limits: with no queueing allowed and one sequence slot, a second request is
refused with RESOURCE_EXHAUSTED while the first runs, and accepted again once it is done."""

import grpc

from .conftest import collect, rpc_error, wait_until

LONG_NEW_TOKENS = 450


def test_full_queue_is_resource_exhausted(cluster):
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "1"],
                coordinator_args=["--max-queue-depth", "0"])
    client = c.client
    prompt_ids = client.tokenize("In the beginning")
    long = client.generate(prompt_token_ids=prompt_ids, temperature=0,
                           max_new_tokens=LONG_NEW_TOKENS, ignore_eos=True)
    first = next(long)  # the long request is running on the only slot
    assert first.token_ids and not first.finish_reason, first

    e = rpc_error(lambda: list(client.generate("And the LORD said", max_new_tokens=4,
                                               seed=1, timeout=30)))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())

    # The refusal did not disturb the running stream.
    rest = collect(long)
    assert rest.finish_reason == "length"
    assert len(first.token_ids) + len(rest.token_ids) == LONG_NEW_TOKENS

    # With the slot free again, a request is accepted. (Right at the end of a stream see
    # test_sequential_client_is_never_refused.)
    def slot_free():
        s = c.status()
        return s.in_flight == 0 and s.workers[0].in_flight == 0

    assert wait_until(slot_free, timeout=10), c.status()
    done = client.generate_text("And the LORD said", max_new_tokens=4, seed=1, timeout=30)
    assert done.finish_reason and done.token_ids


def test_sequential_client_is_never_refused(cluster):
    # One slot, no queue: a client that waits for each stream to end before sending the next
    # request always finds the slot free.
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "1"],
                coordinator_args=["--max-queue-depth", "0"])
    refused = []
    for i in range(100):
        try:
            done = c.client.generate_text("And the LORD said", max_new_tokens=4, seed=i,
                                          timeout=30)
            assert done.finish_reason, done
        except grpc.RpcError as e:
            refused.append((i, e.code(), e.details()))
    assert not refused, f"{len(refused)} of 100 sequential requests refused, first: {refused[0]}"
