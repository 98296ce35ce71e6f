"""The policy contract: events in, actions out.

A driver (the proxy live, the simulator offline) owns the clock and the
instances; a :class:`Policy` owns the decisions. The driver calls one ``on_*``
method per event, with the current time, and carries out the returned actions
in order. Policies never read a clock, never sleep, never do I/O.

Events (all return ``list[Action]``):

- ``on_arrival(request, now_s)`` -- a new request, already tokenized.
- ``on_prefill_started(instance, request_id, now_s)`` -- a prefill instance
  began a request's prefill (it took it from its own mirror of the queue).
- ``on_prefill_done(instance, request_id, measured_s, now_s)`` -- the first
  token exists and the prompt's KV is on its way to the host cache;
  ``measured_s`` is the prefill's compute time (refines the estimators).
- ``on_request_finished(request_id, now_s)`` -- the last token was emitted
  (or the request failed on its instance).
- ``on_request_cancelled(request_id, now_s)`` -- the client went away.

Actions:

- :class:`EnqueuePrefill` -- add the request to group ``group_id`` of the
  instance's prefill job queue; an unknown group id opens a group at its key's
  place, ``group_key_s`` (the instance mirrors the queue with
  :class:`~aegaeon_sched.prefill.PrefillQueue`; a group the instance finished
  while the request travelled reopens where the policy's copy still has it).
- :class:`PlaceDecode` -- add the prefilled request to batch ``batch_id`` of
  the decode instance's work list; an unknown batch id opens a batch at the
  tail (mirror: :class:`~aegaeon_sched.decode.DecodeWorkList`).
- :class:`RunOnInstance` -- request-level policies: run the whole request
  (prefill and decode) on a unified instance serving ``model``; the instance
  switches to ``model`` first if it holds another one (the policy only does
  this when the instance is idle).
- :class:`Cancel` -- drop the request on that instance, free what it holds.
- :class:`Reject` -- the request cannot be served (no instance may ever run
  its model); answer the client with an error.

Invariants: every request gets exactly one of EnqueuePrefill / RunOnInstance /
Reject or waits in the policy's own queue until a later event releases it;
actions for one instance are ordered as returned.

What a driver may tell every policy besides the events (:class:`PolicyBase`
holds what a policy that ignores them does, so a driver never asks a policy
what it supports): an instance pauses (drains, dies) and resumes; an
instance serves models with so much KV room (``learn``); the decode share a
hybrid instance's prefills leave it; a role change (``set_role``), for the
policies whose :meth:`role_load` is not None (the roles' inputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aegaeon_sched.request import InstanceId, Request

if TYPE_CHECKING:
    from aegaeon_sched.latency import LatencyModel


@dataclass(frozen=True)
class EnqueuePrefill:
    instance: InstanceId
    group_id: int
    request: Request
    group_key_s: float | None = None  # the group's place in the queue (None: the request's)


@dataclass(frozen=True)
class PlaceDecode:
    instance: InstanceId
    batch_id: int
    request: Request


@dataclass(frozen=True)
class RunOnInstance:
    instance: InstanceId
    request: Request
    model: str


@dataclass(frozen=True)
class Cancel:
    instance: InstanceId
    request_id: str


@dataclass(frozen=True)
class Reject:
    request: Request
    reason: str
    # why, for the client: "no_slot" (static multiplexing placed its model nowhere: a 503
    # naming the placed models), "" otherwise
    code: str = ""


Action = EnqueuePrefill | PlaceDecode | RunOnInstance | Cancel | Reject


@dataclass(frozen=True)
class RoleLoad:
    """What prefill/decode role switching reads of a policy: the prompt tokens waiting
    for a prefill, each decode work list's demand (Eq. 3), the latency profile."""

    backlog_tokens: int
    decode_demand: Mapping[InstanceId, float]
    latency: LatencyModel


class Policy(Protocol):
    """A global scheduling policy (see the module docstring for the contract)."""

    @property
    def name(self) -> str: ...

    def on_arrival(self, request: Request, now_s: float) -> list[Action]: ...

    def on_prefill_started(
        self, instance: InstanceId, request_id: str, now_s: float
    ) -> list[Action]: ...

    def on_prefill_done(
        self, instance: InstanceId, request_id: str, measured_s: float, now_s: float
    ) -> list[Action]: ...

    def on_request_finished(self, request_id: str, now_s: float) -> list[Action]: ...

    def on_request_cancelled(self, request_id: str, now_s: float) -> list[Action]: ...

    # ---- the rest of the contract (PolicyBase: what a policy ignoring them does) --
    def pause(self, instance: InstanceId) -> list[Action]: ...

    def resume(self, instance: InstanceId, now_s: float) -> list[Action]: ...

    def held_counts(self) -> tuple[int, int]: ...

    def learn(self, instance: InstanceId, capacity_tokens: Mapping[str, int],
              latency: LatencyModel | None) -> None: ...  # fmt: skip

    def set_decode_share(self, instance: InstanceId, share: float) -> None: ...

    def role_load(self) -> RoleLoad | None: ...

    def set_role(self, instance: InstanceId, role: str, now_s: float) -> list[Action]: ...

    def state(self) -> dict[str, Any]: ...

    def restore_state(self, state: dict[str, Any]) -> None: ...


class PolicyBase:
    """The defaults of :class:`Policy`'s optional part: a policy overrides what it uses."""

    def on_prefill_started(
        self, instance: InstanceId, request_id: str, now_s: float
    ) -> list[Action]:
        """A prefill began on ``instance`` (a policy without prefill queues ignores it)."""
        return []

    def on_prefill_done(
        self, instance: InstanceId, request_id: str, measured_s: float, now_s: float
    ) -> list[Action]:
        """A prefill ended after ``measured_s`` (ignored as ``on_prefill_started``)."""
        return []

    def pause(self, instance: InstanceId) -> list[Action]:
        """``instance`` takes no new work (it drains, or died)."""
        return []

    def resume(self, instance: InstanceId, now_s: float) -> list[Action]:
        """``instance`` takes work again (its held work goes out now)."""
        return []

    def held_counts(self) -> tuple[int, int]:
        """Requests held in the policy: (waiting for a prefill instance, for a decode one)."""
        return 0, 0

    def learn(self, instance: InstanceId, capacity_tokens: Mapping[str, int],
              latency: LatencyModel | None) -> None:  # fmt: skip
        """``instance`` serves these models with that much device KV room (tokens);
        ``latency``: its profile, with the specs of models added at run time."""

    def set_decode_share(self, instance: InstanceId, share: float) -> None:
        """The part of each round a hybrid instance's prefills leave to its decoding."""

    def role_load(self) -> RoleLoad | None:
        """The inputs of role switching; None: roles do not move under this policy."""
        return None

    def set_role(self, instance: InstanceId, role: str, now_s: float) -> list[Action]:
        raise ValueError(f"roles do not move under this policy ({instance!r} to {role})")

    def state(self) -> dict[str, Any]:
        """The picture it keeps between events, as plain data a store holds (a
        request-level baseline's: ``aegaeon_sched.shared_baselines``)."""
        raise TypeError(f"policy {type(self).__name__} keeps no baseline state")

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state`'s picture (freshly built, with its instances)."""
        raise TypeError(f"policy {type(self).__name__} keeps no baseline state")
