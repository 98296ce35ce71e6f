"""The simulated proxy: feeds a policy events and carries out its actions on real instance loops.

As the live proxy (services/proxy ``cluster``), it hands each arrival to the
policy, turns the policy's actions into the instances' commands
(``EnqueuePrefill``, ``EnqueueDecode`` with the prefill's KV handoff,
``RunRequest``) and the instances' messages into the policy's events
(``PrefillDone`` -> ``on_prefill_done``, a request's last token or its failure
-> ``on_request_finished``); the instances are the services' own loops
(:mod:`aegaeon_sim.instances`) on simulated time (:mod:`aegaeon_sim.events`).
Messages travel at once both ways: an instance sees a command at its next
step boundary, as the live loop reads its inbox between steps.

Each request's token times are those of the messages that carried them (a
decode instance may hold a few steps' tokens and send them together,
``scheduler.token_hold``), as a client sees them less the network.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegaeon_common.messages.decode import EnqueueDecode, RunRequest
from aegaeon_common.messages.prefill import EnqueuePrefill
from aegaeon_common.messages.report import PrefillDone, RequestFailed, StepTokens
from aegaeon_common.messages.structs import KVHandoff, SamplingParams
from aegaeon_common.wire import Message
from aegaeon_sched import (
    Action,
    Cancel,
    PlaceDecode,
    Policy,
    Reject,
    Request,
    RequestTrace,
    RunOnInstance,
)
from aegaeon_sched import EnqueuePrefill as EnqueuePrefillAction

from aegaeon_sim.events import EventLoop
from aegaeon_sim.instances import NodeSetup, SimInstance
from aegaeon_sim.worker import HostBlocks


@dataclass
class Tracked:
    """A request as the simulated proxy follows it."""

    request: Request
    sampling: SamplingParams
    token_times_s: list[float] = field(default_factory=list)
    first_token_id: int = 0
    handoff: KVHandoff | None = None
    ended: bool = False
    failed: str | None = None  # the instance's error code

    def trace(self) -> RequestTrace:
        r = self.request  # it ends by length at its expected output: sampling.max_tokens
        return RequestTrace(r.request_id, r.arrival_s, self.sampling.max_tokens,
                            list(self.token_times_s), self.failed is not None)  # fmt: skip


class _Outbox:
    """One instance's messages to the proxy (the runtime's ``MessageSink`` port)."""

    def __init__(self, sim: Simulation, instance: str) -> None:
        self.sim = sim
        self.instance = instance

    def send(self, msg: Message) -> None:
        self.sim.receive(self.instance, msg)


class Simulation:
    def __init__(self, policy: Policy, requests: Sequence[Request]) -> None:
        self.policy = policy
        self.events = EventLoop()
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.tracked: dict[str, Tracked] = {}
        self.rejected: set[str] = set()
        self.instances: dict[str, SimInstance] = {}
        self.host = HostBlocks()  # the node's unified CPU KV cache
        self._closed = False
        # prompts are never read (the fake engine prices their length): one shared list
        self._prompt: list[int] = []
        self._actions: dict[type, Callable[[Any, float], None]] = {
            EnqueuePrefillAction: self._enqueue_prefill,
            PlaceDecode: self._place_decode,
            RunOnInstance: self._run_on_instance,
            Reject: self._reject,
            Cancel: self._cancel,
        }
        self._messages: dict[type, Callable[[str, Any], None]] = {
            PrefillDone: self._on_prefill_done,
            StepTokens: self._on_step_tokens,
            RequestFailed: self._on_failed,
        }

    # ---- wiring ---------------------------------------------------------
    def add_instance(self, name: str, role: str, node: NodeSetup, **kwargs: Any) -> SimInstance:
        """An instance running its role's loop (:class:`SimInstance`, whose keyword
        arguments ``kwargs`` are)."""
        instance = SimInstance(name, role, node, self.events, self.host, _Outbox(self, name),
                               **kwargs)  # fmt: skip
        self.instances[name] = instance
        return instance

    def adapter_loads(self) -> int:
        """LoRA adapters brought to an instance so far (adapters.py), every instance."""
        return sum(i.worker.adapters.num_loads for i in self.instances.values())

    def schedule(self, at_s: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(now)`` at simulated time ``at_s`` (heartbeats and the like)."""
        self.events.at(at_s, lambda: callback(self.events.now))

    # ---- actions: commands to the instances --------------------------------
    def apply(self, actions: list[Action], now_s: float) -> None:
        for action in actions:
            self._actions[type(action)](action, now_s)

    def _prompt_ids(self, n: int) -> list[int]:
        if len(self._prompt) < n:
            self._prompt = [0] * max(n, 2 * len(self._prompt))
        return self._prompt[:n]

    def _enqueue_prefill(self, action: EnqueuePrefillAction, now_s: float) -> None:
        t = self.tracked[action.request.request_id]
        r = t.request
        self.instances[action.instance].send(EnqueuePrefill(
            r.request_id, r.model, action.group_id, self._prompt_ids(r.prompt_len), t.sampling,
            r.arrival_s, priority=r.priority, ttft_s=r.ttft_s or 0.0, tbt_s=r.tbt_s or 0.0,
            group_key_s=action.group_key_s,
        ))  # fmt: skip

    def _place_decode(self, action: PlaceDecode, now_s: float) -> None:
        t = self.tracked[action.request.request_id]
        r = t.request
        assert t.handoff is not None, f"{r.request_id}: placed for decode before its prefill"
        self.instances[action.instance].send(EnqueueDecode(
            request_id=r.request_id, model=r.model, batch_id=action.batch_id,
            prompt_len=r.prompt_len, first_token_id=t.first_token_id, num_generated=1,
            sampling=t.sampling, handoff=t.handoff, arrival_s=r.arrival_s,
            priority=r.priority, ttft_s=r.ttft_s or 0.0, tbt_s=r.tbt_s or 0.0,
        ))  # fmt: skip

    def _run_on_instance(self, action: RunOnInstance, now_s: float) -> None:
        t = self.tracked[action.request.request_id]
        r = t.request
        self.instances[action.instance].send(
            RunRequest(r.request_id, r.model, self._prompt_ids(r.prompt_len), t.sampling,
                       r.arrival_s)
        )  # fmt: skip

    def _reject(self, action: Reject, now_s: float) -> None:
        self.rejected.add(action.request.request_id)
        t = self.tracked[action.request.request_id]
        t.ended, t.failed = True, "rejected"

    def _cancel(self, action: Cancel, now_s: float) -> None:
        raise RuntimeError("the simulator never cancels requests")

    # ---- messages: events for the policy -----------------------------------
    def receive(self, instance: str, msg: Message) -> None:
        if not self._closed:
            self._messages[type(msg)](instance, msg)

    def _end(self, t: Tracked, now_s: float) -> None:
        t.ended = True
        self.apply(self.policy.on_request_finished(t.request.request_id, now_s), now_s)

    def _on_prefill_done(self, instance: str, msg: PrefillDone) -> None:
        t = self.tracked[msg.request_id]
        now = self.events.now
        t.token_times_s.append(msg.emitted_s)
        t.first_token_id, t.handoff = msg.token_id, msg.handoff
        if msg.finish_reason is not None:
            self._end(t, now)
            return
        measured = msg.timings.extra.get("prefill_compute_s", msg.timings.prefill_s)
        self.apply(self.policy.on_prefill_done(instance, msg.request_id, measured, now), now)

    def _on_step_tokens(self, instance: str, msg: StepTokens) -> None:
        for item in msg.items:
            t = self.tracked[item.request_id]
            if len(item.token_ids) == 1:
                t.token_times_s.append(msg.emitted_s)
            else:  # the tokens of several steps, held and sent together
                t.token_times_s.extend(itertools.repeat(msg.emitted_s, len(item.token_ids)))
            if item.finish_reason is not None:
                self._end(t, self.events.now)

    def _on_failed(self, instance: str, msg: RequestFailed) -> None:
        t = self.tracked[msg.request_id]
        t.failed = msg.code
        self._end(t, self.events.now)

    # ---- the run ----------------------------------------------------------
    def _arrive(self, index: int, end_s: float) -> None:
        r = self.requests[index]
        now = self.events.now
        self.apply(self.policy.on_arrival(r, now), now)
        if index + 1 < len(self.requests) and self.requests[index + 1].arrival_s <= end_s:
            nxt = self.requests[index + 1]
            self.events.at(nxt.arrival_s, lambda: self._arrive(index + 1, end_s))

    def run(self, end_s: float) -> None:
        """Simulate until ``end_s`` (arrivals after it are never delivered)."""
        for r in self.requests:
            output = r.oracle_output_len if r.oracle_output_len is not None else r.max_tokens
            # the request ends by length at its true output (no stop token is sampled)
            self.tracked[r.request_id] = Tracked(r, SamplingParams(max_tokens=output,
                                                                   temperature=0.0))
        for instance in self.instances.values():
            instance.start()
        if self.requests and self.requests[0].arrival_s <= end_s:
            self.events.at(self.requests[0].arrival_s, lambda: self._arrive(0, end_s))
        self.events.run(end_s)
        self._closed = True
        self.events.close()

    def traces(self) -> list[RequestTrace]:
        """Every request's trace, in arrival order."""
        return [self.tracked[r.request_id].trace() for r in self.requests]
