"""Model lifecycle through `aegaeon serve`: a node serving part of a market takes a
model of the market folder at run time (``POST /v1/aegaeon/models``), serves it,
pins it, and removes it again (``DELETE``), leaving nothing behind; a removal
waits for the requests in flight. No restart at any point."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_support import call_json, metric_samples
from serve_harness import Served, is_sleeping, serve_config, serving, until

SETTLE_S = 60.0  # heartbeats and background loads settle within this (a busy CI machine)
LONG_TOKENS = 6000  # a request that decodes for seconds on any machine (the models take 8192)


def _call(served: Served, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return call_json(served.url, method, path, body)


def _until(what: str, check: Any, timeout_s: float = SETTLE_S) -> Any:
    return until(what, check, timeout_s)


@pytest.fixture(scope="module")
def partial(
    small_market: Path, market_names: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """`aegaeon serve` of the market's first two models only."""
    models = [{"name": n, "path": str(small_market / n)} for n in market_names[:2]]
    with serving(small_market, tmp_path_factory.mktemp("models") / "run",
                 config=serve_config(small_market, models=models)) as served:  # fmt: skip
        yield served


def _complete(served: Served, model: str, max_tokens: int = 4) -> tuple[int, Any]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return _call(served, "POST", "/v1/completions", body)


def _rows(served: Served) -> dict[str, dict[str, Any]]:
    status, body = _call(served, "GET", "/v1/aegaeon/models")
    assert status == 200, body
    return {row["name"]: row for row in body["data"]}


def _listed(served: Served) -> list[str]:
    return [m["id"] for m in _call(served, "GET", "/v1/models")[1]["data"]]


def _load_progress(served: Served) -> dict[str, float]:
    services = _call(served, "GET", "/v1/aegaeon/services")[1]["services"]
    url = next(s["metrics_url"] for s in services if s["name"] == "cachemgr")
    return {dict(labels)["model"]: value for (name, labels), value in metric_samples(url).items()
            if name == "aegaeon_model_load_progress_ratio"}  # fmt: skip


def _nothing_held(stats: dict[str, Any]) -> bool:
    return stats["open_requests"] == 0 and all(
        i["leases"] == 0 and i["open_sequences"] == 0 for i in stats["instances"]
    )


def test_hot_add_serve_pin_and_remove(partial: Served, market_names: list[str]) -> None:
    configured, extra = market_names[:2], market_names[2]
    assert _listed(partial) == configured
    assert set(_rows(partial)) == set(configured)
    assert _complete(partial, extra)[0] == 404

    # errors: not in the market, already served, a bad field
    status, body = _call(partial, "POST", "/v1/aegaeon/models", {"name": "no-such-model"})
    assert status == 404 and body["error"]["code"] == "model_not_in_market"
    assert _call(partial, "POST", "/v1/aegaeon/models", {"name": configured[0]})[0] == 409
    status, body = _call(partial, "POST", "/v1/aegaeon/models", {"name": extra, "pin": 1})
    assert status == 400 and body["error"]["param"] == "pin"

    # add: served at once, without a restart
    status, row = _call(partial, "POST", "/v1/aegaeon/models", {"name": extra})
    assert status == 201, row
    assert row["state"] == "serving" and row["source"] == "runtime" and row["pinned"] is False
    assert _listed(partial) == [*configured, extra]
    status, done = _complete(partial, extra)
    assert status == 200, done
    assert done["model"] == extra and done["usage"]["completion_tokens"] == 4
    assert _complete(partial, configured[0])[0] == 200  # the others still serve

    # pin: the cachemgr holds it as the operator's; its progress is a metric
    status, row = _call(partial, "PATCH", f"/v1/aegaeon/models/{extra}",
                        {"pinned": True, "max_concurrency": 8})  # fmt: skip
    assert status == 200, row
    assert row["pinned"] is True and row["max_concurrency"] == 8
    _until("the pinned model is resident", lambda: _rows(partial)[extra]["load_progress"] == 1.0)
    row = _rows(partial)[extra]
    assert row["in_model_cache"] is True and row["bytes"] > 0
    stats = _call(partial, "GET", "/v1/aegaeon/stats?light=1")[1]
    assert extra in stats["cache"]["model_cache"]["operator_pinned"]
    assert {m["name"]: m for m in stats["models"]}[extra]["load_progress"] == 1.0
    assert _load_progress(partial).get(extra) == 1.0
    status, body = _call(partial, "PATCH", f"/v1/aegaeon/models/{extra}", {"pinned": "yes"})
    assert status == 400 and body["error"]["param"] == "pinned"

    # remove: 404 at once, and nothing of it is left
    status, body = _call(partial, "DELETE", f"/v1/aegaeon/models/{extra}")
    assert status == 200 and body["state"] == "removed", body
    status, body = _complete(partial, extra)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert _listed(partial) == configured
    assert _call(partial, "PATCH", f"/v1/aegaeon/models/{extra}", {"pin": True})[0] == 404

    def clean() -> dict[str, Any] | None:
        stats = _call(partial, "GET", "/v1/aegaeon/stats?light=1")[1]
        return stats if _nothing_held(stats) else None

    stats = _until("no request, lease or sequence left", clean)
    assert stats["counters"]["report_errors"] == 0  # every InstanceModels was understood
    cache = stats["cache"]["model_cache"]
    assert extra not in [m["name"] for m in cache["models"]]
    assert extra not in cache["known"] and extra not in cache["operator_pinned"]
    assert extra not in cache["loading"] and extra not in cache["progress"]
    assert extra not in [m["name"] for m in stats["models"]]
    assert extra not in _load_progress(partial)
    assert _complete(partial, configured[1])[0] == 200


def test_removal_lets_requests_in_flight_finish(partial: Served, market_names: list[str]) -> None:
    model = market_names[3]
    status, row = _call(partial, "POST", "/v1/aegaeon/models", {"name": model})
    assert status == 201, row
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["status"], result["body"] = _complete(partial, model, max_tokens=LONG_TOKENS)

    thread = threading.Thread(target=long_request)
    thread.start()
    # seconds of decoding, so a poll sees it; if it ended unseen, say how it ended
    _until("the request is in flight (or ended)",
           lambda: _rows(partial)[model]["in_flight"] == 1 or not thread.is_alive())  # fmt: skip
    assert thread.is_alive(), f"the request ended before it was seen in flight: {result}"
    status, body = _call(partial, "DELETE", f"/v1/aegaeon/models/{model}")
    # 202 while it runs (200 if it ended in between: a slow machine's scheduling)
    assert status in (200, 202), body
    assert body["state"] == ("removing" if status == 202 else "removed")
    assert _complete(partial, model)[0] == 404  # new requests: at once
    thread.join(timeout=300)
    assert result["status"] == 200, result  # the one in flight finished
    assert result["body"]["usage"]["completion_tokens"] == LONG_TOKENS
    _until("the model is gone", lambda: model not in _rows(partial))
    cache = _call(partial, "GET", "/v1/aegaeon/stats?light=1")[1]["cache"]["model_cache"]
    assert model not in [m["name"] for m in cache["models"]] and model not in cache["known"]


def _on_devices(served: Served, model: str) -> list[str]:
    """The instances whose last heartbeat has ``model``'s weights on their device."""
    stats = _call(served, "GET", "/v1/aegaeon/stats?light=1")[1]["instance_stats"]
    return sorted(n for n, s in stats.items() if s and model in s["resident_models"])


def test_sleep_and_wake_move_the_weights_off_and_onto_a_device(
    partial: Served, market_names: list[str]
) -> None:
    """vLLM's /sleep -> /is_sleeping -> /wake_up round trip: the model's weights leave
    every device (they stay in the Model Cache) and come back; a request for a
    sleeping model is served; Ollama's keep_alive holds (Model Cache pin) and unloads."""
    model = market_names[0]
    assert _complete(partial, model)[0] == 200  # on the devices that served it
    _until("its weights on a device", lambda: _on_devices(partial, model))
    assert not is_sleeping(partial.url, model)

    status, body = _call(partial, "POST", f"/sleep?model={model}")
    assert status == 200 and body == {"is_sleeping": True, "models": {model: True}}, body
    assert is_sleeping(partial.url, model)
    _until("every heartbeat without it", lambda: _on_devices(partial, model) == [])
    rows = _rows(partial)
    assert rows[model]["in_model_cache"] is True  # asleep: off the devices, in host memory

    status, body = _call(partial, "POST", f"/wake_up?model={model}")
    assert status == 200 and body["is_sleeping"] is False, body
    assert not is_sleeping(partial.url, model)
    assert _until("its weights back on a device", lambda: _on_devices(partial, model))

    # asleep again, a request for it is served: its prefill switches it in
    assert _call(partial, "POST", f"/sleep?model={model}")[1]["is_sleeping"] is True
    status, done = _complete(partial, model)
    assert status == 200 and done["usage"]["completion_tokens"] == 4
    _until("awake (the next heartbeat)", lambda: not is_sleeping(partial.url, model))
    status, body = _call(partial, "GET", "/is_sleeping?model=no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"

    # keep_alive: -1 holds it in the Model Cache (pinned), 0 unloads it after the request
    def pinned() -> bool:
        stats = _call(partial, "GET", "/v1/aegaeon/stats?light=1")[1]
        return model in stats["cache"]["model_cache"]["operator_pinned"]

    body = {"model": model, "prompt": "Once", "max_tokens": 2, "keep_alive": -1}
    assert _call(partial, "POST", "/v1/completions", body)[0] == 200
    _until("held by keep_alive -1", pinned)
    body["keep_alive"] = 0
    assert _call(partial, "POST", "/v1/completions", body)[0] == 200
    _until("unloaded by keep_alive 0", lambda: is_sleeping(partial.url, model) and not pinned())
    body["keep_alive"] = "soon"
    status, err = _call(partial, "POST", "/v1/completions", body)
    assert status == 400 and err["error"]["param"] == "keep_alive"
    assert _complete(partial, market_names[1])[0] == 200  # the other model never slept
