"""`aegaeon serve --config FILE`: what the flags add to the file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from aegaeon_cli.serve import _effective_config
from aegaeon_common.config import ConfigError
from cli_support import index_market, serve_args


def test_market_flag_completes_a_config_without_models(tmp_path: Path) -> None:
    market = index_market(tmp_path / "market")
    path = tmp_path / "c.yaml"
    path.write_text("proxy: {admission_max_wait: 60}\n")
    config, raw, plan = _effective_config(serve_args(path, market=market, run_dir=tmp_path / "run"))
    assert config.model_names == ("a", "b") and plan is None
    assert config.proxy.admission_max_wait_s == 60.0 and raw["market"] == str(market.resolve())
    # without --market the file alone must name its models, and the error says where
    with pytest.raises(ConfigError, match=r"c\.yaml.*models"):
        _effective_config(serve_args(path))


def test_admin_key_arguments(tmp_path: Path) -> None:
    """``--admin-key KEY`` and ``--admin-key-file``: each line a whole key, an admin key."""
    from aegaeon_proxy.main import add_api_key_args, key_entries

    path = tmp_path / "admin-keys"
    path.write_text("# ops\nsk-admin-from:file\n")
    parser = argparse.ArgumentParser()
    add_api_key_args(parser)
    args = parser.parse_args(["--api-key", "sk-user-1234:a", "--admin-key", "sk-admin-1234",
                              "--admin-key-file", str(path)])  # fmt: skip
    assert key_entries(args) == [{"key": "sk-user-1234", "models": ["a"]},
                                 {"key": "sk-admin-1234", "admin": True},
                                 {"key": "sk-admin-from:file", "admin": True}]  # fmt: skip
    args = parser.parse_args(["--admin-key-file", str(tmp_path / "missing")])
    with pytest.raises(ConfigError) as info:
        key_entries(args)
    assert info.value.source.endswith("missing")


def test_every_replica_and_node_is_given_the_same_keys(tmp_path: Path) -> None:
    """``serve --nodes 2 --proxies 3 --api-key ... --admin-key ...``: each proxy replica's
    config holds the same key table (configuration, not the store's), admins marked."""
    from aegaeon_cli.cluster import cluster_children
    from aegaeon_common.config import load_config

    market = index_market(tmp_path / "market")
    path = tmp_path / "c.yaml"
    path.write_text("proxy: {admin_keys: [sk-admin-file-1]}\n")
    args = serve_args(path, market=market, run_dir=tmp_path / "run", api_key=["sk-tenant-1:a"],
                      admin_key=["sk-admin-flag-1"])  # fmt: skip
    config, raw, _ = _effective_config(args)
    want = [("sk-tenant-1", ("a",), False), ("sk-admin-flag-1", (), True),
            ("sk-admin-file-1", (), True)]  # fmt: skip
    assert [(k.key, k.models, k.admin) for k in config.proxy.keys] == want
    _, configs = cluster_children(raw, tmp_path, str(path), 2, 3, "redis://127.0.0.1:1/0")
    assert len(configs) == 3
    written = [load_config(tmp_path / "run" / f"proxy-{r}" / "config.yaml") for r in range(3)]
    for replica in [*configs, *written]:
        assert [(k.key, k.models, k.admin) for k in replica.proxy.keys] == want
