"""One corrupt checkpoint does not take the node down: its model is quarantined, the
rest is served (issue 47), on one node and on ``--nodes 2 --proxies 2``.

A copy of a market in which one model's weights are truncated to 1 MB (a partial
copy, a full disk during a sync) and another's header gives a tensor a transposed
shape (same size, valid JSON): ``aegaeon serve`` starts, serves every other model
(on one node the real SmolLM2 answers the README's question), answers 503
``model_unavailable`` naming the file for the broken two, lists them as unavailable
(``/v1/models``, ``/v1/aegaeon/models``, a metric), keeps every process alive, and
serves a model again once its file is restored and ``reload`` is called (through
the other replica with two). ``aegaeon market verify`` exits 2 naming both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from http_support import call_json, get_text
from market_support import linked_copy, swap_a_shape, truncate, with_records
from serve_harness import Served, serving, until

SETTLE_S = 60.0  # the replicas follow the store within this on a busy machine


@dataclass(frozen=True)
class Node:
    """A served copy of a market with two broken models; ``urls``: every proxy (one
    per node)."""

    served: Served
    source: Path  # the market it is a copy of (the files to restore)
    market: Path
    truncated: str
    reshaped: str
    good: tuple[str, ...]
    urls: tuple[str, ...]
    num_nodes: int
    pids: frozenset[int]  # every process once it served

    @property
    def broken(self) -> tuple[str, str]:
        return self.truncated, self.reshaped

    def weights(self, model: str) -> Path:
        return self.market / model / "model.safetensors"


TOPOLOGIES = ("one-node", "two-nodes")


@pytest.fixture(scope="module", params=TOPOLOGIES)
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         small_market: Path) -> Iterator[Node]:  # fmt: skip
    """One node over the real market (SmolLM2 and three others), or two nodes and two
    replicas through a real redis-server over the small one; one node at a time."""
    if request.param == "one-node":
        from real_market import real_market_dir

        source, truncated, reshaped = real_market_dir(), "mistral-11m", "llama-gqa-5m"
        extra: tuple[str, ...] = ()
    else:
        redis_url = request.getfixturevalue("redis_url")
        source, truncated, reshaped = small_market, "qwen2-19m", "mistral-11m"
        extra = ("--nodes", "2", "--proxies", "2", "--store-url", redis_url)
    root = tmp_path_factory.mktemp(f"quarantine-{request.param}")
    market = linked_copy(source, root / "market", private=(truncated, reshaped))
    (market / "market.json").unlink()  # (a link: rewritten here, not in the source)
    shutil.copyfile(source / "market.json", market / "market.json")
    with_records(market)  # what `market add` records (a cached market may predate it)
    truncate(market / truncated / "model.safetensors", 1 << 20)
    swap_a_shape(market / reshaped / "model.safetensors")
    names = [p.name for p in sorted(market.iterdir()) if (p / "config.json").is_file()]
    good = tuple(n for n in names if n not in (truncated, reshaped))
    with serving(market, root / "run", *extra) as served:
        urls = tuple(served.urls)
        for url in urls:  # (a replica reads every node's cachemgr within a second or two)
            until(f"{url} knows the broken models", lambda u=url: _unavailable(u) == {
                truncated, reshaped}, SETTLE_S)  # fmt: skip
        pids = frozenset(p.pid for p in served.children())
        yield Node(served, source, market, truncated, reshaped, good, urls, len(urls), pids)


def _unavailable(url: str) -> set[str]:
    status, listing = call_json(url, "GET", "/v1/models")
    return {m["id"] for m in listing["data"] if m["state"] == "unavailable"} if status == 200 \
        else set()


def _complete(url: str, model: str, **body: object) -> tuple[int, dict[str, object]]:
    return call_json(url, "POST", "/v1/completions",  # type: ignore[no-any-return]
                     {"model": model, "prompt": "Hello!", "max_tokens": 4, **body})


def _error(body: dict[str, object]) -> dict[str, str]:
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    return err


def test_every_other_model_is_served(node: Node) -> None:
    for url in node.urls:
        for model in node.good:
            status, body = _complete(url, model)
            assert status == 200, body
        if "smollm2-135m-instruct" in node.good:  # the README's request
            status, body = call_json(url, "POST", "/v1/chat/completions", {
                "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 64,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_the_broken_ones_answer_503_naming_their_file(node: Node) -> None:
    for url in node.urls:
        for model in node.broken:
            for stream in (False, True):
                status, body = _complete(url, model, stream=stream)
                assert status == 503, body
                err = _error(body)
                assert err["code"] == "model_unavailable" and err["param"] == "model"
                assert str(node.weights(model)) in err["message"]
    status, body = _complete(node.urls[-1], node.truncated)
    assert "1048576 bytes, market.json records" in _error(body)["message"]
    status, body = _complete(node.urls[0], node.reshaped)
    assert "wrong shape" in _error(body)["message"]


def test_they_are_listed_unavailable_with_why_and_counted(node: Node) -> None:
    for url in node.urls:
        status, listing = call_json(url, "GET", "/v1/models")
        assert status == 200
        state = {m["id"]: (m["state"], m.get("error")) for m in listing["data"]}
        assert {n: s for n, (s, _) in state.items()} == {
            **dict.fromkeys(node.good, "serving"), **dict.fromkeys(node.broken, "unavailable")}
        for model in node.broken:
            assert str(node.weights(model)) in str(state[model][1])
        status, rows = call_json(url, "GET", "/v1/aegaeon/models")
        assert {r["name"]: r["state"] for r in rows["data"]} == {
            n: s for n, (s, _) in state.items()}
        assert all((r["error"] is None) == (r["name"] in node.good) for r in rows["data"])
        status, text = get_text(f"{url}/metrics")
        assert status == 200 and "aegaeon_models_unavailable 2.0" in text


def test_every_process_is_alive(node: Node) -> None:
    now = {p.pid for p in node.served.children() if p.is_running()}
    assert node.pids <= now, "a process died (and was restarted) over a bad file"
    assert "child died" not in node.served.log_path.read_text()
    for name, status in _health(node).items():
        assert status == 200, name


def _health(node: Node) -> dict[str, int]:
    status, body = call_json(node.urls[0], "GET", "/v1/aegaeon/services")
    assert status == 200
    out = {}
    for service in body["services"]:
        out[service["name"]] = get_text(service["health_url"])[0]
    assert len(out) == 1 + 3 * node.num_nodes  # the proxy asked, each node's three services
    return out


def test_market_verify_names_both(node: Node) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aegaeon_cli.main", "market", "verify", "--market",
         str(node.market)], check=False, capture_output=True, text=True, timeout=300,
        env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(line.split(":")[0] for line in lines) == sorted(node.broken)
    for model in node.broken:
        assert any(str(node.weights(model)) in line for line in lines)
    assert "2 of" in done.stderr and "Traceback" not in done.stderr


def test_a_restored_file_and_a_reload_serve_it_again(node: Node) -> None:
    first, last = node.urls[0], node.urls[-1]
    # still broken: the reload says what is wrong, and it stays unavailable
    status, body = call_json(first, "POST", f"/v1/aegaeon/models/{node.truncated}/reload")
    assert status == 422 and _error(body)["code"] == "model_unavailable", body
    assert str(node.weights(node.truncated)) in _error(body)["message"]
    for model in node.broken:  # the operator puts the files back
        node.weights(model).unlink()
        shutil.copyfile(node.source / model / "model.safetensors", node.weights(model))
        status, row = call_json(first, "POST", f"/v1/aegaeon/models/{model}/reload")
        assert status == 200, row
        assert row["state"] == "serving" and row["error"] is None
    for url in node.urls:  # (another replica follows the store)
        for model in node.broken:
            until(f"{model} served through {url}",
                  lambda u=url, m=model: _complete(u, m)[0] == 200, SETTLE_S)  # fmt: skip
    status, listing = call_json(last, "GET", "/v1/models")
    assert {m["state"] for m in listing["data"]} == {"serving"}
    test_every_process_is_alive(node)
