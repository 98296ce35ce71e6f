"""What `aegaeon bench chaos` checks around a fault of the shared store (many nodes).

* :class:`KeptState`: before the first store fault, the operator's changes at run
  time, made through the replicas: a model pinned, one given ``max_concurrency``,
  one added (a market model the deployment does not serve; else one removed and
  added back) and one removed. After each fault, whether every replica still
  shows each of them (``settings_kept``).
* When the store answers again (a killed one restarted, a paused one continued):
  ``store_back_s``; when every replica lists every node's services again
  (``/v1/aegaeon/services``): ``services_back_s``; when the store holds the
  run-time changes again (written back by the replicas): ``records_back_s``;
  each from the injection.
* How the requests ended against the store's return (:func:`answers`): every one
  sent from :data:`SETTLE_S` after it must succeed; every one in flight at the
  fault or sent before then ends in a 200 or a 503 with ``Retry-After`` (a
  stream answered 200 already: an error event with a fault's code); every
  stream decoding at the fault finishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from aegaeon_bench.reliability.chaos_load import Attempt

SETTLE_S = 10.0  # requests sent this long after the store is back must all succeed
AFTER_S = 5.0  # the load goes on this long past SETTLE_S (the requests judged "after")
BACK_LIMIT_S = 60.0
MAX_CONCURRENCY = 64  # a limit of its own, above any load here (no 429 to tell apart)
SETTINGS = ("pinned", "max_concurrency", "added", "removed")

__all__ = ["AFTER_S", "SETTLE_S", "KeptState", "answers", "nodes_listed", "store_of",
           "wait_store"]  # fmt: skip


def store_of(run_dir: Path) -> tuple[str, str]:
    """The URL and namespace of the store of ``aegaeon serve --nodes`` whose run directory
    is ``run_dir`` (its replicas' config names them)."""
    raw = yaml.safe_load((run_dir / "proxy-0" / "config.yaml").read_text())
    return str(raw["store"]["url"]), str(raw["store"]["namespace"])


async def wait_store(url: str, namespace: str, keys: Sequence[str] = (),
                     limit_s: float = BACK_LIMIT_S) -> float | None:  # fmt: skip
    """When the store at ``url`` answers a PING and holds every one of ``keys`` (under
    ``namespace``) (time.time()), or None past ``limit_s``."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        client = aioredis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            await client.ping()
            if not keys or await client.exists(*(f"{namespace}:{k}" for k in keys)) == len(keys):
                return time.time()
        except (RedisError, OSError):
            pass
        finally:
            await client.aclose()
        await asyncio.sleep(0.05)
    return None


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return resp.status, await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return 0, None


async def nodes_listed(session: aiohttp.ClientSession, urls: Sequence[str], nodes: int) -> bool:
    """Every replica lists services of ``nodes`` nodes (``/v1/aegaeon/services``)."""
    for url in urls:
        status, body = await _get(session, f"{url}/v1/aegaeon/services")
        services = body.get("services", []) if status == 200 and isinstance(body, dict) else []
        listed = {str(s.get("name", "")).partition("/")[0] for s in services if "/" in
                  str(s.get("name", ""))}  # fmt: skip
        if len(listed) < nodes:
            return False
    return True


@dataclass(frozen=True)
class KeptState:
    """The models the run-time changes went to (see the module docstring)."""

    pinned: str
    limited: str
    added: str
    removed: str

    @classmethod
    async def prepare(
        cls, session: aiohttp.ClientSession, urls: Sequence[str], served: Sequence[str],
        offered: Sequence[str],
    ) -> KeptState | None:  # fmt: skip
        """Make the changes (through the replicas in turn); None with fewer than three
        models served (nothing to tell the changes apart with)."""
        if len(served) < 3:
            return None
        unserved = [m for m in offered if m not in served]
        added = unserved[0] if unserved else served[-1]
        removed = served[-2] if not unserved else served[-1]
        state = cls(pinned=served[0], limited=served[1], added=added, removed=removed)
        admin = [f"{u}/v1/aegaeon/models" for u in urls]
        await _call(session, "PATCH", f"{admin[0]}/{state.pinned}", {"pin": True})
        await _call(session, "PATCH", f"{admin[-1]}/{state.limited}",
                    {"max_concurrency": MAX_CONCURRENCY})  # fmt: skip
        if not unserved:  # removed, then added back: a model the run added
            await _call(session, "DELETE", f"{admin[0]}/{added}", None)
            await _until_gone(session, admin, added)
        await _call(session, "POST", admin[0], {"name": added})
        await _call(session, "DELETE", f"{admin[-1]}/{removed}", None)
        await _until_gone(session, admin, removed)
        return state

    def keys(self) -> list[str]:
        """The store's keys of these changes (``aegaeon_common.registry``)."""
        from aegaeon_common.registry import SERVED_MODELS, model_settings_key

        return [SERVED_MODELS, model_settings_key(self.pinned), model_settings_key(self.limited)]

    def models(self, served: Sequence[str]) -> list[str]:
        """The models to load the deployment with once the changes are made."""
        names = [m for m in served if m != self.removed]
        return names if self.added in names else [*names, self.added]

    async def check(self, session: aiohttp.ClientSession,
                    urls: Sequence[str]) -> dict[str, bool]:  # fmt: skip
        """Whether every replica shows each change still."""
        kept = dict.fromkeys(SETTINGS, True)
        for url in urls:
            admin = f"{url}/v1/aegaeon/models"
            _, row = await _get(session, f"{admin}/{self.pinned}")
            kept["pinned"] &= isinstance(row, dict) and row.get("pinned") is True
            _, row = await _get(session, f"{admin}/{self.limited}")
            kept["max_concurrency"] &= isinstance(row, dict) and \
                row.get("max_concurrency") == MAX_CONCURRENCY  # fmt: skip
            _, row = await _get(session, f"{admin}/{self.added}")
            kept["added"] &= isinstance(row, dict) and row.get("state") == "serving"
            status, _ = await _get(session, f"{admin}/{self.removed}")
            kept["removed"] &= status == 404
        return kept


async def _call(session: aiohttp.ClientSession, method: str, url: str,
                body: dict[str, Any] | None) -> None:  # fmt: skip
    async with session.request(method, url, json=body,
                               timeout=aiohttp.ClientTimeout(total=180)) as resp:  # fmt: skip
        if resp.status >= 300 and resp.status != 202:
            raise RuntimeError(f"{method} {url}: {resp.status} {await resp.text()}")


async def _until_gone(session: aiohttp.ClientSession, admin: Sequence[str], name: str) -> None:
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        statuses = [(await _get(session, f"{a}/{name}"))[0] for a in admin]
        if all(s == 404 for s in statuses):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"model {name} still served 60 s after its DELETE")


FAULT_CODES = ("store_unavailable", "instance_failed")  # a typed fault: retry later


def _ending(attempt: Attempt) -> str:
    return f"{attempt.outcome or 'hung'}:{attempt.status}:{attempt.code}"


def _retry_later(attempt: Attempt) -> bool:
    """A 503 with Retry-After, or (a stream answered 200 already) a fault's error event."""
    if attempt.status == 503:
        return bool(attempt.retry_after)
    return attempt.status == 200 and attempt.outcome == "error" and attempt.code in FAULT_CODES


def answers(attempts: Sequence[Attempt], t0: float, back: float) -> dict[str, Any]:
    """How the requests of one store fault ended: ``before`` (in flight at ``t0``, the
    injection, or sent until :data:`SETTLE_S` past ``back``, the store's return):
    completed, 503 with Retry-After, anything else; ``after`` (sent later);
    ``decoding_at_fault``: streams that had tokens at ``t0``, and how many finished."""
    settled = back + SETTLE_S
    before = [a for a in attempts if a.start_s < settled and (a.end_s is None or a.end_s >= t0)]
    after = [a for a in attempts if a.start_s >= settled]
    decoding = [a for a in before if a.first_s is not None and a.first_s < t0]
    retry_later = [a for a in before if _retry_later(a)]
    other_before = [_ending(a) for a in before
                    if a.outcome != "completed" and a not in retry_later]  # fmt: skip
    other_after = [_ending(a) for a in after if a.outcome != "completed"]
    return {
        "before": {"sent": len(before), "completed": sum(a.outcome == "completed" for a in before),
                   "503_retry_after": len(retry_later), "other": other_before[:10],
                   "num_other": len(other_before)},
        "after": {"sent": len(after), "completed": sum(a.outcome == "completed" for a in after),
                  "other": other_after[:10], "num_other": len(other_after)},
        "decoding_at_fault": {"sent": len(decoding),
                              "completed": sum(a.outcome == "completed" for a in decoding)},
    }  # fmt: skip
