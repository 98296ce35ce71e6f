"""Where an admitted request goes: one placement object per policy family, which the
backend (``cluster.backend``) calls without asking which it is; each takes what it
needs of the backend as a :class:`Host`.

* :class:`Booking`, Aegaeon's: **dispatch** (Algorithm 1 across every node's
  prefill instances) and **placement** (Algorithm 2 within the prefill's node: the
  KV stays in that node's host memory) are store transactions over the candidates'
  queues (``aegaeon_sched.shared``), which commit only if no other replica wrote a
  queue read meanwhile (else decided again on fresh state): two replicas never both
  book an instance on the same picture of it.
* :class:`Baselines`, the request-level baselines' (one node): the policy's picture
  in one store key.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from aegaeon_common.config import Config
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.messages.report import PrefillDone
from aegaeon_common.registry import (
    BASELINE,
    QUEUE_TTL_S,
    InstanceRecord,
    decode_baseline,
    encode,
    encode_baseline,
)
from aegaeon_common.store import Store, StoreError
from aegaeon_common.wire import Message
from aegaeon_sched import (
    Action,
    Cancel,
    ClusterSpec,
    DecodeShare,
    NoInstance,
    Policy,
    PolicyOptions,
    Reject,
    RunOnInstance,
    make_policy,
)
from aegaeon_sched.shared import (
    dispatch_prefill,
    place_decode,
    prefill_queue_of,
    queue_of,
    remove_requests,
)
from aegaeon_sched.shared_baselines import restore, snapshot

from aegaeon_proxy.cluster.registry import RegistryView
from aegaeon_proxy.cluster.requests import RequestTable
from aegaeon_proxy.cluster.tracked import Tracked, Where

__all__ = ["Baselines", "Booking", "Host", "unqueue"]

ARENA_SLACK_BYTES = 1 << 20


def _fresh_id() -> int:
    """A group or batch id no other replica mints (random, 52 bits)."""
    return secrets.randbits(52)


class Host(Protocol):
    """What a placement needs of the backend (``cluster.backend``)."""

    config: Config
    store: Store
    view: RegistryView
    report_address: str
    table: RequestTable
    held: dict[str, Tracked]  # no instance to dispatch to yet
    held_decode: dict[str, tuple[Tracked, Where]]  # prefilled, no decode instance yet
    dispatch_s: deque[float]  # how long each placement's transaction took

    async def send(self, record: InstanceRecord, msg: Message) -> None: ...

    async def send_to(self, where: Where, msg: Message) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, None]) -> None: ...

    def store_failed(self, request_id: str, exc: StoreError) -> None: ...

    async def put_meta(self, tracked: Tracked) -> None: ...

    def lost(self, tracked: Tracked, where: Where) -> None: ...


async def unqueue(store: Store, config: Config, request_id: str, queue: str) -> None:
    """Take the request out of the shared queue at ``queue`` (prefill or decode; a
    no-op if not there, or gone with its instance)."""
    prefill = queue.startswith("pq:")
    max_group = config.scheduler.max_group_size

    def remove(values: list[bytes | None]) -> tuple[dict[str, bytes | None], None]:
        if values[0] is None:
            return {}, None
        state = queue_of(values[0], prefill, max_group)
        return ({queue: encode(state)} if remove_requests(state, (request_id,)) else {}), None

    with contextlib.suppress(StoreError):
        await store.transact([queue], remove, ttl_s=QUEUE_TTL_S)


class Booking:
    """Aegaeon's placement over the store's queues (see the module)."""

    def __init__(self, host: Host) -> None:
        self.host = host
        # each hybrid instance's share of time left for decoding, from its records' beats
        self._decode_shares: dict[str, DecodeShare] = {}

    def takes_work(self) -> bool:
        return bool(self.host.view.prefill_candidates())

    async def dispatch(self, tracked: Tracked, again: bool = False) -> None:
        """Algorithm 1 across every node's prefill instances, one transaction (``again``:
        its instance failed before its first token, which changes nothing here)."""
        host, rid = self.host, tracked.gen.request_id
        host.held.pop(rid, None)
        candidates = host.view.prefill_candidates()
        latency = host.view.latency()
        if not candidates or latency is None:
            host.held[rid] = tracked
            return

        def choose(states: dict[str, Any]) -> tuple[str, Any, tuple[Any, ...]]:
            instance, group_id, queue = dispatch_prefill(
                states, tracked.sched, latency, time.time(), new_group_id=_fresh_id()
            )
            return instance, queue, (group_id, queue.group_key_s(group_id))

        try:
            await self._book(tracked, candidates, "prefill", choose)
        except NoInstance:
            host.held[rid] = tracked

    def prefilled(self, tracked: Tracked, where: Where, msg: PrefillDone) -> None:
        """Its first token came: what the prefill took teaches the latency model
        dispatch estimates with; out of its prefill queue, then placed for decode."""
        measured = msg.timings.extra.get("prefill_compute_s", msg.timings.prefill_s)
        latency = self.host.view.latency()
        if latency is not None and measured > 0:
            latency.observe_prefill(tracked.sched.switch_unit, [tracked.sched.prompt_len],
                                    measured)  # fmt: skip
        self.host.spawn(self._after_prefill(tracked, where, msg))

    async def _after_prefill(self, tracked: Tracked, where: Where, msg: PrefillDone) -> None:
        host, rid = self.host, msg.request_id
        max_group = host.config.scheduler.max_group_size

        def done(values: list[bytes | None]) -> tuple[dict[str, bytes | None], None]:
            queue = prefill_queue_of(values[0], max_group)
            queue.done(rid, time.time())
            return {where.queue: encode(queue)}, None

        try:
            await host.store.transact([where.queue], done, ttl_s=QUEUE_TTL_S)
        except StoreError as exc:
            host.store_failed(rid, exc)
            await host.send_to(where, CancelRequest(rid, free_handoff=True))
            return
        if tracked.where is where:
            tracked.where = None  # out of the prefill queue; not placed yet
        if not host.table.finish_first(tracked, msg):
            await self._place_decode(tracked, where)

    async def _place_decode(self, tracked: Tracked, prefilled: Where) -> None:
        """Algorithm 2's placement over the decode-capable instances of the prefill's
        node: the request is sent to one (its handoff is that instance's to claim) or
        held for one (none takes work now: placed when one does). One ended or cancelled
        before its placement, or not placed: its KV handoff is still leased to the
        prefill instance, which frees it on a cancel."""
        host, rid = self.host, tracked.gen.request_id
        candidates = host.view.decode_candidates(prefilled.node)
        if rid in host.table.requests and not candidates:
            host.held_decode[rid] = (tracked, prefilled)
            return
        config = host.config
        capacity = {r.instance_id: r.capacity_tokens for r in candidates}
        shares = {r.instance_id: self._decode_shares[r.instance_id].share for r in candidates
                  if r.instance_id in self._decode_shares}  # fmt: skip
        # with roles moving, an instance in the prefill role takes new decode requests
        # only while no decode-role one keeps up (as on one node)
        reserved = {r.instance_id for r in candidates
                    if config.role_switching and host.view.role(r) == "prefill"}
        latency = host.view.latency()

        def choose(states: dict[str, Any]) -> tuple[str, Any, tuple[Any, ...]]:
            instance, batch_id, work_list = place_decode(
                states, tracked.sched, new_batch_id=_fresh_id(), capacity_tokens=capacity,
                decode_shares=shares, latency=latency, tbt_s=config.slo.tbt_s,
                max_batch_size=config.scheduler.max_batch_size, reserved=reserved,
            )  # fmt: skip
            return instance, work_list, (batch_id,)

        if rid not in host.table.requests or not await self._book(tracked, candidates,
                                                                   "decode", choose):
            await host.send_to(prefilled, CancelRequest(rid, free_handoff=True))

    async def _book(
        self, tracked: Tracked, candidates: list[InstanceRecord], stage: str,
        choose: Callable[[dict[str, Any]], tuple[str, Any, tuple[Any, ...]]],
    ) -> bool:  # fmt: skip
        """Book the request on one of ``candidates``: ``choose`` picks it from their
        ``stage`` queues and changes its queue; then its work message goes to it, with
        the ids ``choose`` gave. False: the store failed (the request ended), or it ended
        while deciding, or has no message (the booking undone)."""
        host, rid = self.host, tracked.gen.request_id
        keys = {r.instance_id: RegistryView.queue_key(r, stage) for r in candidates}
        max_group = host.config.scheduler.max_group_size

        def decide(values: list[bytes | None]) -> tuple[dict[str, bytes | None], tuple[str, Any]]:
            queues = {i: queue_of(v, stage == "prefill", max_group)
                      for i, v in zip(keys, values, strict=True)}  # fmt: skip
            instance, queue, ids = choose(queues)
            return {keys[instance]: encode(queue)}, (instance, ids)

        started = time.perf_counter()
        try:
            instance, ids = await host.store.transact(list(keys.values()), decide,
                                                         ttl_s=QUEUE_TTL_S)  # fmt: skip
        except StoreError as exc:
            host.store_failed(rid, exc)
            return False
        host.dispatch_s.append(time.perf_counter() - started)
        record = next(r for r in candidates if r.instance_id == instance)
        where = Where(instance, record.incarnation, record.node, keys[instance], stage)
        make = tracked.prefill_message if stage == "prefill" else tracked.decode_message
        msg = make(record.incarnation, host.report_address, *ids)
        if rid not in host.table.requests or msg is None:
            await unqueue(host.store, host.config, rid, where.queue)
            return False
        tracked.where = where
        await host.send(record, msg)
        with contextlib.suppress(StoreError):
            await host.put_meta(tracked)
        return True

    def release(self, tracked: Tracked, where: Where | None, cancelled: bool) -> None:
        """``tracked`` ended: out of its shared queue; a cancel reaches its instance (at
        its prefill instance, its handoff may be sent already: it will not be placed
        now); a held decode placement's handoff, never claimed, is freed."""
        host, rid = self.host, tracked.gen.request_id
        held = host.held_decode.pop(rid, None)
        if held is not None:
            host.spawn(host.send_to(held[1], CancelRequest(rid, free_handoff=True)))
        if where is None:
            return
        if cancelled:
            cancel = CancelRequest(rid, free_handoff=where.stage == "prefill")
            host.spawn(host.send_to(where, cancel))
        host.spawn(unqueue(host.store, host.config, rid, where.queue))

    def refresh(self, now_s: float) -> None:
        """After a registry refresh: the hybrid instances' decode shares from their
        beats; held decode placements whose node has a decode instance that takes work
        again (one whose prefill instance left meanwhile lost its handoff with it)."""
        view = self.host.view
        for record in view.live.values():
            # a prefill instance decodes when idle; with roles moving, a decode one
            # prefills: either's decode share is what its prefills leave
            prefills = record.kind == "prefill" or self.host.config.role_switching
            if prefills and self.host.config.hybrid_prefill:
                share = self._decode_shares.setdefault(record.instance_id,
                                                       DecodeShare(min_interval_s=0.0))
                share.observe(now_s, record.load.prefill_s)
        held = self.host.held_decode
        for rid, (tracked, prefilled) in list(held.items()):
            if not view.alive(prefilled.instance, prefilled.incarnation):
                del held[rid]
                self.host.lost(tracked, prefilled)
            elif view.decode_candidates(prefilled.node):
                del held[rid]
                self.host.spawn(self._place_decode(tracked, prefilled))


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
    """A request-level baseline's placement over the store (one node: a replica of many
    would start another replica's queued request, whose client and prompt it does not
    hold).

    A baseline binds each request to a unified instance at arrival and keeps one
    global picture (each instance's model and running requests, the queues): the
    store's :data:`~aegaeon_common.registry.BASELINE` record, each decision one
    transaction over it (``aegaeon_sched.shared_baselines``); its actions are carried
    out after the commit."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._table = {RunOnInstance: self._run, Cancel: self._cancel, Reject: self._reject}

    def records(self) -> list[InstanceRecord]:
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
        self.host.table.finish_first(tracked, msg)  # (its unified instance decodes it on)

    def release(self, tracked: Tracked, where: Where | None, cancelled: bool) -> None:
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
        """One decision: ``event`` run on the policy over the instances that take work,
        restored from the store's picture and written back; its actions and those
        instances. None: no instance takes work (or has a profile)."""
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

