"""grpc.health.v1 Watch on the coordinator sends changes only: one SERVING while nothing
changes (the status is refreshed every 100 ms, which used to resend it each time), and the
drain's NOT_SERVING promptly after SIGTERM."""

import queue
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2

from .conftest import health_stub


def _watch(channel, service: str, out: queue.Queue) -> None:
    try:
        for response in health_stub(channel).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=30):
            out.put((time.monotonic(), response.status))
    except grpc.RpcError as e:
        out.put((time.monotonic(), e.code()))


def test_watch_sends_only_changes(cluster):
    c = cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"])
    channel = grpc.insecure_channel(c.addr)
    for service in ("", "kvgrid.v1.Generation"):
        seen = queue.Queue()
        threading.Thread(target=_watch, args=(channel, service, seen), daemon=True).start()
        time.sleep(2.0)
        messages = []
        while not seen.empty():
            messages.append(seen.get()[1])
        assert messages == [health_pb2.HealthCheckResponse.SERVING], (service, messages)

    # A change arrives promptly: SIGTERM drains, health turns NOT_SERVING first.
    seen = queue.Queue()
    threading.Thread(target=_watch, args=(channel, "", seen), daemon=True).start()
    assert seen.get(timeout=5)[1] == health_pb2.HealthCheckResponse.SERVING
    sent = time.monotonic()
    c.coordinator.popen.send_signal(signal.SIGTERM)
    at, status = seen.get(timeout=5)
    # NOT_SERVING, or the stream ends when the server is gone already.
    assert status != health_pb2.HealthCheckResponse.SERVING, status
    assert at - sent < 2.0, at - sent
    channel.close()
