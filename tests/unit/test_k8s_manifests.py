"""deploy/k8s renders (``kubectl kustomize``) and every object validates, offline.

Each rendered object is checked against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail), except the
ServiceMonitor: its schema is the Prometheus Operator's CRD, which that package
does not carry, so its shape is checked here by hand. The config in the
ConfigMap goes through Aegaeon's own loader, and the pods' wiring (shared
/dev/shm, probes, GPUs, the HPA's target) is checked as a reader would.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"


def _render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects (a copy of them each call: a test may change its copy)."""
    if shutil.which("kubectl") is None:
        pytest.skip("needs kubectl (kustomize) to render deploy/k8s")
    return copy.deepcopy(_rendered(overlay))


@functools.cache
def _rendered(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of the overlay, once per session."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)],
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(params=["gpu", "cpu"])
def overlay(request: pytest.FixtureRequest) -> str:
    """Each overlay of deploy/k8s in turn."""
    return str(request.param)


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)}"
    return found[0]


def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    import kubernetes_validate

    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 2 and "StatefulSet" in kinds
    assert {"HorizontalPodAutoscaler", "ConfigMap", "ServiceMonitor"} <= set(kinds)
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # the Prometheus Operator's CRD: checked below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    monitor = _one(docs, "ServiceMonitor", "aegaeon")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert ports == {"http", "cachemgr-http", "prefill-http", "decode-http"}
    services = [d for d in docs if d["kind"] == "Service"]
    named = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert ports <= named  # every endpoint names a Service port


def test_a_broken_object_fails_validation() -> None:
    import kubernetes_validate

    proxy = copy.deepcopy(_one(_render("cpu"), "Deployment", "aegaeon-proxy"))
    proxy["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(proxy, K8S_VERSION, strict=True)


def test_node_pods_share_host_memory_and_answer_probes(overlay: str) -> None:
    docs = _render(overlay)
    node = _one(docs, "StatefulSet", "aegaeon-node")["spec"]["template"]["spec"]
    shm = next(v for v in node["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    containers = {c["name"]: c for c in node["containers"]}
    assert set(containers) == {"cachemgr", "prefill", "decode"}
    for name, container in containers.items():
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/dev/shm"] == "shm" and mounts["/run/aegaeon"] == "run"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        wants_gpu = overlay == "gpu" and name != "cachemgr"
        assert (gpus == 1) if wants_gpu else gpus is None, (name, gpus)
    config_map = _one(docs, "ConfigMap", "aegaeon-config")["metadata"]["name"]
    assert any(v.get("configMap", {}).get("name") == config_map for v in node["volumes"])
    hpa = _one(docs, "HorizontalPodAutoscaler", "aegaeon-proxy")["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("Deployment", "aegaeon-proxy")


def test_redis_keeps_nothing_on_disk(overlay: str) -> None:
    """The store needs no persistence (docs/reliability.md, "The shared store"): its
    owners rebuild every record after a restart and the proxy replicas write the
    run-time changes back. So Redis runs without AOF or snapshots and without a volume."""
    redis = _one(_render(overlay), "Deployment", "aegaeon-redis")["spec"]["template"]["spec"]
    args = redis["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "no" and args[args.index("--save") + 1] == ""
    assert not redis.get("volumes") and not redis["containers"][0].get("volumeMounts")


def test_the_config_map_is_a_valid_deployment(overlay: str, default_market: Path,
                                              tmp_path: Path) -> None:  # fmt: skip
    """The pods' config as a container renders it (pod IP and name filled in)."""
    from aegaeon_common.config import config_from_dict

    text = _one(_render(overlay), "ConfigMap", "aegaeon-config")["data"]["aegaeon.yaml"]
    raw = yaml.safe_load(text.replace("__POD_IP__", "10.1.2.3").replace("__NODE_NAME__",
                                                                         "aegaeon-node-0"))
    key = tmp_path / "curve.key"
    key.write_text("secret")
    raw["market"] = str(default_market)  # /data/market is the pod's mount
    raw["security"]["curve_key_file"] = str(key)
    config = config_from_dict(raw, source=f"deploy/k8s/overlays/{overlay}")
    assert config.distributed and config.node.name == "aegaeon-node-0"
    assert config.prefill_address(0) == "tcp://10.1.2.3:5600"
    assert config.instance_bind_address("decode", 0) == "tcp://0.0.0.0:5601"
    assert config.prefill.device == ("cuda" if overlay == "gpu" else "cpu")


def test_gpu_pods_size_each_container_from_the_machine(overlay: str) -> None:
    """The gpu overlay sets AEGAEON_GPUS, and each node container then plans its own
    part (`aegaeon plan --only NAME`) before it starts; the cpu overlay keeps its sizes."""
    node = _one(_render(overlay), "StatefulSet", "aegaeon-node")["spec"]["template"]["spec"]
    for container in node["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get("AEGAEON_GPUS") == ("all" if overlay == "gpu" else None)
        script = container["args"][0]
        assert "aegaeon plan --config /run/aegaeon/" in script
        assert f"--only {container['name']} --write" in script
        subprocess.run(["sh", "-n", "-c", script], check=True, timeout=10)  # it parses
        if container["name"] == "cachemgr" and overlay == "gpu":
            # no GPU: it reads the host mirrors of the workers' CUDA events
            assert env["CUDA_VISIBLE_DEVICES"] == ""
        elif container["name"] != "cachemgr":
            # a stalled compute thread makes /health a 503: the kubelet restarts it
            probe = container["livenessProbe"]
            assert probe["httpGet"]["path"] == "/health" and probe["failureThreshold"] <= 3


def test_proxies_and_the_scraper_share_the_keys_secret(overlay: str, tmp_path: Path) -> None:
    """Every proxy replica reads its keys from the Secret aegaeon-api-keys (the command
    line parses as `aegaeon proxy` does, each file in the mount); the ServiceMonitor
    scrapes the proxies' /metrics with the admin key of that Secret; the probes stay on
    /health and /ready, which need no key (issue 45)."""
    import shlex

    from aegaeon_cli.main import build_parser

    docs = _render(overlay)
    pod = _one(docs, "Deployment", "aegaeon-proxy")["spec"]["template"]["spec"]
    secret = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName")
                  == "aegaeon-api-keys")  # fmt: skip
    (proxy,) = pod["containers"]
    mount = next(m for m in proxy["volumeMounts"] if m["name"] == secret["name"])
    script = " ".join(proxy["args"])
    argv = shlex.split(script.partition("exec aegaeon ")[2])
    args = build_parser(argv).parse_args(argv)
    files = [*args.api_key_file, *args.admin_key_file]
    assert args.admin_key_file and args.api_key_file and not args.api_key and not args.admin_key
    assert all(str(f.parent) == mount["mountPath"] for f in files), files
    admin_file = args.admin_key_file[0].name
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/health"
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/ready"
    monitor = _one(docs, "ServiceMonitor", "aegaeon")["spec"]["endpoints"]
    (http,) = [e for e in monitor if e["port"] == "http"]
    assert http["authorization"] == {
        "type": "Bearer", "credentials": {"name": "aegaeon-api-keys", "key": admin_file}}
    # the node pods' side ports are not the proxy: no key there
    assert all("authorization" not in e for e in monitor if e["port"] != "http")
