"""Models added and removed at run time, the cluster backend's half (model lifecycle);
and models put to sleep and woken on the devices (``/sleep``, ``/wake_up``).

The admin endpoints (``aegaeon_proxy.admin_models``) decide; this carries it
out on one node: the cachemgr learns or forgets the model (``RegisterModel``,
``ForgetModel``) and takes the operator's flags (``SetModelFlags``); every
instance is told (``AddModel``) and answers with its models
(``InstanceModels``), which update the proxy's view of it (KV capacity per
model: the context bound) and the policy (the model's spec in the latency
model, each decode instance's capacity). An instance or cachemgr that
restarts comes back with the config file's models: a hello that lacks a
model added here gets it again, and models removed here are forgotten again.

A model sleeps when it is on no instance's device (the instances report the
models on their device with every heartbeat and answer each
``SetModelAwake``): sleeping sends it to every live instance, waking to the
least busy prefill instance (where the model's next request starts).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from aegaeon_common.config import Config, ModelConfig
from aegaeon_common.logs import get_logger
from aegaeon_common.messages.cache import (
    CacheStats,
    ForgetModel,
    GetStats,
    ModelForgotten,
    RegisterModel,
    SetModelFlags,
)
from aegaeon_common.messages.prefill import AddModel, SetModelAwake
from aegaeon_common.messages.report import InstanceHello, InstanceModels, ModelsResident
from aegaeon_common.transport import RemoteError, RpcClient
from aegaeon_common.wire import Message, to_plain
from aegaeon_sched import DecodeDispatcher, LatencyModel, Policy

from aegaeon_proxy.backend import BackendError
from aegaeon_proxy.cluster.instances import Instances, InstanceView

log = get_logger("cluster")

CACHE_TIMEOUT_S = 10.0
# every live instance serves an added model within this (it reads the model's
# config between two steps; the weights come at its first switch)
ADD_TIMEOUT_S = 60.0
# an instance answers a sleep or a wake between two steps; a wake loads the weights
# (from disk when the Model Cache does not hold them)
AWAKE_TIMEOUT_S = 60.0

# cachemgr ErrorReply codes -> (HTTP status, error code) of the admin endpoints
_CACHE_ERRORS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "model_not_found"),
    "model_cache_full": (409, "model_cache_full"),
    "checkpoint_error": (422, "model_unavailable"),
}

__all__ = ["ClusterModels"]


def _wake_rank(view: InstanceView) -> tuple[bool, int]:
    """Prefill instances first (a model's next request starts there), least work first."""
    stats = view.stats
    work = stats.queued + stats.running if stats is not None else 0
    return view.kind != "prefill", work


def cache_error(exc: RemoteError) -> BackendError:
    status, code = _CACHE_ERRORS.get(exc.code, (503, "unavailable"))
    return BackendError(f"cachemgr: {exc}", status=status, code=code)


class ClusterModels:
    """Adds, removes and flags models on the node the cluster backend drives: its
    ``instances``, its cachemgr client, ``send`` (the backend's ordered sends to an
    instance) and ``policy`` (the policy now; None until every instance said hello)."""

    def __init__(
        self,
        config: Config,
        instances: Instances,
        cache: RpcClient,
        send: Callable[[str, Message], None],
        policy: Callable[[], Policy | None],
    ) -> None:
        self.config = config
        self.instances = instances
        self._cache = cache
        self._send = send
        self._policy = policy
        self.added: dict[str, ModelConfig] = {}  # models added here (not in the config)
        self.removed: set[str] = set()  # configured models removed here
        self._sent: Counter[str] = Counter()  # AddModels sent, per instance
        self._answers: Counter[str] = Counter()  # InstanceModels received, per instance
        self._awake_sent: Counter[str] = Counter()  # SetModelAwakes sent, per instance
        self._awake_answered: Counter[str] = Counter()  # the last ticket each answered
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _call(self, msg: Message) -> Message:
        try:
            return await self._cache.call(msg, timeout_s=CACHE_TIMEOUT_S)
        except TimeoutError:
            raise BackendError.unavailable("the cachemgr did not answer") from None
        except RemoteError as exc:
            raise cache_error(exc) from None

    # ---- the admin endpoints' operations ------------------------------------
    async def add(self, model: ModelConfig) -> None:
        """Register ``model`` with the cachemgr, tell every instance, and wait until
        every live one serves it (a BackendError names the one that cannot)."""
        if self._policy() is None:
            raise BackendError.unavailable("the instances are not all up yet")
        await self._call(RegisterModel(model.name, str(model.path)))
        self.added[model.name] = model
        self.removed.discard(model.name)
        tickets = {view.name: self._send_add(view, model) for view in self.instances}

        def waiting() -> list[str]:
            names: list[str] = []
            for view in self.instances:
                if view.pid is None or self._serves(view, model.name):
                    continue  # down (its successor's hello gets it) or done
                if self._answers[view.name] >= tickets[view.name]:
                    raise BackendError(
                        f"instance {view.name} cannot serve model '{model.name}' from "
                        f"{model.path} (see its log)", status=422, code="model_unavailable",
                    )  # fmt: skip
                names.append(view.name)
            return names

        await self._until(waiting, f"take model '{model.name}'", ADD_TIMEOUT_S)

    async def forget(self, name: str) -> bool:
        """The cachemgr forgets ``name`` (its last request ended); True: evicted now."""
        reply = await self._call(ForgetModel(name))
        self.added.pop(name, None)
        if self.config.model(name) is not None:
            self.removed.add(name)
        return isinstance(reply, ModelForgotten) and reply.evicted

    async def set_flags(self, name: str, *, pinned: bool, preload: bool) -> None:
        await self._call(SetModelFlags(name, pinned=pinned, preload=preload))

    def sleeping(self, name: str) -> bool:
        """``name`` is on no live instance's device (as they last reported)."""
        return not any(name in v.resident for v in self.instances if v.pid is not None)

    async def set_awake(self, name: str, awake: bool) -> bool:
        """Sleep ``name`` on every live instance, or wake it on the least busy
        prefill instance (none, if it is on a device already); returns once they
        answered whether it sleeps now."""
        live = [v for v in self.instances if v.pid is not None]
        if not live:
            raise BackendError.unavailable("no instance is up")
        if awake:
            if not self.sleeping(name):
                return False
            targets = [min(live, key=_wake_rank)]
        else:
            targets = live
        tickets = {}
        for view in targets:
            self._awake_sent[view.name] += 1
            tickets[view.name] = self._awake_sent[view.name]
            self._send(view.name, SetModelAwake(name, awake, tickets[view.name]))
        await self._until(
            lambda: [v.name for v in targets
                     if v.pid is not None and self._awake_answered[v.name] < tickets[v.name]],
            f"{'wake' if awake else 'sleep'} model '{name}'",
        )  # fmt: skip
        return self.sleeping(name)

    async def _until(self, waiting: Callable[[], list[str]], what: str,
                     timeout_s: float = AWAKE_TIMEOUT_S) -> None:  # fmt: skip
        """Until ``waiting()`` names no instance (answers arrive), at most ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while names := waiting():
            changed = self._changed
            try:
                async with asyncio.timeout_at(deadline):
                    await changed.wait()
            except TimeoutError:
                raise BackendError.unavailable(
                    f"instances {', '.join(names)} did not {what} within {timeout_s:g} s"
                ) from None

    def on_models_resident(self, msg: ModelsResident) -> None:
        view = self.instances.get(msg.kind, msg.index)
        if view is None or view.pid is None:
            return
        view.note_residency(msg.resident_models, msg.residency_version)
        self._awake_answered[view.name] = max(self._awake_answered[view.name], msg.ticket)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def cache_stats(self) -> dict[str, Any] | None:
        with contextlib.suppress(BackendError):
            reply = await self._call(GetStats())
            if isinstance(reply, CacheStats):
                stats = to_plain(reply.model_cache)
                assert isinstance(stats, dict)
                return stats
        return None

    # ---- reports --------------------------------------------------------------
    def _send_add(self, view: InstanceView, model: ModelConfig) -> int:
        self._sent[view.name] += 1
        self._send(view.name, AddModel(model.name, str(model.path)))
        return self._sent[view.name]

    @staticmethod
    def _serves(view: InstanceView, name: str) -> bool:
        return view.hello is not None and name in view.hello.capacity_tokens

    def on_instance_models(self, msg: InstanceModels) -> None:
        """An instance's models after an ``AddModel``: its KV capacity per model (the
        context bound, the decode dispatcher's room) and the new models' specs."""
        view = self.instances.get(msg.kind, msg.index)
        if view is None or view.hello is None:
            return
        view.hello = msgspec.structs.replace(
            view.hello, capacity_tokens=dict(msg.capacity_tokens),
            latency=msg.latency or view.hello.latency,
        )  # fmt: skip
        self._answers[view.name] += 1
        self._teach_policy(view.name, msg)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _teach_policy(self, instance: str, msg: InstanceModels) -> None:
        policy = self._policy()
        if policy is None:
            return
        latency = getattr(policy, "latency", None)
        if isinstance(latency, LatencyModel) and msg.latency is not None:
            specs = LatencyModel.from_dict(to_plain(msg.latency)).specs
            for name, spec in specs.items():
                latency.specs.setdefault(name, spec)
        dispatcher = getattr(policy, "decode", None)
        if isinstance(dispatcher, DecodeDispatcher) and instance in dispatcher.work_lists:
            for model, tokens in msg.capacity_tokens.items():
                dispatcher.set_capacity(instance, model, tokens)
        capacity = getattr(policy, "capacity_tokens", None)  # the request-level policies
        if isinstance(capacity, dict):
            for model, tokens in msg.capacity_tokens.items():
                capacity[model] = min(capacity.get(model, tokens), tokens)

    def on_hello(self, view: InstanceView, msg: InstanceHello) -> None:
        """A (re)started instance knows only the config's models: give it those added
        here, and have the cachemgr (which may have restarted too) forget the removed."""
        missing = [m for n, m in self.added.items() if n not in msg.capacity_tokens]
        if not missing and not self.removed:
            return

        async def resync() -> None:
            for name in sorted(self.removed):
                with contextlib.suppress(BackendError):
                    await self._call(ForgetModel(name))
            for model in missing:
                try:
                    await self._call(RegisterModel(model.name, str(model.path)))
                except BackendError as exc:
                    log.warning("model_resync_failed", model=model.name, error=exc.message)
                self._send_add(view, model)
            log.info("models_resynced", instance=view.name, added=[m.name for m in missing],
                     removed=sorted(self.removed))  # fmt: skip

        task = asyncio.get_running_loop().create_task(resync())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
