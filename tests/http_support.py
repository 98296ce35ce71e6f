"""The tests' HTTP calls, on the one client of the bench and the tests (aiohttp:
:mod:`aegaeon_bench.node.http_client`, whose :func:`fetch`, :func:`sse_events` and
:func:`sse_payloads` are here too). The plain functions are for tests that run no
event loop; an ``async def`` test awaits :func:`fetch` on a session of its own.
Raw sockets stay in the tests that break the wire on purpose."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aegaeon_bench.node.http_client import Reply, fetch, fetch_sync, sse_events, sse_payloads
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "Reply", "Samples", "call_json", "fetch", "fetch_sync", "get_json", "get_text",
    "metric_samples", "post_text", "sample_sum", "samples_of", "sse_events", "sse_payloads",
]  # fmt: skip

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def call_json(url: str, method: str, path: str, body: Any = None,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    """``(status, body)`` of one request to ``url + path`` with ``body`` as JSON: the
    answer's JSON, or its text when it is not JSON (errors included)."""
    reply = fetch_sync(method, url + path, body, headers)
    return reply.status, reply.data()


def post_text(url: str, path: str, body: Any, timeout_s: float = 300.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    """``(status, text)`` of a POST of ``body`` as JSON to ``url + path`` (vLLM's LoRA
    routes answer plain text on success, an OpenAI error object otherwise; a load reads
    and checks the adapter on every node: a longer wait than an API call)."""
    reply = fetch_sync("POST", url + path, body, headers, timeout_s=timeout_s)
    return reply.status, reply.text()


def get_text(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, str]:
    """``(status, text)`` of ``GET url``."""
    reply = fetch_sync("GET", url, headers=headers)
    return reply.status, reply.text()


def get_json(url: str, headers: Mapping[str, str] | None = None) -> Any:
    """The JSON of ``GET url``, which must answer 200."""
    reply = fetch_sync("GET", url, headers=headers)
    assert reply.status == 200, (url, reply.status, reply.text()[:300])
    return reply.json()


def metric_samples(url: str, headers: Mapping[str, str] | None = None) -> Samples:
    """Every sample a ``/metrics`` URL shows: ``{(name, sorted labels): value}``."""
    status, text = get_text(url, headers)
    assert status == 200, (url, status, text[:300])
    return samples_of(text)


def sample_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(
        v for (n, lbl), v in samples.items()
        if n == name and all(dict(lbl).get(k) == x for k, x in labels.items())
    )  # fmt: skip


def samples_of(text: str) -> Samples:
    """Every sample of a Prometheus exposition: ``{(name, sorted labels): value}``."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip
