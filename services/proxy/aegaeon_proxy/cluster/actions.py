"""Carrying out a policy's actions as messages to instances, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import CancelRequest, EnqueuePrefill
from aegaeon_common.wire import Message
from aegaeon_sched import Action, Cancel, PlaceDecode, Reject, RunOnInstance
from aegaeon_sched import EnqueuePrefill as EnqueuePrefillAction

from aegaeon_proxy.cluster.instances import Instances, InstanceView
from aegaeon_proxy.cluster.tracked import Tracked

# work for one instance process (``incarnation``), never for its successor
STAMPED = (EnqueuePrefill, EnqueueDecode, RunRequest)


class ActionHost(Protocol):
    """What the runner needs of the backend (``cluster.backend.ClusterBackend``)."""

    @property
    def instances(self) -> Instances: ...

    @property
    def requests(self) -> Mapping[str, Tracked]: ...

    def end_request(self, request_id: str, reason: str, error: str | None = None,
                    code: str | None = None) -> object: ...

    async def claim_handoff(self, instance: str, msg: EnqueueDecode) -> bool: ...

log = get_logger("cluster")


class ActionRunner:
    """Turns actions into messages; one ordered outgoing queue for all instances."""

    def __init__(self, backend: ActionHost) -> None:
        self.backend = backend
        self._out: asyncio.Queue[tuple[InstanceView, Message]] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._table = {
            EnqueuePrefillAction: self._enqueue_prefill,
            PlaceDecode: self._place_decode,
            RunOnInstance: self._run_on_instance,
            Cancel: self._cancel,
            Reject: self._reject,
        }

    def send(self, instance: str, msg: Message) -> None:
        """Queue ``msg`` for ``instance`` behind every message queued before it."""
        self._send(instance, msg)

    def _send(self, instance: str, msg: Message) -> None:
        view = self.backend.instances.views.get(instance)
        if view is None:
            log.error("action for an unknown instance", instance=instance, tag=msg.TAG)
            return
        if isinstance(msg, STAMPED):  # for this process only: its successor drops it
            msg = msgspec.structs.replace(msg, incarnation=view.incarnation)
        if self._out is None:
            self._out = asyncio.Queue()
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())
        self._out.put_nowait((view, msg))

    async def _run_pump(self) -> None:
        assert self._out is not None
        while True:
            view, msg = await self._out.get()
            # A handoff's blocks become the decode instance's before it is told of
            # them: if it dies first, the cachemgr reclaims them with its lease.
            if isinstance(msg, EnqueueDecode) and not await self.backend.claim_handoff(
                view.name, msg
            ):
                continue
            await view.send(msg)

    async def flush(self) -> None:
        if self._out is not None:
            while not self._out.empty():
                view, msg = self._out.get_nowait()
                await view.send(msg)
        if self._pump is not None:
            self._pump.cancel()

    def run(self, actions: Iterable[Action]) -> None:
        for action in actions:
            self._table[type(action)](action)  # type: ignore[operator]

    # ---- one handler per action type -----------------------------------------
    def _enqueue_prefill(self, action: EnqueuePrefillAction) -> None:
        tracked = self.backend.requests.get(action.request.request_id)
        if tracked is None:
            return
        tracked.instance = action.instance
        gen = tracked.gen
        sched = tracked.sched
        self._send(
            action.instance,
            EnqueuePrefill(gen.request_id, gen.model, action.group_id,
                           list(gen.prompt_token_ids), tracked.sampling, gen.arrival_s,
                           priority=sched.priority, ttft_s=sched.ttft_s or 0.0,
                           tbt_s=sched.tbt_s or 0.0),
        )  # fmt: skip

    def _place_decode(self, action: PlaceDecode) -> None:
        tracked = self.backend.requests.get(action.request.request_id)
        if tracked is None or tracked.handoff is None or tracked.first_token_id is None:
            return
        tracked.instance = action.instance
        gen = tracked.gen
        self._send(
            action.instance,
            EnqueueDecode(
                request_id=gen.request_id, model=gen.model, batch_id=action.batch_id,
                prompt_len=len(gen.prompt_token_ids), first_token_id=tracked.first_token_id,
                num_generated=tracked.num_generated, sampling=tracked.sampling,
                handoff=tracked.handoff, arrival_s=gen.arrival_s,
                priority=tracked.sched.priority, ttft_s=tracked.sched.ttft_s or 0.0,
                tbt_s=tracked.sched.tbt_s or 0.0, **tracked.decode_fields(),
            ),
        )  # fmt: skip

    def _run_on_instance(self, action: RunOnInstance) -> None:
        tracked = self.backend.requests.get(action.request.request_id)
        if tracked is None:
            return
        tracked.instance = action.instance
        gen = tracked.gen
        self._send(
            action.instance,
            RunRequest(gen.request_id, gen.model, list(gen.prompt_token_ids), tracked.sampling,
                       gen.arrival_s),
        )  # fmt: skip

    def _cancel(self, action: Cancel) -> None:
        self._send(action.instance, CancelRequest(action.request_id))

    def _reject(self, action: Reject) -> None:
        self.backend.end_request(action.request.request_id, "error", action.reason,
                                 action.code or None)
