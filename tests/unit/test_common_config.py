"""Config files validate on load and errors name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from aegaeon_common.config import (
    ConfigError,
    config_from_dict,
    load_config,
    parse_bytes,
    read_config_file,
)
from cli_support import index_market

A = "models: [{name: a, path: x}]\n"  # a config naming one model


def test_sizes_with_units() -> None:
    assert parse_bytes("64MiB") == 64 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(512) == 512
    for bad in ("lots", -1, True, "5 parsecs"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_market_supplies_the_registry_and_addresses_are_derived(tmp_path: Path) -> None:
    market = index_market(tmp_path / "market")
    path = tmp_path / "c.yaml"
    path.write_text(
        "market: market\n"
        "run_dir: " + str(tmp_path / "run") + "\n"
        "decode: {instances: 2, device_memory: 600MiB, kv_memory: 256MiB}\n"
        "slo: {ttft: 2, tbt_s: 0.05}\n"
    )
    config = load_config(path)
    assert config.model_names == ("a", "b")
    assert config.model("a") is not None and config.model("a").path == market / "a"  # type: ignore[union-attr]
    assert config.decode.instances == 2 and config.decode.kv_memory_bytes == 256 << 20
    assert config.slo.ttft_s == 2.0 and config.slo.tbt_s == 0.05
    assert config.decode_address(1) == f"ipc://{tmp_path / 'run' / 'decode-1.sock'}"
    assert config.shm_prefix.startswith("aegaeon-")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (A + "decode: {device_memory: lots}\n", "decode.device_memory"),
        ("modelz: []\n", "modelz"),
        (A + "scheduler: {policy: magic}\n", "scheduler.policy"),
        (A + "scheduler: {token_hold: 2}\n", "scheduler.token_hold"),
        (A + "proxy: {port: eighty}\n", "proxy.port"),
        ("models: [{name: a, path: x}, {name: a, path: y}]\n", "models"),
        ("models: [{path: x}]\n", "models[0].name"),
        (A + "decode: {device_memory: 1MiB, kv_memory: 2MiB}\n", "decode.kv_memory"),
        (A + "dtype: float64\n", "dtype"),
        (A + "decode: {weights: mmap}\n", "decode.weights"),
        (A + "prefill: {device: cuda, weights: map}\n", "prefill.weights"),
        (A + "proxy: {admission_max_wait: 0}\n", "proxy.admission_max_wait"),
        (A + "decode: {threads: 0}\n", "decode.threads"),
        (A + "slo_classes: {batch: {ttft: 0}}\n", "slo_classes.batch.ttft"),
        (A + "store: {heartbeat_ttl: 0.5}\n", "store.heartbeat_ttl"),
        (A + "model_settings: {a: {max_concurrency: 0}}\n", "model_settings.a.max_concurrency"),
        (A + "baseline: {load_gb_s: 0}\n", "baseline.load_gb_s"),
        (A + "baseline: {init_s: -1}\n", "baseline.init_s"),
        (A + "baseline: {load: 16}\n", "baseline.load"),
        (A + "scheduler: {policy: request-level-free}\n", "scheduler.policy"),
        ("market: nowhere\n", "market"),
        (A + "instance: {tp: 0}\n", "instance.tp"),
        (A + "instance: {device_memory: lots}\n", "instance.device_memory"),
        (A + "instance: {device_memory: 1MiB, kv_memory: 2MiB}\n", "instance.kv_memory"),
        (A + "instance: {instances: 2}\n", "instance.instances"),
        (A + "instance: {tpp: 2}\n", "instance.tpp"),
        (A + "instance: [1]\n", "instance"),
        (A + "instance: {tp: 2}\nprefill: {tp: 1}\n", "decode.tp"),
        (": : :\n", "line 1, column 1"),  # a YAML error: where, as editors count
    ],
)
def test_errors_name_file_and_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.field == field
    assert str(path) in str(err.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "absent.yaml")
    assert err.value.field == "<file>"


def test_defaults() -> None:
    config = config_from_dict({"models": [{"name": "a", "path": "x"}]})
    assert config.scheduler.policy == "aegaeon"
    assert config.scheduler.max_group_size == 8
    assert config.scheduler.q_max_s == 4.0
    assert config.scheduler.token_hold == 1.0
    assert config.slo.ttft_s == 10.0 and config.slo.tbt_s == 0.1
    assert config.decode.weights == "auto" and config.decode.maps_weights  # CPU: in place


def test_baselines_are_served_policies() -> None:
    """Every baseline runs unified instances; the charged one's load path is its own
    section (defaults: the paper's artifact, 16 GB/s, no engine start-up)."""
    for policy in ("request-level", "request-level-charged", "static-mux"):
        config = config_from_dict({"models": [{"name": "a", "path": "x"}],
                                   "scheduler": {"policy": policy}})  # fmt: skip
        assert config.unified and not config.hybrid_prefill
    assert (config.baseline.load_gb_s, config.baseline.init_s) == (16.0, 0.0)
    config = config_from_dict({"models": [{"name": "a", "path": "x"}],
                               "baseline": {"load_gb_s": 2.5, "init_s": 26.9}})  # fmt: skip
    assert (config.baseline.load_gb_s, config.baseline.init_s) == (2.5, 26.9)
    assert config.to_dict()["baseline"] == {"load_gb_s": 2.5, "init_s": 26.9}


def test_weights_auto_copies_on_a_gpu() -> None:
    config = config_from_dict(
        {"models": [{"name": "a", "path": "x"}], "decode": {"device": "cuda:0"},
         "prefill": {"weights": "copy"}}
    )  # fmt: skip
    assert not config.decode.maps_weights and not config.prefill.maps_weights


def test_the_adapter_region_is_there_when_adapters_are_served() -> None:
    """A copied device's LoRA region (taken from its weights arena): 1/16 of its device
    memory when the deployment serves adapters, none when it serves none (its arena
    whole), its own ``adapter_memory`` when given (run-time loads into such a one)."""
    models = [{"name": "a", "path": "/m/a"}]
    lora = [*models, {"name": "t", "path": "/m/t", "base": "a"}]
    sizes = {"device_memory": "1GiB", "kv_memory": "256MiB"}
    assert config_from_dict({"models": models, "decode": sizes}).decode.adapter_region_bytes == 0
    served = config_from_dict({"models": lora, "decode": sizes})
    assert served.decode.adapter_region_bytes == (1 << 30) // 16
    given = config_from_dict({"models": models, "decode": {**sizes, "adapter_memory": "8MiB"}})
    assert given.decode.adapter_region_bytes == 8 << 20
    with pytest.raises(ConfigError, match=r"decode\.adapter_memory"):
        config_from_dict({"models": lora, "decode": {**sizes, "adapter_memory": "800MiB",
                                                     "weights": "copy"}})


def test_the_docker_example_config_validates(tmp_path: Path) -> None:
    import yaml

    example = Path(__file__).parents[2] / "docker" / "config.example.yaml"
    raw = yaml.safe_load(example.read_text())
    raw["market"] = str(index_market(tmp_path / "market"))
    config = config_from_dict(raw, source=str(example))
    assert config.scheduler.policy == "aegaeon"
    assert config.model_names == ("a", "b")


def test_side_http_ports_and_drain_timeout() -> None:
    models = [{"name": "a", "path": "x"}]
    config = config_from_dict({"models": models})
    assert (config.cache.http_host, config.cache.http_port) == ("127.0.0.1", 0)
    assert config.decode.http_port_of(3) == 0  # ephemeral by default
    assert config.drain_timeout_s == 30.0
    config = config_from_dict({
        "models": models, "drain_timeout": 5,
        "cachemgr": {"http_host": "0.0.0.0", "http_port": 9100},
        "prefill": {"http_port": 9200}, "decode": {"http_port": 9300, "http_host": "0.0.0.0"},
    })  # fmt: skip
    assert (config.cache.http_host, config.cache.http_port) == ("0.0.0.0", 9100)
    assert config.prefill.http_port_of(1) == 9201 and config.decode.http_port_of(2) == 9302
    assert config.drain_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"decode\.http_port"):
        config_from_dict({"models": models, "decode": {"http_port": 70000}})
    with pytest.raises(ConfigError, match="drain_timeout"):
        config_from_dict({"models": models, "drain_timeout": -1})


def test_a_bad_choice_names_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"models": [{"name": "a", "path": "x"}], "store": {"kind": "etcd"}})
    assert err.value.field == "store.kind"
    assert "'etcd'" in err.value.problem and "memory, redis" in err.value.problem


def test_instance_section_applies_to_both_roles_and_a_role_overrides(tmp_path: Path) -> None:
    """``instance.KEY`` (the issues' ``instance.tp``, ``instance.device_memory_bytes``)
    sets both roles; ``prefill.*`` / ``decode.*`` win; a key written either way
    (``device_memory`` or ``device_memory_bytes``) is the same key."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "models: [{name: a, path: x}]\n"
        "instance: {tp: 2, device_memory_bytes: 2GiB, kv_memory: 512MiB, threads: 2}\n"
        "decode: {device_memory: 3GiB, instances: 2}\n"
    )
    config = load_config(path)
    assert (config.prefill.tp, config.decode.tp) == (2, 2)
    assert config.prefill.device_memory_bytes == 2 << 30
    assert config.decode.device_memory_bytes == 3 << 30
    assert config.prefill.kv_memory_bytes == config.decode.kv_memory_bytes == 512 << 20
    assert (config.prefill.threads, config.decode.threads) == (2, 2)
    assert (config.prefill.instances, config.decode.instances) == (1, 2)
    # the raw data every reader of the file gets already holds each role's values
    raw = read_config_file(path)
    assert "instance" not in raw
    assert raw["prefill"]["tp"] == 2 and raw["decode"]["device_memory"] == "3GiB"
    assert "device_memory_bytes" not in raw["decode"]
    assert config_from_dict(raw).prefill == config.prefill
    # without the section nothing changes
    plain_config = config_from_dict({"models": [{"name": "a", "path": "x"}]})
    assert plain_config.prefill.tp == 1
