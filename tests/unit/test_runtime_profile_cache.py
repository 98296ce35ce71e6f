"""A worker's start-up profile is measured once per key and reused after (profile_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from aegaeon_common.config import config_from_dict
from aegaeon_engine import ModelSpec
from aegaeon_runtime.profile_cache import cached_profile, profile_key
from aegaeon_sched import LatencyModel
from aegaeon_sched import ModelSpec as SchedSpec


def _worker(market: Path, names: list[str], threads: int = 1) -> Any:
    """The parts of a Worker the cache reads: config, kind, engine device/isa, specs, sizes."""
    config = config_from_dict({"market": str(market), "decode": {"threads": threads}},
                              source="<test>", base=market)  # fmt: skip
    specs = {n: ModelSpec.from_dir(market / n) for n in names}
    return SimpleNamespace(
        config=config, kind="decode",
        engine=SimpleNamespace(device=torch.device("cpu"), isa="avx2"),
        specs=specs, switcher=SimpleNamespace(nbytes=lambda name: 1000 + len(name), specs=specs),
        adapters=SimpleNamespace(specs={}),
    )  # fmt: skip


def _latency(worker: Any) -> LatencyModel:
    specs = [SchedSpec(n, s.hidden_size, s.intermediate_size, s.num_layers, 1000, 64)
             for n, s in worker.specs.items()]  # fmt: skip
    return LatencyModel(specs, pcie_bytes_per_s=7e9, switch_beta=1.25)


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("AEGAEON_PROFILE_CACHE", raising=False)
    return tmp_path


def test_measured_once_then_reused_with_a_warm_up(default_market: Path, cache_home: Path) -> None:
    names = json.loads((default_market / "market.json").read_text())["models"][:3]
    worker = _worker(default_market, [m["name"] for m in names])
    calls: list[str] = []

    def measure(w: Any) -> LatencyModel:
        calls.append("measure")
        return _latency(w)

    first = cached_profile(worker, measure, warm=lambda w: calls.append("warm"))
    second = cached_profile(worker, measure, warm=lambda w: calls.append("warm"))
    assert calls == ["measure", "warm"]
    assert second.to_dict() == first.to_dict()
    (kept,) = (cache_home / "aegaeon" / "profiles").glob("*.json")
    assert kept.stem == profile_key(worker)
    assert not list(kept.parent.glob("*.tmp"))  # written aside, then renamed


def test_another_machine_setting_or_model_set_measures_again(
    default_market: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [m["name"] for m in json.loads((default_market / "market.json").read_text())["models"]]
    base = _worker(default_market, names[:2])
    keys = {
        profile_key(base),
        profile_key(_worker(default_market, names[:2], threads=2)),
        profile_key(_worker(default_market, names[:3])),
    }
    other_isa = _worker(default_market, names[:2])
    other_isa.engine.isa = "avx512"
    keys.add(profile_key(other_isa))
    assert len(keys) == 4
    assert profile_key(_worker(default_market, names[:2])) == profile_key(base)

    monkeypatch.setenv("AEGAEON_PROFILE_CACHE", "0")
    calls: list[int] = []
    for _ in range(2):
        cached_profile(base, lambda w: calls.append(1) or _latency(w), warm=lambda w: None)
    assert len(calls) == 2  # off: measured every time, nothing kept
    assert not (cache_home / "aegaeon" / "profiles").exists()


def test_an_unreadable_kept_profile_is_measured_again(default_market: Path,
                                                      cache_home: Path) -> None:  # fmt: skip
    names = [m["name"] for m in json.loads((default_market / "market.json").read_text())["models"]]
    worker = _worker(default_market, names[:2])
    path = cache_home / "aegaeon" / "profiles" / f"{profile_key(worker)}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    calls: list[int] = []
    cached_profile(worker, lambda w: calls.append(1) or _latency(w), warm=lambda w: None)
    assert calls == [1]
    assert LatencyModel.from_dict(json.loads(path.read_text())).switch_beta == 1.25
