"""scripts/prometheus's scrape config for a node with keys (issue 45): the proxy's
/metrics needs an admin key, which Prometheus reads from a file of its own (0600)
beside the config, never from the config itself. The live scrape: tests/e2e/test_prometheus.py."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml
from aegaeon_bench.serve.prometheus import write_config

KEY = "sk-admin-prom-0123"


def _jobs(path: Path) -> dict[str, dict[str, object]]:
    return {j["job_name"]: j for j in yaml.safe_load(path.read_text())["scrape_configs"]}


def test_the_proxy_job_scrapes_with_the_key_from_its_own_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, "127.0.0.1:9999", api_key=KEY)
    assert KEY not in path.read_text()
    jobs = _jobs(path)
    auth = jobs["aegaeon-proxy"]["authorization"]
    assert isinstance(auth, dict) and auth["type"] == "Bearer"
    key_file = Path(str(auth["credentials_file"]))
    assert key_file.is_absolute() and key_file.read_text() == KEY
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # the node's other services have no keys: their jobs send none
    assert [n for n, j in jobs.items() if "authorization" in j] == ["aegaeon-proxy"]


def test_without_a_key_no_job_sends_one(tmp_path: Path) -> None:
    jobs = _jobs(write_config(tmp_path, "127.0.0.1:9999"))
    assert all("authorization" not in j for j in jobs.values())
    assert not (tmp_path / "proxy-key").exists()
