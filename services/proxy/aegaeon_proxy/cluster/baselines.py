"""The request-level baselines over the store: placement by a policy whose picture lives
in one store key (``scheduler.policy`` other than ``aegaeon``; one node).

A baseline (ServerlessLLM's request-level scheduling and its variants, MuxServe's
static multiplexing) binds each request to a unified instance at arrival and
keeps one global picture (each instance's model and running requests, the
queues). That picture is the store's :data:`~aegaeon_common.registry.BASELINE`
record, and each decision is one transaction over it
(``aegaeon_sched.shared_baselines``): build the policy over the instances the
registry lists (their KV room learned from their records), restore the picture,
run the event, write the picture back, then carry out the actions (``RunRequest``
to an instance, a cancel, a refusal). An arrival no instance is registered for
waits with the backend's held requests; a request's end releases its binding
and starts what waited for it.

The baselines run on one node: a replica of many would start another replica's
queued request, whose client and prompt it does not hold.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.messages.report import PrefillDone
from aegaeon_common.registry import (
    BASELINE,
    QUEUE_TTL_S,
    InstanceRecord,
    decode_baseline,
    encode_baseline,
)
from aegaeon_common.store import StoreError
from aegaeon_sched import (
    Action,
    Cancel,
    ClusterSpec,
    Policy,
    PolicyOptions,
    Reject,
    RunOnInstance,
    make_policy,
)
from aegaeon_sched.shared_baselines import restore, snapshot

from aegaeon_proxy.cluster.placement import Host
from aegaeon_proxy.cluster.tracked import Tracked, Where

log = get_logger("cluster")

__all__ = ["Baselines"]

ARENA_SLACK_BYTES = 1 << 20


def _options(config: Config, records: list[InstanceRecord]) -> PolicyOptions:
    capacity: dict[str, int] = {}
    for record in records:
        for model, tokens in record.capacity_tokens.items():
            capacity[model] = min(tokens, capacity.get(model, tokens))
    arena = config.decode.device_memory_bytes - config.decode.kv_memory_bytes  # unified: decode
    return PolicyOptions(
        max_batch_size=config.scheduler.max_batch_size,
        decode_capacity_tokens=capacity,
        unified_capacity_tokens=capacity,
        decode_tbt_s=config.slo.tbt_s,
        default_ttft_s=config.slo.ttft_s,
        units={m.name: m.base for m in config.models if m.base is not None},
        # static-mux: the models that stay resident on an instance fit its weights arena
        # together (bump allocations, each aligned: a MiB of slack)
        gpu_weight_budget_bytes=max(arena - ARENA_SLACK_BYTES, 0),
    )


class Baselines:
    """A baseline's placement over the store (see the module)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._table = {RunOnInstance: self._run, Cancel: self._cancel, Reject: self._reject}

    def records(self) -> list[InstanceRecord]:
        """The instances that take work (registered, not draining), in id order."""
        live = self.host.view.live.values()
        return sorted((r for r in live if not r.draining), key=lambda r: r.instance_id)

    def takes_work(self) -> bool:
        return bool(self.records())

    async def dispatch(self, tracked: Tracked, again: bool = False) -> None:
        """The policy takes ``tracked`` (``again``: its instance failed before its first
        token: its binding there goes first), or it waits for an instance."""
        rid = tracked.gen.request_id
        self.host.held.pop(rid, None)

        def arrive(policy: Policy, now: float) -> list[Action]:
            actions = list(policy.on_request_cancelled(rid, now)) if again else []
            return actions + policy.on_arrival(tracked.sched, now)

        started = time.perf_counter()
        try:
            decided = await self._transact(arrive)
        except StoreError as exc:
            self.host.store_failed(rid, exc)
            return
        if decided is None:
            self.host.held[rid] = tracked
            return
        self.host.dispatch_s.append(time.perf_counter() - started)
        await self._carry_out(*decided)

    def prefilled(self, tracked: Tracked, where: Where, msg: PrefillDone) -> None:
        """Its first token came: the unified instance decodes it on."""
        self.host.table.finish_first(tracked, msg)

    def release(self, tracked: Tracked, where: Where | None, cancelled: bool) -> None:
        """``tracked`` ended (the policy cancels it at its instance)."""
        self.host.spawn(self._release(tracked.gen.request_id, cancelled))

    def refresh(self, now_s: float) -> None:
        """(Its picture is the store's: nothing to bring up to date.)"""

    async def _release(self, request_id: str, cancelled: bool) -> None:
        """``request_id`` ended: its binding goes (at its instance too when cancelled),
        and what waited for its room starts (no instance: nothing runs; the next
        decision drops its binding)."""

        def end(policy: Policy, now: float) -> list[Action]:
            ended = policy.on_request_cancelled if cancelled else policy.on_request_finished
            return list(ended(request_id, now))

        with contextlib.suppress(StoreError):
            decided = await self._transact(end)
            if decided is not None:
                await self._carry_out(*decided)

    async def _transact(self, event: Callable[[Policy, float], list[Action]]
                        ) -> tuple[list[Action], list[InstanceRecord]] | None:  # fmt: skip
        """One decision: the policy built over the instances that take work (each with
        its own KV room), restored from the store's picture, ``event`` run on it, the
        picture written back (decided again if another replica wrote it meanwhile); its
        actions and those instances. None: no instance takes work (or has a profile)."""
        config, records, latency = self.host.config, self.records(), self.host.view.latency()
        if not records or latency is None:
            return None
        names = tuple(r.instance_id for r in records)

        def decide(values: list[bytes | None]) -> tuple[dict[str, bytes | None], list[Action]]:
            policy = make_policy(config.scheduler.policy, ClusterSpec((), names), latency,
                                 _options(config, records))  # fmt: skip
            for record in records:
                policy.learn(record.instance_id, record.capacity_tokens, None)
            actions = event(restore(policy, decode_baseline(values[0])), time.time())
            return {BASELINE: encode_baseline(snapshot(policy))}, actions

        actions = await self.host.store.transact([BASELINE], decide, ttl_s=QUEUE_TTL_S)
        return actions, records

    async def _carry_out(self, actions: list[Action], records: list[InstanceRecord]) -> None:
        by_id = {r.instance_id: r for r in records}
        for action in actions:
            await self._table[type(action)](action, by_id)  # type: ignore[operator]

    async def _run(self, action: RunOnInstance, by_id: dict[str, InstanceRecord]) -> None:
        rid = action.request.request_id
        tracked, record = self.host.table.requests.get(rid), by_id[action.instance]
        if tracked is None:  # ended while the policy decided: its binding goes
            await self._release(rid, cancelled=True)
            return
        # no shared queue holds it (the policy's picture is no queue): its metadata names none
        tracked.where = Where(action.instance, record.incarnation, record.node, "", "run")
        await self.host.send(record, tracked.run_message(record.incarnation,
                                                          self.host.report_address))  # fmt: skip

    async def _cancel(self, action: Cancel, by_id: dict[str, InstanceRecord]) -> None:
        record = by_id.get(action.instance) or self.host.view.live.get(action.instance)
        if record is not None:
            await self.host.send(record, CancelRequest(action.request_id))

    async def _reject(self, action: Reject, by_id: dict[str, InstanceRecord]) -> None:
        self.host.table.end(action.request.request_id, "error", action.reason,
                            action.code or None)  # fmt: skip

