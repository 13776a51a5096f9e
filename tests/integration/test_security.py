"""Security: TLS on the public port, API keys as bearer tokens (missing, wrong, right), the
cluster token between coordinator and workers (a worker refuses callers without it, the
coordinator refuses workers without it), the plaintext health port for probes, and
configuration through KVGRID_* environment variables as the manifests set it."""

import subprocess
import time

import grpc
import pytest

from kvgrid_client import Client, pb
from kvgrid.v1 import worker_pb2, worker_pb2_grpc

from .conftest import (MODEL_DIR, Proc, executable, free_port, health_check, rpc_error,
                       wait_until)

API_KEYS = ["key-one", "key-two"]
CLUSTER_TOKEN = "cluster-secret"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA and a server certificate for 127.0.0.1 / localhost, made with openssl."""
    d = tmp_path_factory.mktemp("certs")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, cwd=d, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvgrid-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem")
    return d


@pytest.fixture
def secure_cluster(tmp_path, certs):
    """A coordinator with TLS, API keys, a cluster token and a plaintext health port, and one
    worker configured only through environment variables."""
    port, health_port, worker_port = free_port(), free_port(), free_port()
    procs = []
    coordinator = Proc("coordinator", [
        executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen", f"127.0.0.1:{port}",
        "--tls-cert", certs / "server.pem", "--tls-key", certs / "server.key",
        "--health-listen", f"127.0.0.1:{health_port}",
        "--worker-listen", f"127.0.0.1:{worker_port}"],
        tmp_path / "coordinator.log",
        env={"KVGRID_API_KEYS": ",".join(API_KEYS), "KVGRID_CLUSTER_TOKEN": CLUSTER_TOKEN,
             # The cluster links are plaintext here (test_cluster_tls.py covers their TLS).
             "KVGRID_ALLOW_INSECURE_CLUSTER": "true"})
    procs.append(coordinator)
    coordinator.wait_listening()
    worker = Proc("worker", [executable("kvgrid-worker")], tmp_path / "worker.log",
                  env={"KVGRID_MODEL": str(MODEL_DIR),
                       "KVGRID_COORDINATOR": f"127.0.0.1:{worker_port}",
                       "KVGRID_LISTEN": "127.0.0.1:0",
                       "KVGRID_CLUSTER_TOKEN": CLUSTER_TOKEN,
                       "KVGRID_ALLOW_INSECURE_CLUSTER": "true",
                       "KVGRID_KV_CACHE_MEMORY": "16MiB"})
    procs.append(worker)
    worker.wait_listening()
    ca = (certs / "ca.pem").read_bytes()
    client = Client(f"127.0.0.1:{port}", timeout=60, root_certificates=ca, api_key=API_KEYS[1])

    def serving():
        try:
            return any(w.state == pb.WORKER_STATE_SERVING for w in client.cluster_status().workers)
        except grpc.RpcError:
            return False

    assert wait_until(serving, timeout=60), coordinator.describe() + worker.describe()
    yield {"port": port, "health_port": health_port, "worker_port": worker_port, "ca": ca,
           "client": client,
           "coordinator": coordinator, "worker": worker, "tmp": tmp_path}
    client.close()
    for p in reversed(procs):
        p.stop()


def test_api_keys_on_the_tls_port(secure_cluster):
    addr, ca = f"127.0.0.1:{secure_cluster['port']}", secure_cluster["ca"]
    ok = secure_cluster["client"].generate_text("In the beginning", max_new_tokens=8,
                                                temperature=0)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 8

    for key, why in [(None, "missing"), ("key-three", "not valid")]:
        with Client(addr, timeout=30, root_certificates=ca, api_key=key) as c:
            e = rpc_error(lambda: c.generate_text("In the beginning", max_new_tokens=4))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
            assert why in e.details()
            e = rpc_error(lambda: c.tokenize("In the beginning"))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            e = rpc_error(lambda: c.cluster_status())
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    # The first key works too.
    with Client(addr, timeout=30, root_certificates=ca, api_key=API_KEYS[0]) as c:
        assert c.tokenize("In the beginning")


def test_plaintext_is_refused_on_the_tls_port(secure_cluster):
    with Client(f"127.0.0.1:{secure_cluster['port']}", timeout=5, api_key=API_KEYS[0]) as c:
        e = rpc_error(lambda: c.list_models())
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())


def test_health_port_is_plaintext_and_needs_no_key(secure_cluster):
    with grpc.insecure_channel(f"127.0.0.1:{secure_cluster['health_port']}") as ch:
        from grpc_health.v1 import health_pb2
        assert health_check(ch, "") == health_pb2.HealthCheckResponse.SERVING
        assert health_check(ch, "kjv-tiny") == health_pb2.HealthCheckResponse.SERVING


def test_worker_port_refuses_callers_without_the_cluster_token(secure_cluster):
    status = secure_cluster["client"].cluster_status()
    worker_addr = [w.address for w in status.workers
                   if w.state == pb.WORKER_STATE_SERVING][0]
    with grpc.insecure_channel(worker_addr) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for metadata in [None, (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as e:
                stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            req = worker_pb2.WorkerGenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3])
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=10, metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stats = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10,
                              metadata=(("authorization", f"Bearer {CLUSTER_TOKEN}"),))
        assert stats.capacity.blocks_total > 0


def test_coordinator_refuses_workers_without_the_cluster_token(secure_cluster):
    # A process without the cluster token cannot register or heartbeat, so it never becomes
    # part of the cluster.
    with grpc.insecure_channel(f"127.0.0.1:{secure_cluster['worker_port']}") as ch:
        stub = worker_pb2_grpc.CoordinatorStub(ch)
        reg = worker_pb2.RegisterWorkerRequest(address="127.0.0.1:1", model="kjv-tiny",
                                               vocab_size=4096)
        reg.capacity.block_size, reg.capacity.blocks_total = 16, 10
        for metadata in [None, (("authorization", "Bearer wrong"),)]:
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterWorker(reg, timeout=10, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="w1"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    workers = secure_cluster["client"].cluster_status().workers
    assert [w.address for w in workers if w.address == "127.0.0.1:1"] == []
