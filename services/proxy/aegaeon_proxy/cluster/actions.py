"""Carrying out a request-level baseline's actions as messages to instances, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.decode import RunRequest
from aegaeon_common.messages.prefill import CancelRequest
from aegaeon_common.wire import Message
from aegaeon_sched import Action, Cancel, Reject, RunOnInstance

from aegaeon_proxy.cluster.instances import Instances, InstanceView
from aegaeon_proxy.cluster.tracked import Tracked

# work for one instance process (``incarnation``), never for its successor
STAMPED = (RunRequest,)


class ActionHost(Protocol):
    """What the runner needs of the backend (``cluster.backend.ClusterBackend``)."""

    @property
    def instances(self) -> Instances: ...

    @property
    def requests(self) -> Mapping[str, Tracked]: ...

    def end_request(self, request_id: str, reason: str, error: str | None = None,
                    code: str | None = None) -> object: ...

log = get_logger("cluster")


class ActionRunner:
    """Turns actions into messages; one ordered outgoing queue for all instances."""

    def __init__(self, backend: ActionHost) -> None:
        self.backend = backend
        self._out: asyncio.Queue[tuple[InstanceView, Message]] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._table = {
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
    def _run_on_instance(self, action: RunOnInstance) -> None:
        tracked = self.backend.requests.get(action.request.request_id)
        if tracked is not None:
            tracked.instance = action.instance
            self._send(action.instance, tracked.run_message())

    def _cancel(self, action: Cancel) -> None:
        self._send(action.instance, CancelRequest(action.request_id))

    def _reject(self, action: Reject) -> None:
        self.backend.end_request(action.request.request_id, "error", action.reason,
                                 action.code or None)
