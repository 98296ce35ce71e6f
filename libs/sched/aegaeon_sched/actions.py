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
  instance's prefill job queue; an unknown group id opens a group at the tail
  (the instance mirrors the queue with :class:`~aegaeon_sched.prefill.PrefillQueue`).
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aegaeon_sched.request import InstanceId, Request


@dataclass(frozen=True)
class EnqueuePrefill:
    instance: InstanceId
    group_id: int
    request: Request


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
