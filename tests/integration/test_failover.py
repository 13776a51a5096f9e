"""A worker killed (SIGKILL) in the middle of a stream: the coordinator resumes the sequence on
the other worker and the client's stream goes on with no token lost or repeated. A worker that
stops heartbeating is taken out, and registers again when it comes back."""

import signal
import time

from .conftest import wait_until
from kvgrid_client import Completion, pb

PROMPT = "In the beginning"
MAX_NEW_TOKENS = 200
KILL_AFTER_TOKENS = 20
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"]


def test_worker_killed_mid_stream(cluster):
    c = cluster(workers=2, worker_args=WORKER_ARGS,
                coordinator_args=["--heartbeat-timeout-ms", "2000"])
    client = c.client
    params = dict(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    unfailed = client.generate_text(PROMPT, **params)
    assert unfailed.finish_reason == "length" and len(unfailed.token_ids) == MAX_NEW_TOKENS

    # The kill must land while the victim is still generating. On a loaded machine the whole
    # sequence can be done before the client reads its 20th token; then the victim is replaced
    # by a fresh worker and the scenario runs again.
    for attempt in range(3):
        # Looked up before the stream starts, so the kill follows the 20th token at once.
        procs = {w.worker_id: c.worker_proc(w.worker_id) for w in c.serving_workers()}
        assert len(procs) == 2, c.status()
        done = Completion()
        victim = victim_id = None
        tokens_at_kill = 0
        for r in client.generate(PROMPT, **params):
            done.add(r)
            if victim is None and len(done.token_ids) >= KILL_AFTER_TOKENS:
                assert r.worker_id, f"response without worker_id: {r}"
                victim_id = r.worker_id
                assert victim_id in procs, (victim_id, list(procs))
                victim = procs[victim_id]
                victim.popen.kill()  # kill -9
                victim.popen.wait(timeout=10)
                tokens_at_kill = len(done.token_ids)
        assert victim is not None, f"stream ended before {KILL_AFTER_TOKENS} tokens: {done}"
        print(f"attempt {attempt}: killed {victim_id} (pid {victim.pid}) after reading "
              f"{tokens_at_kill} tokens; tokens served by {done.worker_ids}")
        if done.worker_ids != [victim_id]:
            break
        # Too late: the victim had finished the sequence. Replace it and try again.
        c.add_worker(WORKER_ARGS)
        c.wait_serving(2)
    else:
        raise AssertionError(
            "3 times, every token carried the killed worker's id (the kill came after it had "
            f"generated all of them, or worker_id is not updated on failover); last: "
            f"{tokens_at_kill} tokens read at the kill, {len(done.token_ids)} in all, "
            f"finish {done.finish_reason!r}, workers {done.worker_ids}")

    assert done.worker_ids[0] == victim_id, done.worker_ids
    assert len(done.worker_ids) == 2 and done.worker_ids[1] != victim_id, done.worker_ids
    # No gap, no repeat: exactly the unfailed sequence.
    assert len(done.token_ids) == MAX_NEW_TOKENS, (len(done.token_ids), done.token_ids)
    assert done.token_ids == unfailed.token_ids
    assert done.text == unfailed.text
    assert done.finish_reason == "length"
    # Usage is the client's view of the whole request, not of the resumed part.
    assert done.usage.prompt_tokens == unfailed.usage.prompt_tokens, done.usage
    assert done.usage.completion_tokens == MAX_NEW_TOKENS, done.usage

    # The dead worker is no longer SERVING; the survivor serves new requests.
    def victim_gone():
        return all(w.state != pb.WORKER_STATE_SERVING
                   for w in c.status().workers if w.worker_id == victim_id)

    assert wait_until(victim_gone, timeout=15, interval=0.2), c.status()
    again = client.generate_text(PROMPT, temperature=0, max_new_tokens=16)
    assert again.token_ids == unfailed.token_ids[:16]
    assert again.worker_ids and again.worker_ids[0] != victim_id


def test_a_worker_that_stops_heartbeating_is_taken_out(cluster):
    """Missed heartbeats take a worker out of placement (and health), and a worker that
    comes back registers again."""
    c = cluster(workers=2, coordinator_args=["--heartbeat-interval-ms", "100",
                                             "--heartbeat-timeout-ms", "600"])
    frozen = c.workers[0]
    frozen.popen.send_signal(signal.SIGSTOP)  # alive, but silent
    try:
        assert wait_until(lambda: len(c.serving_workers()) == 1, timeout=10), c.status()
        lost = [w for w in c.status().workers if w.state == pb.WORKER_STATE_LOST]
        assert len(lost) == 1 and lost[0].address.endswith(f":{frozen.port}"), c.status()
        # Requests go to the live one meanwhile.
        done = c.client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
        assert done.finish_reason == "length"
        assert done.worker_ids == [w.worker_id for w in c.serving_workers()]
    finally:
        frozen.popen.send_signal(signal.SIGCONT)
    assert wait_until(lambda: len(c.serving_workers()) == 2, timeout=10), c.status()


def test_worker_frozen_mid_stream(cluster):
    """A worker that freezes (SIGSTOP: its TCP connections stay up, nothing answers) in the
    middle of a stream: the coordinator's keep-alive pings break the connection, and the
    stream goes on on the other worker, no token lost or repeated, long before the call's own
    deadline could end the wait."""
    c = cluster(workers=2, worker_args=WORKER_ARGS,
                coordinator_args=["--heartbeat-interval-ms", "100",
                                  "--heartbeat-timeout-ms", "600"])
    client = c.client
    params = dict(temperature=0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    unfailed = client.generate_text(PROMPT, **params)
    assert len(unfailed.token_ids) == MAX_NEW_TOKENS

    for attempt in range(3):
        procs = {w.worker_id: c.worker_proc(w.worker_id) for w in c.serving_workers()}
        assert len(procs) == 2, c.status()
        done = Completion()
        frozen = frozen_id = None
        frozen_at = 0.0
        try:
            for r in client.generate(PROMPT, timeout=120, **params):
                done.add(r)
                if frozen is None and len(done.token_ids) >= KILL_AFTER_TOKENS:
                    frozen_id = r.worker_id
                    frozen = procs[frozen_id]
                    frozen.popen.send_signal(signal.SIGSTOP)
                    frozen_at = time.monotonic()
            resumed_after = time.monotonic() - frozen_at
        finally:
            if frozen is not None:
                frozen.popen.send_signal(signal.SIGCONT)
        assert frozen is not None, f"stream ended before {KILL_AFTER_TOKENS} tokens: {done}"
        print(f"attempt {attempt}: froze {frozen_id}; tokens served by {done.worker_ids}")
        if done.worker_ids != [frozen_id]:
            break
        # Too late: the frozen worker had already sent the whole sequence. Let it come back.
        assert wait_until(lambda: len(c.serving_workers()) == 2, timeout=15), c.status()
    else:
        raise AssertionError(f"3 times the stream was done before the freeze: {done.worker_ids}")

    assert done.worker_ids[0] == frozen_id and done.worker_ids[-1] != frozen_id, done.worker_ids
    # Keep-alive pings every 0.6 s, 5 s to answer: the failover comes in seconds.
    assert resumed_after < 30, resumed_after
    assert done.token_ids == unfailed.token_ids
    assert done.finish_reason == "length"
