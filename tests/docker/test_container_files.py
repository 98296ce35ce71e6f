"""The container files without Docker: compose.yaml's shape, the entrypoint's choices
(instance index, GPU, effective config), and the monitoring files against the code's
metric names and the services' ports. Fast; in the default run."""

from __future__ import annotations

import importlib.util
import json
import os
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
            waits = {f"cachemgr{suffix}": {"condition": "service_healthy"}}
            if suffix == "":  # the gpu stack's plan first (AEGAEON_GPUS)
                waits["plan"] = {"condition": "service_completed_successfully"}
            assert svc["depends_on"] == waits
        assert services["proxy" + suffix]["depends_on"] == {
            f"{k}{suffix}": {"condition": "service_healthy"} for k in ep.WORKERS}
    every_gpu = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    for name in (*ep.WORKERS, "plan", "mps"):  # they see every GPU, numbered alike
        assert services[name]["deploy"]["resources"]["reservations"]["devices"] == every_gpu
    for kind in ep.WORKERS:
        assert "deploy" not in services[kind + "-cpu"]
    # the cachemgr has no GPU: it opens the host mirrors of the workers' CUDA events
    assert "deploy" not in services["cachemgr"]
    assert services["cachemgr"]["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    assert services["cachemgr"]["depends_on"] == {
        "plan": {"condition": "service_completed_successfully"}}
    # MPS: a daemon in the cachemgr's IPC namespace, its pipes in the run volume
    mps = services["mps"]
    assert mps["command"] == ["mps"] and mps["ipc"] == "service:cachemgr"
    assert "run:/run/aegaeon" in mps["volumes"] and mps["restart"] == "no"
    assert services["plan"]["command"] == ["plan"] and services["plan"]["restart"] == "no"


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
    assert ep.gpu_for("prefill", 3, 2, {"AEGAEON_KIND_GPUS": "4, 5"}, 8) == ["5"]
    assert ep.gpu_for("prefill", 1, 2, {}, 4) == ["1"]
    assert ep.gpu_for("decode", 0, 2, {}, 4) == ["2"]
    assert ep.gpu_for("decode", 0, 1, {}, 1) == ["0"]  # one GPU: everyone shares it
    assert ep.gpu_for("decode", 0, 1, {}, 0) is None
    assert ep.gpu_for("decode", 0, 1, {}, 8, tp=4) == ["4", "5", "6", "7"]  # a TP group
    # a kind's devices, the same list in each of its containers: cuda:<nvidia-smi number>
    assert ep.kind_devices("decode", 2, 1, {}, 4) == ["cuda:1", "cuda:2"]
    assert ep.kind_devices("prefill", 1, 1, {}, 8, tp=2) == ["cuda:0", "cuda:1"]
    assert ep.kind_devices("prefill", 1, 1, {}, 0) is None


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


def test_the_mounted_files_instance_section_reaches_each_role(tmp_path: Path) -> None:
    """A container reads each role's device and group from its section: ``instance``'s
    keys are folded in there (a role's own wins), ``AEGAEON_TP`` over both."""
    path = tmp_path / "config.yaml"
    path.write_text("market: m\ninstance: {device: cuda, tp: 2, device_memory: 20GiB}\n"
                    "decode: {instances: 2, device_memory: 30GiB}\n")  # fmt: skip
    raw = ep.load_raw({"AEGAEON_CONFIG": str(path)})
    assert "instance" not in raw and raw["market"] == str(tmp_path / "m")
    assert raw["prefill"] == {"device": "cuda", "tp": 2, "device_memory_bytes": 20 << 30}
    assert raw["decode"] == {"device": "cuda", "tp": 2, "instances": 2, "device_memory": "30GiB"}
    tp4 = ep.load_raw({"AEGAEON_CONFIG": str(path), "AEGAEON_TP": "4"})
    assert tp4["prefill"]["tp"] == tp4["decode"]["tp"] == 4
    path.write_text("instance: {instances: 2}\n")
    with pytest.raises(ValueError, match=r"instance\.instances"):  # ConfigError: one line
        ep.load_raw({"AEGAEON_CONFIG": str(path)})


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


def test_the_plan_service_plans_the_node_once_and_every_container_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aegaeon_cli import machine
    from aegaeon_market.presets import preset_config, preset_named
    from aegaeon_sched.placement import GpuInfo, HostInfo

    gib = 1 << 30
    probed: list[int] = []

    def gpus() -> list[GpuInfo]:
        probed.append(1)
        return [GpuInfo(0, "NVIDIA L40S", 48 * gib, 47 * gib)]

    monkeypatch.setattr(machine, "cuda_gpus", gpus)
    # the plan container's own /dev/shm is not the cachemgr's: AEGAEON_SHM_SIZE is
    monkeypatch.setattr(machine, "host_info", lambda: HostInfo(256 * gib, 64 << 20))
    (tmp_path / "m").mkdir()
    config = preset_config(preset_named("llama-3.1-8b"), "bfloat16")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    raw = yaml.safe_load((ROOT / "docker/config.compose.yaml").read_text())
    raw["models"] = [{"name": "m", "path": str(tmp_path / "m")}]
    del raw["market"]
    file = tmp_path / "config.yaml"
    file.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"AEGAEON_GPUS": "all", "AEGAEON_PREFILL_INSTANCES": "1",
           "AEGAEON_DECODE_INSTANCES": "1", "AEGAEON_CONFIG": str(file),
           "AEGAEON_RUN_DIR": str(run_dir), "AEGAEON_SHM_SIZE": "40g"}  # fmt: skip
    assert ep.plan_node(env) == 0
    assert len(probed) == 1
    # every container reads that one plan: the worker's devices and sizes, the cachemgr's
    decode = ep.effective_config(ep.load_raw(env), "decode", 0, 9300, env)
    prefill = ep.effective_config(ep.load_raw(env), "prefill", 0, 9200, env)
    cachemgr = ep.effective_config(ep.load_raw(env), "cachemgr", 0, 9100, env)
    assert len(probed) == 1  # nobody else asked the GPUs
    assert decode["decode"]["devices"] == prefill["prefill"]["devices"] == ["cuda:0"]
    assert decode["decode"]["http_port"] == 9300
    # one 48 GB card, split: both instances and its reserve fit in what it has
    used = decode["decode"]["device_memory"] + prefill["prefill"]["device_memory"]
    assert used + 4.8 * gib <= 47 * gib
    assert decode["decode"]["device_memory"] - decode["decode"]["kv_memory"] > 14 * gib
    # the Model Cache and the CPU KV cache within 90% of the cachemgr's 40 GiB /dev/shm
    caches = cachemgr["cachemgr"]["model_cache"] + cachemgr["cachemgr"]["kv_cache"]
    assert caches <= 0.9 * 40 * gib and cachemgr["cachemgr"]["http_port"] == 9100
    assert cachemgr["decode"]["device_memory"] == decode["decode"]["device_memory"]
    # AEGAEON_GPUS set empty: the file's sizes, and the plan of an earlier run removed
    plain = {**env, "AEGAEON_GPUS": ""}
    assert ep.plan_node(plain) == 0 and not ep.plan_path(env).exists()
    assert ep.load_raw(plain)["decode"]["device_memory"] == raw["decode"]["device_memory"]
    with pytest.raises(ep.SettingError, match="no plan at"):
        ep.load_raw(env)
    with pytest.raises(ep.SettingError, match="unset AEGAEON_PREFILL_GPUS"):
        ep.plan_node({**env, "AEGAEON_KIND_GPUS": "0"})
    with pytest.raises(ep.SettingError, match="AEGAEON_TP='x'"):
        ep.load_file({**env, "AEGAEON_TP": "x"})
    assert ep.load_file({**env, "AEGAEON_TP": "2"})["decode"]["tp"] == 2


def test_a_worker_uses_mps_when_the_daemon_is_up(tmp_path: Path) -> None:
    env = {"AEGAEON_RUN_DIR": str(tmp_path)}
    assert not ep.mps_env(dict(env), wait_s=0.0)  # no daemon: no MPS, no wait past the limit
    assert not ep.mps_env({**env, "AEGAEON_MPS": "0"}, wait_s=0.0)
    (tmp_path / "mps").mkdir()
    os.mkfifo(tmp_path / "mps" / "control")
    up = dict(env)
    assert ep.mps_env(up, wait_s=0.0)
    assert up["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps")
    assert not ep.mps_env({**env, "AEGAEON_MPS": "off"}, wait_s=0.0)


def test_the_health_check_ends_a_stalled_service_so_restart_replaces_it() -> None:
    import io
    import subprocess
    import urllib.error

    victim = subprocess.Popen(["sleep", "60"])
    try:
        body = {"status": "stalled", "pid": victim.pid, "reason": "no progress for 31 s"}
        stalled = urllib.error.HTTPError("http://x/health", 503, "Service Unavailable", {},  # type: ignore[arg-type]
                                         io.BytesIO(json.dumps(body).encode()))  # fmt: skip
        assert ep.end_if_stalled("http://x/health", stalled)
        assert victim.wait(timeout=10) == -9
        draining = urllib.error.HTTPError("http://x/health", 503, "Service Unavailable", {},  # type: ignore[arg-type]
                                          io.BytesIO(b'{"status": "ok"}'))  # fmt: skip
        assert not ep.end_if_stalled("http://x/health", draining)
    finally:
        victim.kill()
        victim.wait()


def test_docker_compose_renders_the_gpu_profile_with_the_planned_settings() -> None:
    """`docker-compose --profile gpu config` (Debian's 1.29, which scripts/test installs),
    with the settings `aegaeon plan` prints for a market."""
    import shutil
    import subprocess

    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed: `apt-get install docker-compose` (Debian's "
                    "1.29; scripts/test installs it when run as root)")
    env = {**os.environ, "AEGAEON_SHM_SIZE": "230g", "AEGAEON_START_PERIOD": "420s",
           "AEGAEON_TP": "4"}  # fmt: skip
    for key in ("COMPOSE_PROFILES", "AEGAEON_GPUS"):
        env.pop(key, None)
    done = subprocess.run(["docker-compose", "--profile", "gpu", "config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert {"plan", "cachemgr", "mps", "prefill", "decode", "proxy"} <= set(services)
    cachemgr = services["cachemgr"]
    assert cachemgr["shm_size"] == "230g" and cachemgr["environment"]["CUDA_VISIBLE_DEVICES"] == ""
    for name in ("cachemgr", "prefill", "decode", "proxy"):
        assert services[name]["healthcheck"]["start_period"] in ("7m", "7m0s", "420s")
    for kind in ep.WORKERS:
        svc = services[kind]
        assert svc["environment"]["AEGAEON_GPUS"] == "all"  # planned by default
        assert svc["environment"]["AEGAEON_TP"] == "4"
        assert svc["depends_on"]["plan"]["condition"] == "service_completed_successfully"
