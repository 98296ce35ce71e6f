"""A tensor-parallel group driven as one engine: rank 0 drives, the other ranks mirror.

The driver (rank 0: the instance's worker, whose loops, scheduler and
sampler stay as they are) calls ``bind``/``prefill``/``decode`` on a
``TPDriver`` as on an ``Engine``. Each call on a sharded model is first
broadcast to the followers as int64 words on the group's control group
(gloo, also beside NCCL: a few words need no device), then run on the
driver's shard; the followers (``follow``) run the same call on theirs, and
the all-reduces inside keep them in step. The driver alone reads the logits
(every rank computes the same ones).

A model is named by an index both sides agree on (the instance's model list);
``bind`` callbacks do each rank's part of a switch (copy its shard, bind it)
and say whether the model is sharded. A single-device model is bound on the
driver alone: the followers are told, then idle until the next switch.

Words of one command: ``[op, n]`` then ``n`` payload words:
``BIND model``, ``PREFILL start_pos n_tokens tokens... blocks...``,
``DECODE batch (token position n_blocks blocks...)*``, ``STOP``; a caller's own
ops (above ``FIRST_EXTRA_OP``) with its own words (``send_command``, and
``follow``'s ``extra`` handlers: a worker mirrors its switcher's prefetches).

``MirroredEngine`` is the driver as an ``Engine``: rank 0's engine itself, whose
``prefill`` and ``decode`` are broadcast first whenever the bound model is a
shard (bound with the group's all-reduce), so the code that drives a single
engine drives a group unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .engine import DecodeSeq, Engine
from .sampling import TokenLogprobs
from .tp import TPGroup

BIND, PREFILL, DECODE, STOP = 1, 2, 3, 4
FIRST_EXTRA_OP = 16  # ops from here on are a caller's own (follow's ``extra``)

# bind(model index) -> whether the model is sharded over the group (this rank's part
# of a switch: copy its shard and bind it; a follower does nothing for an unsharded one)
BindFn = Callable[[int], bool]


def _send(group: TPGroup, words: list[int]) -> None:
    header = torch.tensor([words[0], len(words) - 1], dtype=torch.int64)
    dist.broadcast(header, 0, group=group.control)
    if len(words) > 1:
        dist.broadcast(torch.tensor(words[1:], dtype=torch.int64), 0, group=group.control)


def _receive(group: TPGroup) -> tuple[int, list[int]]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, 0, group=group.control)
    op, n = int(header[0]), int(header[1])
    payload = torch.empty(n, dtype=torch.int64)
    if n:
        dist.broadcast(payload, 0, group=group.control)
    return op, payload.tolist()


def send_command(group: TPGroup, op: int, words: Sequence[int] = ()) -> None:
    """Broadcast one command (rank 0); the followers' ``follow`` runs it."""
    _send(group, [op, *words])


def send_prefill(group: TPGroup, token_ids: Sequence[int], block_ids: Sequence[int],
                 start_pos: int = 0) -> None:
    _send(group, [PREFILL, start_pos, len(token_ids), *token_ids, *block_ids])


def send_decode(group: TPGroup, seqs: Sequence[DecodeSeq]) -> None:
    words = [DECODE, len(seqs)]
    for s in seqs:
        words += [s.token_id, s.position, len(s.block_ids), *s.block_ids]
    _send(group, words)


class MirroredEngine(Engine):
    """Rank 0's engine of a group (module docstring): ``group`` set once the group is
    joined; until then, and for a model bound without ``reduce``, a plain engine."""

    group: TPGroup | None = None

    def _mirrored(self) -> TPGroup | None:
        bound = self._bound
        return self.group if bound is not None and bound.reduce is not None else None

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int],
                start_pos: int = 0) -> torch.Tensor:
        group = self._mirrored()
        if group is not None:
            send_prefill(group, token_ids, block_ids, start_pos)
        return super().prefill(token_ids, block_ids, start_pos)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        group = self._mirrored()
        if group is not None:
            send_decode(group, seqs)
        return super().decode(seqs)


class TPDriver:
    """Rank 0 of a group: an engine-like facade whose calls every rank runs."""

    def __init__(self, engine: Engine, group: TPGroup, bind: BindFn) -> None:
        if group.rank != 0:
            raise ValueError(f"the driver is rank 0, this is rank {group.rank}")
        self.engine, self.group, self._bind = engine, group, bind
        self.sharded = False  # whether the bound model spans the group

    def bind(self, model: int) -> None:
        """Switch every rank to model ``model`` (the followers first hear of it)."""
        _send(self.group, [BIND, model])
        self.sharded = self._bind(model)

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int],
                start_pos: int = 0) -> torch.Tensor:
        """``Engine.prefill`` on every rank; the last position's logits."""
        if self.sharded:
            send_prefill(self.group, token_ids, block_ids, start_pos)
        return self.engine.prefill(token_ids, block_ids, start_pos)

    def prefill_scored(self, token_ids: Sequence[int], block_ids: Sequence[int], k: int,
                       start_pos: int = 0) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        """``Engine.prefill_scored`` here, ``Engine.prefill`` on the followers (the
        scores are rank 0's: every rank holds the whole lm_head)."""
        if self.sharded:
            _send(self.group, [PREFILL, start_pos, len(token_ids), *token_ids, *block_ids])
        return self.engine.prefill_scored(token_ids, block_ids, k, start_pos)

    def decode(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """``Engine.decode`` on every rank; logits ``[B, vocab]``."""
        if self.sharded:
            send_decode(self.group, seqs)
        return self.engine.decode(seqs)

    def close(self) -> None:
        """End the followers' loops (they return from ``follow``)."""
        _send(self.group, [STOP])


def follow(engine: Engine, group: TPGroup, bind: BindFn,
           extra: Mapping[int, Callable[[list[int]], object]] | None = None) -> None:
    """A follower's whole loop: receive a command, run it, until ``STOP``. ``extra``:
    handlers of the caller's own ops (``op >= FIRST_EXTRA_OP``: ``send_command``)."""
    handlers: dict[int, Callable[[list[int]], object]] = {
        BIND: lambda w: bind(w[0]),
        PREFILL: lambda w: _prefill(engine, w),
        DECODE: lambda w: _decode(engine, w),
    }
    for own, handler in (extra or {}).items():
        if own < FIRST_EXTRA_OP:
            raise ValueError(f"op {own} is the mirror's own (a caller's start at "
                             f"{FIRST_EXTRA_OP})")  # fmt: skip
        handlers[own] = handler
    while True:
        op, words = _receive(group)
        if op == STOP:
            return
        run = handlers.get(op)
        if run is None:
            raise ValueError(f"rank {group.rank}: unknown tensor-parallel command {op}")
        try:
            run(words)
        except ValueError:
            # a call's arguments the engine refuses (block ids, lengths): it checks
            # them before any collective, so the driver refused the same call at the
            # same point and told its caller; the group stays in step
            continue


def _prefill(engine: Engine, words: list[int]) -> None:
    start_pos, n = words[0], words[1]
    engine.prefill(words[2:2 + n], words[2 + n:], start_pos)


def _decode(engine: Engine, words: list[int]) -> None:
    seqs, at = [], 1
    for _ in range(words[0]):
        token, position, n = words[at:at + 3]
        seqs.append(DecodeSeq(token, position, words[at + 3:at + 3 + n]))
        at += 3 + n
    engine.decode(seqs)
