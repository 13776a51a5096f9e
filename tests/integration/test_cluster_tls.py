"""TLS inside the cluster: the worker's port and the coordinator's worker port
(--worker-listen) with --worker-tls-cert/-key/-ca, mutual TLS both ways, the cluster token
refused over plaintext, registration on the public port refused without a cluster token when
API keys guard it, certificates replaced without a restart, and kvgrid serve private by
default."""

import os
import socket
import ssl
import subprocess
import time

import grpc
import pytest

from kvgrid_client import Client, pb
from kvgrid.v1 import worker_pb2, worker_pb2_grpc

from .conftest import MODEL_DIR, Proc, executable, free_port, rpc_error, wait_until

TOKEN = "tls-cluster-secret"
BEARER = (("authorization", f"Bearer {TOKEN}"),)


def _openssl(d, *args):
    subprocess.run(["openssl", *map(str, args)], check=True, cwd=d, capture_output=True)


def _ca(d, name):
    _openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.pem")


def _leaf(d, ca, name, out=None):
    """A certificate for 127.0.0.1 / localhost signed by `ca`, usable by servers and clients;
    written to <out>.pem / <out>.key."""
    out = out or name
    _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-subj", f"/CN={name}", "-keyout", f"{out}.key", "-out", f"{out}.csr")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(d, "x509", "-req", "-in", f"{out}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(int(time.time() * 1000)), "-days", "2", "-extfile", "ext.cnf",
             "-out", f"{out}.pem")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster-certs")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "ca", "coordinator")
    _leaf(d, "ca", "worker")
    _leaf(d, "ca", "client")
    _leaf(d, "other-ca", "rogue")
    return d


def tls_flags(certs, who, ca="ca"):
    return ["--worker-tls-cert", certs / f"{who}.pem", "--worker-tls-key", certs / f"{who}.key",
            "--worker-tls-ca", certs / f"{ca}.pem"]


def start_coordinator(tmp_path, certs, extra=(), name="coordinator"):
    port, worker_port = free_port(), free_port()
    proc = Proc(name, [executable("kvgrid-coordinator"), "--model", MODEL_DIR,
                       "--listen", f"127.0.0.1:{port}",
                       "--worker-listen", f"127.0.0.1:{worker_port}",
                       "--cluster-token", TOKEN, *tls_flags(certs, "coordinator"), *extra],
                tmp_path / f"{name}.log")
    proc.wait_listening()
    return proc, port, worker_port


def start_worker(tmp_path, worker_port, flags, name="worker", extra=()):
    proc = Proc(name, [executable("kvgrid-worker"), "--model", MODEL_DIR,
                       "--coordinator", f"127.0.0.1:{worker_port}", "--listen", "127.0.0.1:0",
                       "--kv-cache-memory", "16MiB", "--threads", "1", *flags, *extra],
                tmp_path / f"{name}.log")
    proc.wait_listening()
    return proc


def serving(client):
    try:
        return [w for w in client.cluster_status().workers
                if w.state == pb.WORKER_STATE_SERVING]
    except grpc.RpcError:
        return []


@pytest.fixture
def mtls_cluster(tmp_path, certs):
    procs = []
    coordinator, port, worker_port = start_coordinator(tmp_path, certs)
    procs.append(coordinator)
    health_port = free_port()
    worker = start_worker(tmp_path, worker_port,
                          ["--cluster-token", TOKEN, "--tls-refresh-s", "1",
                           "--health-listen", f"127.0.0.1:{health_port}",
                           *tls_flags(certs, "worker")])
    procs.append(worker)
    client = Client(f"127.0.0.1:{port}", timeout=60)
    assert wait_until(lambda: serving(client), timeout=60), (coordinator.describe() +
                                                             worker.describe())
    yield {"client": client, "coordinator": coordinator, "worker": worker,
           "worker_port": worker_port, "worker_addr": worker.address, "tmp": tmp_path,
           "worker_health_port": health_port}
    client.close()
    for p in reversed(procs):
        p.stop()


def worker_stats(addr, creds, metadata=BEARER, server_name=None):
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (grpc.secure_channel(addr, creds, options=options) if creds
               else grpc.insecure_channel(addr))
    with channel:
        return worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(),
                                                            timeout=5, metadata=metadata)


def creds(certs, ca="ca", who=None):
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / f"{ca}.pem").read_bytes(),
        private_key=(certs / f"{who}.key").read_bytes() if who else None,
        certificate_chain=(certs / f"{who}.pem").read_bytes() if who else None)


def test_generate_over_mutual_tls(mtls_cluster):
    c = mtls_cluster["client"].generate_text("In the beginning", max_new_tokens=8,
                                             temperature=0)
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    assert "(mTLS)" in mtls_cluster["coordinator"].log()


def test_worker_port_refuses_plaintext_wrong_ca_and_no_client_cert(mtls_cluster, certs):
    addr = mtls_cluster["worker_addr"]
    # The coordinator's certificate (any certificate of the cluster's CA) is let in.
    assert worker_stats(addr, creds(certs, who="coordinator")).capacity.blocks_total > 0
    for why, c in [("plaintext", None),
                   ("no client certificate", creds(certs)),
                   ("a client certificate of another CA", creds(certs, who="rogue")),
                   ("the worker verified against another CA", creds(certs, "other-ca",
                                                                    "coordinator"))]:
        e = rpc_error(lambda: worker_stats(addr, c))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (why, e.code(), e.details())


def test_a_tls_worker_answers_probes_on_its_plaintext_health_port(mtls_cluster):
    from grpc_health.v1 import health_pb2
    from .conftest import health_check, health_stub
    def serving(ch):
        try:
            return health_check(ch, "") == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:  # a loaded machine: the first connection may be slow
            return False
    with grpc.insecure_channel(f"127.0.0.1:{mtls_cluster['worker_health_port']}") as ch:
        assert wait_until(lambda: serving(ch), timeout=30), mtls_cluster["worker"].describe()
        # Draining shows there too. An idle worker drains and exits at once, so a poll could
        # miss the moment: a Watch opened before the signal hears the change when it happens.
        watch = health_stub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        seen = [next(watch).status]
        assert seen == [health_pb2.HealthCheckResponse.SERVING], seen
        mtls_cluster["worker"].popen.send_signal(2)  # SIGINT: drain
        try:
            for update in watch:
                seen.append(update.status)
                if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        except grpc.RpcError:  # the worker is gone once it has said so
            pass
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, (
            seen, mtls_cluster["worker"].describe())
        watch.cancel()


def test_coordinator_worker_port_refuses_workers_without_its_trust(mtls_cluster, certs):
    wp = f"127.0.0.1:{mtls_cluster['worker_port']}"
    reg = worker_pb2.RegisterWorkerRequest(address="127.0.0.1:1", model="kjv-tiny",
                                           vocab_size=4096)
    reg.capacity.block_size, reg.capacity.blocks_total = 16, 10

    def register(c):
        ch = grpc.secure_channel(wp, c) if c else grpc.insecure_channel(wp)
        with ch:
            return worker_pb2_grpc.CoordinatorStub(ch).RegisterWorker(reg, timeout=5,
                                                                      metadata=BEARER)

    for why, c in [("plaintext", None), ("no client certificate", creds(certs)),
                   ("another CA's client certificate", creds(certs, who="rogue"))]:
        e = rpc_error(lambda: register(c))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (why, e.code(), e.details())
    # A real worker with the wrong CA (it cannot verify the coordinator) never registers.
    rogue = start_worker(mtls_cluster["tmp"], mtls_cluster["worker_port"],
                         ["--cluster-token", TOKEN, *tls_flags(certs, "rogue", ca="other-ca")],
                         name="rogue")
    try:
        assert wait_until(lambda: "cannot register with" in rogue.log(), timeout=20), \
            rogue.describe()
        time.sleep(1)
        assert len(mtls_cluster["client"].cluster_status().workers) == 1
    finally:
        rogue.stop()


def test_cluster_token_over_plaintext_is_refused_at_startup(tmp_path, certs):
    port = free_port()
    cases = [
        ("worker", [executable("kvgrid-worker"), "--model", MODEL_DIR, "--listen",
                    "127.0.0.1:0", "--cluster-token", TOKEN]),
        ("worker-no-ca", [executable("kvgrid-worker"), "--model", MODEL_DIR, "--listen",
                          "127.0.0.1:0", "--coordinator", f"127.0.0.1:{port}",
                          "--cluster-token", TOKEN, "--worker-tls-cert", certs / "worker.pem",
                          "--worker-tls-key", certs / "worker.key"]),
        ("coordinator", [executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen",
                         f"127.0.0.1:{port}", "--worker-listen", f"127.0.0.1:{free_port()}",
                         "--cluster-token", TOKEN]),
        ("coordinator-public", [executable("kvgrid-coordinator"), "--model", MODEL_DIR,
                                "--listen", f"127.0.0.1:{port}", "--cluster-token", TOKEN,
                                *tls_flags(certs, "coordinator")]),
    ]
    for name, argv in cases:
        r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        assert "--cluster-token" in r.stderr and "plaintext" in r.stderr, (name, r.stderr)
        assert "--allow-insecure-cluster" in r.stderr, (name, r.stderr)
    # Asked for, it starts and says so.
    w = Proc("insecure-worker", [*cases[0][1], "--allow-insecure-cluster"],
             tmp_path / "insecure-worker.log")
    try:
        w.wait_listening()
        assert "WARNING: the cluster token crosses" in w.log()
    finally:
        w.stop()


def test_registration_on_the_public_port_needs_a_token_with_api_keys(tmp_path):
    port = free_port()
    base = [executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen",
            f"127.0.0.1:{port}", "--api-keys", "k1"]
    r = subprocess.run([str(a) for a in base], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "--insecure-open-registration" in r.stderr and "--cluster-token" in r.stderr
    # Asked for explicitly: it starts, warns, and registration is open (what was asked).
    c = Proc("open", [*base, "--insecure-open-registration"], tmp_path / "open.log")
    try:
        c.wait_listening()
        assert "WARNING: workers register on the API port without a cluster token" in c.log()
    finally:
        c.stop()
    # With a token (here over plaintext, allowed), a rogue registration is refused.
    c = Proc("token", [*base, "--cluster-token", TOKEN, "--allow-insecure-cluster"],
             tmp_path / "token.log")
    try:
        c.wait_listening()
        reg = worker_pb2.RegisterWorkerRequest(address="127.0.0.1:1", model="kjv-tiny",
                                               vocab_size=4096)
        reg.capacity.block_size, reg.capacity.blocks_total = 16, 10
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb2_grpc.CoordinatorStub(ch)
            e = rpc_error(lambda: stub.RegisterWorker(reg, timeout=5))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
            e = rpc_error(lambda: stub.RegisterWorker(
                reg, timeout=5, metadata=(("authorization", "Bearer k1"),)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, "an API key is no cluster token"
    finally:
        c.stop()


def peer_certificate(addr, certs):
    """The DER certificate the server at `addr` presents on a new TLS connection."""
    host, port = addr.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as s:
        with ctx.wrap_socket(s, server_hostname=host) as t:
            return t.getpeercert(binary_form=True)


def der(path):
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_certificate_rotation_without_restart(mtls_cluster, certs, tmp_path):
    # The worker reads its certificate from files it re-reads every second (--tls-refresh-s).
    addr = mtls_cluster["worker_addr"]
    assert peer_certificate(addr, certs) == der(certs / "worker.pem")
    pid = mtls_cluster["worker"].pid
    # A new certificate (another subject and serial, same CA) replaces the files in place.
    d = certs
    _leaf(d, "ca", "worker-rotated", out="rotated")
    os.replace(d / "worker.key", d / "worker-old.key")
    os.replace(d / "worker.pem", d / "worker-old.pem")
    try:
        (d / "worker.key").write_bytes((d / "rotated.key").read_bytes())
        (d / "worker.pem").write_bytes((d / "rotated.pem").read_bytes())
        def presents_rotated():
            try:
                return peer_certificate(addr, certs) == der(d / "rotated.pem")
            except (OSError, ssl.SSLError):
                return False  # between the two writes the pair may not match yet

        assert wait_until(presents_rotated, timeout=15), \
            "the worker still presents its old certificate"
        assert mtls_cluster["worker"].pid == pid and mtls_cluster["worker"].alive()
        # And the cluster still works through it: the coordinator's new connections accept it.
        c = mtls_cluster["client"].generate_text("In the beginning", max_new_tokens=4,
                                                 temperature=0)
        assert len(c.token_ids) == 4
    finally:
        os.replace(d / "worker-old.key", d / "worker.key")
        os.replace(d / "worker-old.pem", d / "worker.pem")


def test_kvgrid_serve_is_private_by_default(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    serve = Proc("serve", [executable("kvgrid"), "serve", "--model", MODEL_DIR, "--port", port,
                           "--http-port", "0", "--kv-cache-memory", "16MiB"], log)
    try:
        client = Client(f"127.0.0.1:{port}", timeout=60)
        assert wait_until(lambda: serving(client), timeout=120), serve.describe()
        assert wait_until(lambda: "kvgrid serve: ready" in serve.log(), timeout=30), \
            serve.describe()
        worker_addr = serving(client)[0].address
        e = rpc_error(lambda: worker_stats(worker_addr, None, metadata=None))
        assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
        c = client.generate_text("In the beginning", max_new_tokens=6, temperature=0)
        assert c.finish_reason == "length" and len(c.token_ids) == 6
        client.close()
    finally:
        serve.stop()
    # The throwaway certificates are gone with it.
    m = [line for line in serve.log().splitlines() if "certificates in " in line]
    assert m, serve.log_tail()
    assert not os.path.exists(m[0].rsplit("certificates in ", 1)[1].split()[0].rstrip(")"))


def test_a_tensor_parallel_group_forms_and_serves_over_mutual_tls(tmp_path, certs):
    # The ranks' rendezvous (the coordinator's store) goes over the worker port's mTLS too.
    coordinator, port, worker_port = start_coordinator(tmp_path, certs)
    ranks = []
    try:
        for rank in range(2):
            ranks.append(Proc(f"rank{rank}", [
                executable("kvgrid-worker"), "--model", MODEL_DIR,
                "--coordinator", f"127.0.0.1:{worker_port}", "--listen", "127.0.0.1:0",
                "--group", "tls-tp", "--tensor-parallel-size", 2, "--rank", rank,
                "--threads", "1", "--kv-cache-memory", "16MiB", "--cluster-token", TOKEN,
                *tls_flags(certs, "worker")], tmp_path / f"rank{rank}.log"))
        ranks[0].wait_listening(timeout=90)
        with Client(f"127.0.0.1:{port}", timeout=60) as client:
            assert wait_until(lambda: serving(client), timeout=60), (
                coordinator.describe() + ranks[0].describe() + ranks[1].describe())
            assert "following" in ranks[1].log()
            c = client.generate_text("In the beginning", max_new_tokens=8, temperature=0)
            assert len(c.token_ids) == 8
    finally:
        for p in reversed(ranks):
            p.stop()
        coordinator.stop()


def test_kvgrid_serve_passes_tls_keys_health_and_metrics_through(tmp_path, certs):
    r = subprocess.run([str(executable("kvgrid")), "serve", "--model", str(MODEL_DIR),
                        "--tls-cert", str(certs / "coordinator.pem"),
                        "--tls-key", str(certs / "coordinator.key"),
                        "--tls-ca", str(certs / "ca.pem")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--tls-ca" in r.stderr, (r.returncode, r.stderr)
    port, health_port, metrics_port = free_port(), free_port(), free_port()
    serve = Proc("serve-tls", [
        executable("kvgrid"), "serve", "--model", MODEL_DIR, "--port", port, "--http-port", "0",
        "--kv-cache-memory", "16MiB", "--tls-cert", certs / "coordinator.pem",
        "--tls-key", certs / "coordinator.key", "--api-keys", "serve-key",
        "--health-listen", f"127.0.0.1:{health_port}",
        "--metrics-listen", f"127.0.0.1:{metrics_port}"], tmp_path / "serve-tls.log")
    try:
        assert wait_until(lambda: "kvgrid serve: ready" in serve.log() or not serve.alive(),
                          timeout=120), serve.describe()
        assert serve.alive(), serve.describe()
        base = [str(executable("kvgrid")), "generate", "--addr", f"127.0.0.1:{port}",
                "--tls-ca", str(certs / "ca.pem"), "--prompt", "In the beginning",
                "--max-new-tokens", "4", "--temperature", "0"]
        ok = subprocess.run([*base, "--api-key", "serve-key"], capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
        bad = subprocess.run([*base, "--api-key", "wrong"], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode != 0 and "key is not valid" in bad.stderr, bad.stderr
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            from .conftest import health_check
            from grpc_health.v1 import health_pb2
            assert health_check(ch, "") == health_pb2.HealthCheckResponse.SERVING
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=10) as r:
            assert b"kvgrid:" in r.read()
    finally:
        serve.stop()


@pytest.mark.parametrize("server_name, works", [("localhost", True), ("nobody.example", False)])
def test_the_coordinator_checks_the_name_in_workers_certificates(tmp_path, certs, server_name,
                                                                 works):
    # --worker-tls-server-name replaces the host dialled (127.0.0.1) as the name a worker's
    # certificate must carry: one its certificate names works, another fails every call.
    coordinator, port, worker_port = start_coordinator(
        tmp_path, certs, extra=["--worker-tls-server-name", server_name,
                                "--max-failovers", "0"])
    worker = start_worker(tmp_path, worker_port, ["--cluster-token", TOKEN,
                                                  *tls_flags(certs, "worker")])
    try:
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            assert wait_until(lambda: serving(client), timeout=60), worker.describe()
            if works:
                c = client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
                assert len(c.token_ids) == 4
            else:
                e = rpc_error(lambda: client.generate_text("In the beginning", max_new_tokens=4))
                assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
    finally:
        worker.stop()
        coordinator.stop()
