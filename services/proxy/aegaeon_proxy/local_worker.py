"""The worker thread of :class:`~aegaeon_proxy.local_backend.LocalEngineBackend`.

Request-level FCFS over one loaded model at a time: requests are admitted in
arrival order while they are for the loaded model (continuous batching); when
the oldest waiting request is for another model, admission stops, the running
batch drains, and the worker switches to that model. Commands arrive on a
thread-safe queue; results leave through ``deliver`` (which must be safe to
call from this thread). Never runs on the event loop.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aegaeon_common.config import ModelConfig
from aegaeon_common.logs import get_logger

from aegaeon_proxy.backend import FinishReason, GenerationRequest, TokenChunk
from aegaeon_proxy.local_stepper import EngineStepper, StepEvent

log = get_logger("proxy.local")

__all__ = ["Cancel", "Command", "LocalWorker", "Shutdown", "Submit", "WorkerStats"]


@dataclass(frozen=True)
class Submit:
    req: GenerationRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Submit | Cancel | Shutdown
Deliver = Callable[[str, TokenChunk], None]
MakeStepper = Callable[[ModelConfig], EngineStepper]


@dataclass
class WorkerStats:
    """Counters the event loop reads (plain ints: a racy read is only stale)."""

    loaded_model: str | None = None
    num_waiting: int = 0
    num_running: int = 0
    num_switches: int = 0
    num_steps: int = 0
    num_tokens: int = 0


class LocalWorker:
    """Owns the engine; ``run`` is the thread's body."""

    def __init__(
        self, models: Mapping[str, ModelConfig], make_stepper: MakeStepper, deliver: Deliver
    ) -> None:
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.stats = WorkerStats()
        self._models = dict(models)
        self._make_stepper = make_stepper
        self._deliver = deliver
        self._waiting: dict[str, GenerationRequest] = {}  # insertion order = arrival order
        self._stepper: EngineStepper | None = None
        self._stopping = False
        self._handlers: dict[type, Callable[[Any], None]] = {
            Submit: self._on_submit,
            Cancel: self._on_cancel,
            Shutdown: self._on_shutdown,
        }

    def run(self) -> None:
        while True:
            busy = bool(self._waiting) or self._num_running() > 0
            self._drain(block=not busy)
            if self._stopping:
                self._cancel_everything()
                return
            self._admit()
            self._decode()
            self.stats.num_waiting = len(self._waiting)
            self.stats.num_running = self._num_running()

    # -- commands ---------------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        if block:
            cmd = self.inbox.get()
            self._handlers[type(cmd)](cmd)
        while True:
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handlers[type(cmd)](cmd)

    def _on_submit(self, cmd: Submit) -> None:
        self._waiting[cmd.req.request_id] = cmd.req

    def _on_cancel(self, cmd: Cancel) -> None:
        rid = cmd.request_id
        waiting = self._waiting.pop(rid, None) is not None
        if waiting or (self._stepper is not None and self._stepper.abort(rid)):
            self._finish(rid, "cancelled")

    def _on_shutdown(self, cmd: Shutdown) -> None:
        self._stopping = True

    # -- scheduling -------------------------------------------------------------------------

    def _num_running(self) -> int:
        return self._stepper.num_running if self._stepper is not None else 0

    def _admit(self) -> None:
        while self._waiting:
            rid, req = next(iter(self._waiting.items()))
            if self._stepper is None or self._stepper.model != req.model:
                if self._num_running() > 0:
                    return  # FCFS: drain the loaded model's batch before switching
                if not self._switch(req.model):
                    continue
            stepper = self._stepper
            assert stepper is not None
            if not stepper.fits_ever(len(req.prompt_token_ids), req.sampling):
                del self._waiting[rid]
                self._finish(rid, "error", "the request needs more KV cache than the backend has")
                continue
            try:
                event = stepper.try_admit(rid, req.prompt_token_ids, req.sampling)
            except Exception as exc:  # an engine failure fails this request, not the worker
                log.exception("prefill_failed", request_id=rid)
                del self._waiting[rid]
                self._finish(rid, "error", f"prefill failed: {exc}")
                continue
            if event is None:
                return  # the batch or the cache is full; decode frees room
            del self._waiting[rid]
            self._emit(event)

    def _switch(self, model: str) -> bool:
        """Load ``model`` in place of the current one; on failure fail its waiting requests."""
        self._stepper = None  # drop the old weights and KV before allocating new ones
        self.stats.loaded_model = None
        try:
            self._stepper = self._make_stepper(self._models[model])
        except Exception as exc:  # a model that cannot load fails its requests, not the worker
            log.exception("model_load_failed", model=model)
            for rid in [r for r, q in self._waiting.items() if q.model == model]:
                del self._waiting[rid]
                self._finish(rid, "error", f"model {model!r} failed to load: {exc}")
            return False
        self.stats.loaded_model = model
        self.stats.num_switches += 1
        log.info("model_loaded", model=model)
        return True

    def _decode(self) -> None:
        if self._stepper is None or self._stepper.num_running == 0:
            return
        try:
            events = self._stepper.step()
        except Exception as exc:  # fail the batch; the worker keeps serving
            log.exception("decode_failed", model=self._stepper.model)
            for rid in self._stepper.abort_all():
                self._finish(rid, "error", f"decode failed: {exc}")
            return
        self.stats.num_steps += 1
        for event in events:
            self._emit(event)

    # -- results ----------------------------------------------------------------------------

    def _emit(self, event: StepEvent) -> None:
        self.stats.num_tokens += 1
        self._deliver(event.request_id, TokenChunk((event.token_id,), event.finish_reason))

    def _finish(self, rid: str, reason: FinishReason, error: str | None = None) -> None:
        self._deliver(rid, TokenChunk((), reason, error))

    def _cancel_everything(self) -> None:
        for rid in list(self._waiting):
            self._finish(rid, "cancelled")
        self._waiting.clear()
        if self._stepper is not None:
            for rid in self._stepper.abort_all():
                self._finish(rid, "cancelled")
        self._stepper = None
