"""The Kubernetes manifests: every overlay rendered with `kubectl kustomize`, built-in kinds validated
offline against the Kubernetes API schemas (kubernetes-validate), the Ray and Prometheus Operator
custom resources checked against the fields their projects document, every command a container runs
executed by a real shell with recording stand-ins for `ray`, `splitserve` and `cp` (so KubeRay's
generated `ray start` line and our quoting are exercised), and each recorded command checked against
the real CLIs: our parser, `splitserve serve --help` and `ray start --help`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from tools import DEPLOY, ROOT, require

OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
K8S_VERSIONS = ["1.28.0", "latest"]      # gRPC probes are GA from 1.27
CONFIG_PATH = "/etc/splitserve/splitserve.yaml"
IMAGE_ROOT = "/opt/splitserve"           # WORKDIR of the Dockerfiles: the repository's layout inside the image

# KubeRay's RayCluster (ray.io/v1) fields, as documented by its CRD (KubeRay 1.1 - 1.5); `str` maps are
# map[string]string there. Only what a manifest here may use; a typo or an unknown field fails.
_STRMAP = {str: str}
_GROUP = {"rayStartParams": _STRMAP, "template": dict, "labels": _STRMAP, "resources": _STRMAP}
RAYCLUSTER_SPEC = {
    "rayVersion": str, "enableInTreeAutoscaling": bool, "suspend": bool, "headServiceAnnotations": _STRMAP,
    "autoscalerOptions": {"idleTimeoutSeconds": int, "upscalingMode": str, "env": list, "envFrom": list,
                          "image": str, "imagePullPolicy": str, "resources": dict, "securityContext": dict,
                          "version": str},
    "headGroupSpec": {**_GROUP, "serviceType": str, "enableIngress": bool, "headService": dict},
    "workerGroupSpecs": [{**_GROUP, "groupName": str, "replicas": int, "minReplicas": int, "maxReplicas": int,
                          "numOfHosts": int, "idleTimeoutSeconds": int, "suspend": bool}],
}
# Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1), the fields its API reference lists.
SERVICEMONITOR_SPEC = {
    "jobLabel": str, "selector": {"matchLabels": _STRMAP, "matchExpressions": list},
    "namespaceSelector": {"any": bool, "matchNames": [str]}, "targetLabels": [str], "podTargetLabels": [str],
    "endpoints": [{"port": str, "targetPort": int, "path": str, "scheme": str, "interval": str,
                   "scrapeTimeout": str, "honorLabels": bool, "relabelings": list, "metricRelabelings": list}],
}


def check_fields(value, spec, where: str) -> list[str]:
    if isinstance(spec, type):      # bool is an int to Python, not to Kubernetes
        ok = isinstance(value, bool) if spec is bool else isinstance(value, spec) and not isinstance(value, bool)
        return [] if ok else [f"{where}: expected {spec.__name__}, got {value!r}"]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [e for i, v in enumerate(value) for e in check_fields(v, spec[0], f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where}: expected a mapping"]
    if list(spec) == [str]:
        return [e for k, v in value.items() for e in check_fields(v, str, f"{where}.{k}")]
    errors = [f"{where}.{k}: not a documented field" for k in value if k not in spec]
    return errors + [e for k, v in value.items() if k in spec for e in check_fields(v, spec[k], f"{where}.{k}")]


@cache
def render(path: str) -> tuple[dict, ...]:
    kubectl = require("kubectl", "kubernetes-client")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def groups(rc: dict) -> dict[str, dict]:
    return {"head": rc["spec"]["headGroupSpec"], **{g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}}


def serve_config(docs) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "splitserve-config")["data"]["splitserve.yaml"])


@pytest.mark.parametrize("path", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_renders_and_validates(path):
    kv = pytest.importorskip("kubernetes_validate", reason="the deploy extra installs it")
    docs = render(path)
    errors = []
    for doc in docs:
        kind = doc["kind"]
        if kind == "RayCluster":
            errors += check_fields(doc["spec"], RAYCLUSTER_SPEC, "RayCluster.spec")
            # The pod templates are plain Kubernetes: validate each as a PodTemplate.
            for name, group in groups(doc).items():
                tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                        "template": group["template"]}
                for v in K8S_VERSIONS:
                    kv.validate(tmpl, kv.latest_version() if v == "latest" else v, strict=True)
        elif kind == "ServiceMonitor":
            errors += check_fields(doc["spec"], SERVICEMONITOR_SPEC, "ServiceMonitor.spec")
        else:
            for v in K8S_VERSIONS:
                kv.validate(doc, kv.latest_version() if v == "latest" else v, strict=True)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_topology_in_the_name_is_what_runs(overlay):
    m = re.fullmatch(r"(cpu|gpu)-(\d+)p(\d+)d(-planner)?", overlay)
    assert m, f"overlays are named by topology, like cpu-1p1d (or cpu-1p1d-planner, its start): {overlay}"
    device, n_prefill, n_decode, planned = m.group(1), int(m.group(2)), int(m.group(3)), bool(m.group(4))
    docs = render(f"overlays/{overlay}")
    rc, cfg = one(docs, "RayCluster"), serve_config(docs)
    g = groups(rc)
    assert set(g) == {"head", "prefill", "decode"}
    assert g["head"]["rayStartParams"].get("num-cpus") == "0", "no worker may land on the head"
    for role, n in (("prefill", n_prefill), ("decode", n_decode)):
        assert cfg[role] == n
        if planned:     # starts at n, may grow to what the planner's budget leaves the other role
            assert g[role]["minReplicas"] == g[role]["replicas"] == n == 1
            assert g[role]["maxReplicas"] == cfg["max_workers"] - 1
        else:
            assert g[role]["minReplicas"] == g[role]["replicas"] == g[role]["maxReplicas"] == n
        # One worker per pod: each pod advertises one unit of the resource each worker asks for.
        advertised = json.loads(g[role]["rayStartParams"]["resources"].strip("'"))
        assert cfg[f"{role}_resources"] == advertised == {role: 1}
        limits = g[role]["template"]["spec"]["containers"][0]["resources"]["limits"]
        if device == "gpu":
            assert limits.get("nvidia.com/gpu") == 1 and cfg["worker_gpus"] == 1 and cfg["device"] == "cuda"
        else:
            assert "nvidia.com/gpu" not in limits and cfg.get("device", "cpu") == "cpu"
    # Only a planned cluster's pods come and go: Ray's autoscaler follows the workers the planner asks for.
    assert rc["spec"].get("enableInTreeAutoscaling", False) is planned and (cfg.get("planner") == "sla") is planned
    assert rc["spec"]["rayVersion"] == re.search(r"ARG RAY_VERSION=(\S+)",
                                                 (DEPLOY / "docker" / "Dockerfile").read_text()).group(1)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_probes_and_volumes_line_up(overlay):
    docs = render(f"overlays/{overlay}")
    rc, cfg = one(docs, "RayCluster"), serve_config(docs)
    head = groups(rc)["head"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    assert ports["grpc"] == cfg["grpc_port"] and ports["metrics"] == cfg["metrics_port"] and cfg["host"] == "0.0.0.0"
    assert ports["http"] == cfg["http_port"]
    proto = (ROOT / "proto" / "splitserve" / "v1" / "inference.proto").read_text()
    package = re.search(r"^package (\S+);", proto, re.M).group(1)
    name = re.search(r"^service (\w+)", proto, re.M).group(1)
    service = f"{package}.{name}"       # what the router's health service reports SERVING for
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = head["containers"][0][probe]["grpc"]
        assert grpc["port"] == cfg["grpc_port"] and grpc.get("service", service) == service
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    monitor = one(docs, "ServiceMonitor")
    scraped = [s for s in docs if s["kind"] == "Service"
               and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert len(scraped) == 1
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in scraped[0]["spec"]["ports"]}
    assert scraped[0]["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "splitserve"   # the rules' job
    # The model directory the router and every worker load is on the `models` volume of each pod.
    assert Path(cfg["model"]).parent == Path("/models")
    for name, group in groups(rc).items():
        spec = group["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts.get("models") == "/models", name
        assert any(v["name"] == "models" for v in spec["volumes"]), name
    if overlay.startswith("gpu"):
        claims = {v["persistentVolumeClaim"]["claimName"] for v in head["volumes"] if "persistentVolumeClaim" in v}
        assert claims == {one(docs, "PersistentVolumeClaim")["metadata"]["name"]}


def test_every_ray_node_runs_with_token_authentication():
    """Ray's GCS, client and dashboard ports run code for whoever reaches them: every pod of the
    RayCluster starts Ray with token auth, the token from the operator's Secret (never in a file here)."""
    for overlay in OVERLAYS:
        cluster = one(render(f"overlays/{overlay}"), "RayCluster")["spec"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        if cluster.get("enableInTreeAutoscaling"):      # the autoscaler sidecar reaches the GCS too
            groups.append({"template": {"spec": {"containers": [{"name": "autoscaler",
                                                                  **cluster["autoscalerOptions"]}]}}})
        for group in groups:
            for c in group["template"]["spec"]["containers"]:
                env = {e["name"]: e for e in c.get("env", [])}
                assert env["RAY_AUTH_MODE"]["value"] == "token", (overlay, c["name"])
                assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "splitserve-ray-token"


def _kuberay_start_cmd(group: dict, head: bool) -> str:
    """What KubeRay puts in $KUBERAY_GEN_RAY_START_CMD: `ray start` plus the params, sorted, `true` as a bare flag."""
    params = {**group.get("rayStartParams", {}), "block": "true"}
    if not head:
        params["address"] = "splitserve-head-svc.splitserve.svc.cluster.local:6379"
    flags = " ".join(f"--{k}" if v.lower() == "true" else f"--{k}={v}" for k, v in sorted(params.items()))
    return f"ray start {'--head ' if head else ''}{flags}"


@pytest.fixture(scope="module")
def stub_bin(tmp_path_factory):
    stubs = tmp_path_factory.mktemp("stubs")
    for name in ("ray", "splitserve", "cp"):
        (stubs / name).write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                  "with open(os.environ['STUB_LOG'], 'a') as f:\n"
                                  "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n")
        (stubs / name).chmod(0o755)
    return stubs


def _run_container(container: dict, env: dict, stubs: Path, log: Path) -> list[list[str]]:
    log.write_text("")
    argv = container.get("command", []) + container.get("args", [])
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), **env,
           **{e["name"]: e.get("value", "from-a-secret") for e in container.get("env", [])}}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{container['name']}: {out.stderr}"
    return [json.loads(line) for line in log.read_text().splitlines()]


@cache
def _help(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout


def _check_splitserve(argv: list[str], cfg_text: str, tmp: Path) -> None:
    from cluster.launch import cli
    sub = argv[1]
    help_text = _help("splitserve", sub, "--help")
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", help_text), f"`splitserve {sub}` has no {flag}"
    cfg_file = tmp / "splitserve.yaml"
    cfg_file.write_text(cfg_text)
    args_list = [str(cfg_file) if a == CONFIG_PATH else a for a in argv[1:]]
    cli.load(args_list, check_machine=False)            # unknown config keys and bad values raise here, as in the pod


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_a_container_runs_exists(overlay, stub_bin, tmp_path):
    docs = render(f"overlays/{overlay}")
    rc = one(docs, "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    cfg_text = one(docs, "ConfigMap", "splitserve-config")["data"]["splitserve.yaml"]
    ray_help = _help("ray", "start", "--help")
    ran = {}
    for name, group in groups(rc).items():
        env = {"KUBERAY_GEN_RAY_START_CMD": _kuberay_start_cmd(group, head=name == "head")}
        spec = group["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            ran[name, c["name"]] = _run_container(c, env, stub_bin, tmp_path / "calls.log")
    for (group, container), calls in ran.items():
        for argv in calls:
            if argv[0] == "splitserve":
                _check_splitserve(argv, cfg_text, tmp_path)
            elif argv[:2] == ["ray", "start"]:
                for arg in argv[2:]:
                    flag, _, value = arg.partition("=")
                    assert re.search(rf"{re.escape(flag)}\b", ray_help), f"`ray start` has no {flag}"
                    if flag == "--resources":
                        assert isinstance(json.loads(value), dict), value     # the shell left valid JSON
            elif argv[0] == "cp":
                src = Path(argv[-2])
                assert src.is_relative_to(IMAGE_ROOT) and (ROOT / src.relative_to(IMAGE_ROOT)).is_dir(), src
            else:
                pytest.fail(f"{group}/{container} runs {argv}, which no check here knows")
    head = [a for a in ran["head", "ray-head"]]
    assert [a[:2] for a in head] == [["ray", "start"], ["splitserve", "serve"]], head
    assert "--head" in head[0] and "--block" not in head[0], "the head's ray start must return to run serve"
    assert head[1][1:] == ["serve", "--config", CONFIG_PATH, "--ray-address", "auto"]
    for role in ("prefill", "decode"):
        starts = ran[role, "ray-worker"]
        assert len(starts) == 1 and "--block" in starts[0] and "--head" not in starts[0]
    if overlay.startswith("cpu"):   # the built-in model is copied onto every pod's volume
        assert all(any(a[0] == "cp" for a in ran[g, "model"]) for g in ("head", "prefill", "decode"))


def test_overlays_use_forms_debian_kubectl_reads():
    """`bases` and `patchesJson6902`: Debian's kubectl (kustomize 2.0) reads no other; newer ones still do."""
    for overlay in OVERLAYS:
        k = yaml.safe_load((DEPLOY / "k8s" / "overlays" / overlay / "kustomization.yaml").read_text())
        assert "patches" not in k and "components" not in k, overlay
        assert k["bases"] == ["../../base"] and all(Path(r).suffix == ".yaml" for r in k.get("resources", [])), overlay
