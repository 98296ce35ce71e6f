"""The container files without Docker: compose.yaml's shape, the entrypoint's choices
(instance index, GPU, effective config), and the monitoring files against the code's
metric names and the services' ports. Fast; in the default run."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "docker" / "monitoring"
STACKS = {"gpu": "", "cpu": "-cpu"}  # profile -> service name suffix


def _entrypoint() -> ModuleType:
    path = ROOT / "docker" / "entrypoint.py"
    spec = importlib.util.spec_from_file_location("aegaeon_container", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ep = _entrypoint()


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


# ---- compose.yaml ------------------------------------------------------------------------
def test_each_stack_has_one_service_per_kind_in_its_own_profile(compose: dict) -> None:
    services = compose["services"]
    for profile, suffix in STACKS.items():
        for kind in ep.SERVICES:
            assert services[kind + suffix]["profiles"] == [profile]
    assert {s["profiles"][0] for s in services.values()} == {"gpu", "cpu", "monitoring"}
    env = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "gpu"  # plain `docker compose up`: the GPU node


def test_only_the_proxy_publishes_and_every_service_checks_its_health(compose: dict) -> None:
    services = compose["services"]
    for suffix in STACKS.values():
        for kind in ep.SERVICES:
            svc = services[kind + suffix]
            port = 8000 if kind == "proxy" else ep.DEFAULT_PORTS[kind]
            assert svc["healthcheck"]["test"] == [
                "CMD", "aegaeon-container", "health", f"http://127.0.0.1:{port}/health"]
            assert ("ports" in svc) == (kind == "proxy"), kind + suffix
            assert svc["restart"] == "unless-stopped"
            assert "init" not in svc  # the service is PID 1 (see docker/entrypoint.py)
        assert services["proxy" + suffix]["ports"] == ["${AEGAEON_API_PORT:-8000}:8000"]


def test_workers_share_the_cachemgr_memory_and_wait_for_it(compose: dict) -> None:
    services = compose["services"]
    for suffix in STACKS.values():
        cachemgr = services["cachemgr" + suffix]
        assert cachemgr["ipc"] == "shareable" and "shm_size" in cachemgr
        for kind in ep.WORKERS:
            svc = services[kind + suffix]
            assert svc["ipc"] == svc["pid"] == f"service:cachemgr{suffix}"
            assert svc["depends_on"] == {f"cachemgr{suffix}": {"condition": "service_healthy"}}
        assert services["proxy" + suffix]["depends_on"] == {
            f"{k}{suffix}": {"condition": "service_healthy"} for k in ep.WORKERS}
    for kind in ep.WORKERS:  # GPU workers reserve NVIDIA devices; CPU workers none
        devices = services[kind]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
        assert "deploy" not in services[kind + "-cpu"]


def test_the_gpu_config_validates(tmp_path: Path) -> None:
    from aegaeon_common.config import config_from_dict

    (tmp_path / "market.json").write_text(json.dumps({"models": [
        {"name": "m", "path": "m", "arch": "LlamaForCausalLM", "params": 1, "dtype": "bfloat16"}
    ]}))
    raw = yaml.safe_load((ROOT / "docker/config.compose.yaml").read_text())
    raw["market"] = str(tmp_path)
    config = config_from_dict(ep.effective_config(raw, "decode", 1, 9300, {}), source="compose")
    assert config.decode.device == "cuda" and config.decode.http_port_of(1) == 9300
    assert config.drain_timeout_s < 45  # compose's stop_grace_period


# ---- the entrypoint ------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "number"), [
    ("aegaeon-prefill-2", 2), ("aegaeon_prefill-cpu_1", 1), ("proj-decode-cpu-12.proj_default", 12),
    ("decode", None), ("prefill-x", None),
])  # fmt: skip
def test_replica_number_of_compose_names(name: str, number: int | None) -> None:
    assert ep.replica_number(name) == number


def test_instance_index_prefers_the_environment_then_the_replica() -> None:
    assert ep.instance_index({"AEGAEON_INDEX": "3"}, "p-decode-1") == 3
    assert ep.instance_index({}, "p-decode-2") == 1
    assert ep.instance_index({}, None) == 0


def test_gpu_for_round_robin_and_defaults() -> None:
    assert ep.gpu_for("prefill", 3, 2, {"AEGAEON_KIND_GPUS": "4, 5"}, 8) == "5"
    assert ep.gpu_for("prefill", 1, 2, {}, 4) == "1"
    assert ep.gpu_for("decode", 0, 2, {}, 4) == "2"
    assert ep.gpu_for("decode", 0, 1, {}, 1) == "0"  # one GPU: everyone shares it
    assert ep.gpu_for("decode", 0, 1, {}, 0) is None


def test_effective_config_binds_every_replica_on_the_same_port() -> None:
    raw = {"market": "/data/market", "prefill": {"instances": 1, "device": "cuda"}}
    env = {"AEGAEON_PREFILL_INSTANCES": "3", "AEGAEON_RUN_DIR": "/run/x"}
    out = ep.effective_config(raw, "prefill", 2, 9200, env)
    assert out["prefill"] == {"instances": 3, "device": "cuda", "http_host": "0.0.0.0",
                              "http_port": 9198}  # 9198 + index 2 = 9200
    assert out["run_dir"] == "/run/x" and out["proxy"]["host"] == "0.0.0.0"
    assert raw["prefill"] == {"instances": 1, "device": "cuda"}  # not changed in place
    cachemgr = ep.effective_config(raw, "cachemgr", 0, 9100, {})["cachemgr"]
    assert cachemgr == {"http_host": "0.0.0.0", "http_port": 9100}


def test_service_argv_maps_unified_policies_onto_decode_instances(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    raw = {"prefill": {"instances": 2}, "decode": {"instances": 1}}
    assert ep.service_argv("prefill", 1, raw, cfg)[1:] == ["prefill", "--config", str(cfg),
                                                         "--index", "1"]
    unified = {**raw, "scheduler": {"policy": "request-level"}}
    assert ep.service_argv("prefill", 1, unified, cfg)[-2:] == ["--index", "1"]
    assert ep.service_argv("decode", 0, unified, cfg)[1:2] == ["decode"]
    assert ep.service_argv("decode", 0, unified, cfg)[-2:] == ["--index", "2"]
    assert ep.service_argv("proxy", 0, raw, cfg)[1:] == ["proxy", "--config", str(cfg)]


def test_embedded_config_needs_a_market(tmp_path: Path) -> None:
    with pytest.raises(ep.SettingError, match="no market"):
        ep.load_raw({"AEGAEON_CONFIG": "embedded", "AEGAEON_MARKET": str(tmp_path)})


def test_dns_names_with_compression_pointers() -> None:
    header = bytes(12)
    question = b"\x012\x010\x0220\x03172\x07in-addr\x04arpa\x00" + b"\x00\x0c\x00\x01"
    answer = (b"\xc0\x0c" + b"\x00\x0c\x00\x01" + b"\x00\x00\x02\x58" + b"\x00\x1b"
              + b"\x0cproftest_a_1\x07default\x00")
    packet = header + question + answer
    assert ep._dns_name(packet, 12) == ("2.0.20.172.in-addr.arpa", 12 + len(question) - 4)
    name_at = 12 + len(question) + 12
    assert ep._dns_name(packet, 12 + len(question)) == ("2.0.20.172.in-addr.arpa",
                                                         12 + len(question) + 2)
    assert ep._dns_name(packet, name_at)[0] == "proftest_a_1.default"


# ---- monitoring -----------------------------------------------------------------------------
def _metric_names_in_code() -> set[str]:
    names: set[str] = set()
    for path in [*ROOT.glob("services/*/aegaeon_*/**/*.py"), *ROOT.glob("libs/*/aegaeon_*/*.py")]:
        names.update(re.findall(r"\"(aegaeon_[a-z0-9_]+)\"", path.read_text()))
    return names


def test_dashboard_queries_only_metrics_the_services_export() -> None:
    dashboard = json.loads((MONITORING / "grafana/dashboards/aegaeon.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(aegaeon_[a-z0-9_]+)", e)}
    assert len(used) >= 25
    known = _metric_names_in_code()
    # a counter `x` is exported as x_total; histograms as x_bucket, x_count, x_sum
    missing = {m for m in used if re.sub(r"_(total|bucket|count|sum)$", "", m) not in known}
    assert not missing, f"the dashboard queries metrics no service defines: {sorted(missing)}"
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml")
                                .read_text())["datasources"][0]
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}


def test_prometheus_scrapes_every_service_of_either_stack_on_its_port(compose: dict) -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    for kind in ep.SERVICES:
        sd = jobs[f"aegaeon-{kind}"]["dns_sd_configs"][0]
        assert sd["port"] == (8000 if kind == "proxy" else ep.DEFAULT_PORTS[kind])
        assert sorted(sd["names"]) == sorted(kind + s for s in STACKS.values())
        assert all(name in compose["services"] for name in sd["names"])


def test_the_proxy_and_prometheus_share_the_admin_key_file(compose: dict) -> None:
    """Issue 45: each proxy reads the key files compose mounts (the command line parses as
    `aegaeon proxy` does; unset, /dev/null: no keys), with every other mount of a service;
    Prometheus scrapes the proxies with the admin key file (an empty token without keys),
    and no other job or container gets it."""
    from aegaeon_cli.main import build_parser

    services = compose["services"]
    base = compose["x-service"]["volumes"]
    prometheus = services["prometheus"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    token_file = jobs["aegaeon-proxy"]["authorization"]["credentials_file"]
    admin_mount = f"${{AEGAEON_ADMIN_KEY_FILE:-/dev/null}}:{token_file}:ro"
    assert admin_mount in prometheus["volumes"]
    assert jobs["aegaeon-proxy"]["authorization"]["type"] == "Bearer"
    assert all("authorization" not in j for name, j in jobs.items() if name != "aegaeon-proxy")
    for suffix in STACKS.values():
        proxy = services["proxy" + suffix]
        argv = [*proxy["command"], "--config", "/tmp/aegaeon/config.yaml"]  # the entrypoint's
        args = build_parser(argv).parse_args(argv)
        mounts = {v.split(":")[-2]: v.split(":")[0] for v in proxy["volumes"] if ":" in v}
        assert mounts[str(args.api_key_file[0])] == "${AEGAEON_API_KEYS_FILE"
        assert mounts[str(args.admin_key_file[0])] == "${AEGAEON_ADMIN_KEY_FILE"
        assert [v for v in proxy["volumes"] if "KEY" not in v] == base  # nothing else differs
        for name, svc in services.items():
            if not name.startswith("proxy") and name != "prometheus":
                assert "KEY" not in json.dumps(svc.get("volumes", [])), name


def test_aegaeon_gpus_plans_a_worker_and_the_cachemgr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aegaeon_cli import machine
    from aegaeon_market.presets import preset_config, preset_named
    from aegaeon_sched.placement import GpuInfo, HostInfo

    gib = 1 << 30
    monkeypatch.setattr(machine, "cuda_gpus",
                        lambda: [GpuInfo(i, "H100", 80 * gib, 79 * gib) for i in range(2)])
    monkeypatch.setattr(machine, "host_info", lambda: HostInfo(256 * gib, 128 * gib))
    (tmp_path / "m").mkdir()
    config = preset_config(preset_named("llama-3.1-8b"), "bfloat16")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    raw = yaml.safe_load((ROOT / "docker/config.compose.yaml").read_text())
    raw["models"] = [{"name": "m", "path": str(tmp_path / "m")}]
    del raw["market"]
    env = {"AEGAEON_GPUS": "all", "AEGAEON_PREFILL_INSTANCES": "1",
           "AEGAEON_DECODE_INSTANCES": "1"}  # fmt: skip
    decode = ep.planned("decode", ep.effective_config(raw, "decode", 0, 9300, env), env)
    assert decode["decode"]["devices"] == ["cuda:1"] and decode["decode"]["http_port"] == 9300
    assert decode["decode"]["device_memory"] > 60 * gib
    assert decode["cachemgr"] == raw["cachemgr"]  # a worker leaves the host to the cachemgr
    cachemgr = ep.planned("cachemgr", ep.effective_config(raw, "cachemgr", 0, 9100, env), env)
    assert cachemgr["cachemgr"]["model_cache"] < 16 * gib < cachemgr["cachemgr"]["kv_cache"]
    assert cachemgr["cachemgr"]["http_port"] == 9100
    assert cachemgr["decode"]["device_memory"] == raw["decode"]["device_memory"]
    proxy = ep.effective_config(raw, "proxy", 0, 8000, env)
    assert ep.planned("proxy", proxy, env) is proxy
    assert ep.planned("decode", proxy, {}) is proxy  # unset: the file as it is
    with pytest.raises(ep.SettingError, match="unset AEGAEON_PREFILL_GPUS"):
        ep.planned("prefill", proxy, {**env, "AEGAEON_KIND_GPUS": "0"})
