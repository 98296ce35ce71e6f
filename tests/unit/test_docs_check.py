"""The docs checker (tests/docs_grammar.py reads, tests/docs_check.py checks): the
README and docs/operations.md show only commands and config keys that exist (checked
here, no node needed; their JSON fields are checked against the shared live node in
tests/e2e/test_docs.py), and a deliberate rename in a command, a key, a field or a
request field fails naming the file and the line."""

from __future__ import annotations

from typing import Any

import pytest
from docs_check import (
    REPO,
    Reply,
    field_specs,
    live_problems,
    offline_problems,
    parse_shape,
    read_doc,
    read_docs,
    shape_problems,
)


def _text(name: str) -> str:
    return (REPO / name).read_text()


def _renamed(name: str, old: str, new: str) -> tuple[Any, int]:
    """The doc ``name`` read with its first ``old`` written ``new``; the line it is on."""
    text = _text(name)
    assert old in text, f"{name} no longer shows {old!r}: pick another rename"
    line = text[: text.index(old)].count("\n") + 1
    return read_doc(name, text.replace(old, new, 1)), line


def test_every_command_and_config_key_the_docs_show_exists() -> None:
    docs = read_docs()
    found = {doc.file: (len(doc.commands), len(doc.keys)) for doc in docs}
    assert found["README.md"][0] >= 20 and found["README.md"][1] >= 15, found  # it reads them
    problems = offline_problems(docs)
    assert not problems, "\n".join(str(p) for p in problems)


@pytest.mark.parametrize(
    ("name", "old", "new", "said"),
    [
        # an option of a command block (scripts/prometheus hands its arguments to Python)
        ("docs/operations.md", "--api-key \"$AEGAEON_API_KEY\"", "--api-token \"$X\"",
         "has no option `--api-token`"),
        # a value the parser refuses (a choice), in a block aegaeon parses
        ("README.md", "--dtype bfloat16 /path", "--dtype bf16 /path", "invalid choice"),
        # a subcommand, and an option of a synopsis in the benchmarks table
        ("README.md", "`aegaeon bench soak", "`aegaeon bench soaking", "no subcommand `soaking`"),
        ("README.md", "--prompt-tokens P --output-tokens O] [--ttft",
         "--prompt-len P --output-tokens O] [--ttft", "has no option `--prompt-len`"),
        # issue 43's point 3, written back: a config key the loader does not know
        ("docs/operations.md", "`cachemgr.model_cache`", "`cache.model_cache_bytes`",
         "config key `cache.model_cache_bytes`: cache: unknown key"),
        ("README.md", "`roles.{up_hold, down_hold, min_dwell}`",
         "`roles.{up_hold, down_hold, min_dwel}`", "roles.min_dwel: unknown field"),
        # a program the checker cannot run needs the skip marker
        ("README.md", "<!-- docs-check: skip: needs Docker", "<!-- needs Docker",
         "`docker` is not a program the docs check"),
    ],
)  # fmt: skip
def test_a_renamed_command_or_key_fails_naming_file_and_line(
    name: str, old: str, new: str, said: str
) -> None:
    doc, line = _renamed(name, old, new)
    problems = [str(p) for p in offline_problems([doc])]
    assert any(said in p for p in problems), problems
    lines = {int(p.split(":")[1]) for p in problems if said in p}
    # the line of the rename, or of the command it continues / the block it marked
    assert all(abs(at - line) <= 5 for at in lines), (line, problems)
    assert all(p.startswith(f"{name}:") for p in problems)


def test_a_cell_lists_fields_values_subfields_and_aliases() -> None:
    specs = field_specs("per model `name`, `state` (`adding`/`serving`), `max_concurrency` "
                        "(null: unbounded); `model_cache` (`budget_bytes`, `num_hits`)")
    got = {s.name: (s.values, s.subfields, s.aliases) for s in specs}
    assert got == {"name": ([], [], []), "state": (["adding", "serving"], [], []),
                   "max_concurrency": ([], [], []),
                   "model_cache": ([], ["budget_bytes", "num_hits"], [])}  # fmt: skip
    body = field_specs("any of `pinned` (or `pin`), `slo_classes` (list of `interactive`/"
                       "`batch`, or null)")  # fmt: skip
    assert [(s.name, s.aliases, s.values) for s in body] == [
        ("pinned", ["pin"], []), ("slo_classes", [], ["interactive", "batch"])]


def test_a_literal_is_a_shape_checked_from_the_top() -> None:
    shape = parse_shape('{"services": [{"name", "metrics_url"}], "models": {"NAME": bool}}')
    good = {"services": [{"name": "a", "metrics_url": "u"}], "models": {"m": True}}
    assert shape_problems(shape, good) == []
    bad = {"services": [{"name": "a", "metrics": "u"}, {"name": "b"}], "models": {}}
    assert shape_problems(shape, bad) == ["key `metrics_url` not in .services[]"]
    with pytest.raises(ValueError):
        parse_shape('{name: 1}')


class FakeNode:
    """Answers as the proxy does, for the calls the README's admin table and request
    fields make (the checker's logic; tests/e2e/test_docs.py runs it on a real node)."""

    FIELDS = ("pinned", "pin", "preload", "max_concurrency", "slo_classes", "min_ttft_ms",
              "min_tbt_ms")  # fmt: skip

    def __init__(self) -> None:
        self.models = ["a", "b"]

    def _row(self, name: str) -> dict[str, Any]:
        return {"name": name, "state": "serving", "error": None, "source": "config", "path": "/m",
                "pinned": False, "preload": False, "max_concurrency": None, "slo_classes": [],
                "min_ttft_ms": None, "min_tbt_ms": None, "in_flight": 0,
                "in_model_cache": True, "loading": False, "load_progress": 1.0, "bytes": 1}

    def __call__(self, method: str, path: str, body: Any) -> Reply:
        cache = {"budget_bytes": 1, "used_bytes": 1, "num_loads": 1, "num_hits": 1,
                 "num_evictions": 0}  # fmt: skip
        if method == "GET" and path == "/v1/aegaeon/models":
            return Reply(200, {"models": [self._row(m) for m in self.models],
                               "model_cache": cache})  # fmt: skip
        if method == "GET" and path.startswith("/v1/aegaeon/models/"):
            return Reply(200, self._row(path.rsplit("/", 1)[1]))
        if method == "PATCH":
            unknown = [k for k in body if k not in self.FIELDS]
            return Reply(400, {"error": {"param": unknown[0]}}) if unknown else Reply(200, {})
        if method == "DELETE":
            self.models.remove(path.rsplit("/", 1)[1])
            return Reply(200, {"state": "removed", "evicted": True})
        if method == "POST" and path == "/v1/aegaeon/models":
            self.models.append(body["name"])
            return Reply(201, self._row(body["name"]))
        if method == "POST" and path == "/v1/completions":
            for name in ("priority", "ttft_ms", "tbt_ms"):
                if body.get(name) == "docs-check-value":
                    return Reply(400, {"error": {"param": name}})
            return Reply(200, {})
        return Reply(404, {"error": {"message": f"{method} {path}"}})


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("`num_hits`", "`num_hitz`", "field `model_cache.num_hitz`: not in the answer"),
        ("`in_model_cache`", "`in_cache`", "field `in_cache`: not in the answer"),
        ('"evicted"', '"evicted_bytes"', "key `evicted_bytes` not in the answer"),
        ("any of `pinned` (or `pin`)", "any of `pinned` (or `pinn`)",
         "body field `pinn` of PATCH /v1/aegaeon/models/{model}: HTTP 400"),
        ("| `ttft_ms`, `tbt_ms` |", "| `ttft_ms`, `tbt_msec` |",
         "request field `tbt_msec`: a bad value got HTTP 200"),
    ],
)  # fmt: skip
def test_a_renamed_field_fails_against_the_answers_naming_file_and_line(
    old: str, new: str, said: str
) -> None:
    admin = [d for d in read_docs(("README.md",))]
    assert live_problems(admin, _only_admin(FakeNode()), ["a", "b"]) == []
    doc, line = _renamed("README.md", old, new)
    problems = [str(p) for p in live_problems([doc], _only_admin(FakeNode()), ["a", "b"])]
    hits = [p for p in problems if said in p]
    assert hits and all(p.startswith(f"README.md:{line}:") for p in hits), (line, problems)


def _only_admin(node: FakeNode) -> Any:
    """The fake node, answering the README's marked paragraphs' GETs as the real one's
    shapes (stats, services) so only the admin table and request fields are at stake."""

    def fetch(method: str, path: str, body: Any) -> Reply:
        if path.startswith("/v1/aegaeon/stats"):
            inst = {"name": "d", "kind": "decode", "kv_blocks_in_use": 0, "leases": 0,
                    "open_sequences": 0}  # fmt: skip
            return Reply(200, {"open_requests": 0, "instances": [inst]})
        if path == "/v1/aegaeon/services":
            one = {k: "x" for k in ("name", "role", "health_url", "ready_url", "metrics_url")}
            return Reply(200, {"services": [one]})
        return node(method, path, body)

    return fetch
