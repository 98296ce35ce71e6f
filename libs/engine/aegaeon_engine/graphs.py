"""Which CUDA graph a decode step replays, and when none may: plain bookkeeping.

No torch, no CUDA: the capturer is passed in (cuda_graphs.CudaCapturer on a GPU,
a fake in tests), so every decision here is tested on the CPU.

A captured decode step reads its weights, the KV region, the rope table and
the static inputs at the device addresses it was captured over, and its
kernels carry the model's constants (head counts, eps, rope). So a graph
belongs to a *slot*: a weight layout (``layout``: every shape, dtype and
constant of the model, its name left out, so two fine-tunes of one base share
it) at one address of the weights arena (``address``), and to a batch size.
A model bound in the slot replays the slot's graphs; a model of another
layout, or the same model at another address, is another slot: it never
replays a graph captured for different bytes. A slot's first step captures
its graphs (every batch size, largest first, sharing the capturer's one memory
pool) and the cost is counted and logged; a capture that fails, a batch
larger than the largest size, or graphs switched off run the step eager, and
say so (``eager_reasons``, the log, the instance's stats).

Batch sizes are rounded up to the captured ``sizes``; the rows beyond the
batch repeat its first row (the caller's static inputs), so they write the
same K/V to the same slot and their logits are dropped.

A switch copies the model's bytes and binds it with the copy's ``ready``
event: the first replay after the bind makes the device wait on it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32)
DEFAULT_MAX_SLOTS = 8

# eager_reasons' keys
EAGER_BATCH = "batch_above_sizes"
EAGER_CAPTURE_FAILED = "capture_failed"
EAGER_UNBOUND = "no_slot"


class Graph(Protocol[T_co]):
    """One captured step: ``replay`` runs it and returns its output."""

    def replay(self) -> T_co: ...


class Capturer(Protocol):
    """Captures steps into graphs sharing one memory pool."""

    def capture(self, run: Callable[[], Any]) -> Graph[Any]:
        """``run`` (reading static inputs, writing static outputs) as a graph."""
        ...

    def release(self, graphs: Sequence[Graph[Any]]) -> None:
        """Free what ``graphs`` hold (their slot was evicted)."""
        ...

    def wait(self, ready: object) -> None:
        """Make the next replay wait on ``ready`` (a copy's event)."""
        ...


class CaptureError(RuntimeError):
    """A capturer could not capture a step (the step then runs eager)."""


@dataclass(frozen=True)
class GraphSlot:
    """Where a graph's bytes are: a weight layout at an address of the arena."""

    layout: Hashable
    address: int


@dataclass
class GraphStats:
    """What the table did so far (the instance's stats, ``/v1/aegaeon/stats``)."""

    enabled: bool
    sizes: tuple[int, ...]
    slots: int = 0  # slots holding graphs now
    captures: int = 0  # graphs captured (every size of a slot counts)
    capture_s: float = 0.0
    last_capture_s: float = 0.0
    evictions: int = 0  # slots whose graphs were freed to make room
    replays: int = 0
    eager_steps: int = 0
    eager_reasons: dict[str, int] = field(default_factory=dict)
    last_eager_reason: str = ""
    disabled_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled, "sizes": list(self.sizes), "slots": self.slots,
            "captures": self.captures, "capture_s": round(self.capture_s, 6),
            "last_capture_s": round(self.last_capture_s, 6), "evictions": self.evictions,
            "replays": self.replays, "eager_steps": self.eager_steps,
            "eager_reasons": dict(self.eager_reasons),
            "last_eager_reason": self.last_eager_reason,
            "disabled_reason": self.disabled_reason,
        }  # fmt: skip


class GraphTable(Generic[T]):
    """Graphs per slot and batch size; see the module docstring.

    ``clock`` times captures (seconds; a test passes a fake).
    """

    def __init__(self, capturer: Capturer, sizes: Sequence[int] = DEFAULT_SIZES,
                 max_slots: int = DEFAULT_MAX_SLOTS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not sizes or min(sizes) < 1 or max_slots < 1:
            raise ValueError(f"graph sizes must be >= 1 and max_slots >= 1, got {sizes}, "
                             f"{max_slots}")
        self.capturer = capturer
        self.sizes = tuple(sorted(set(sizes)))
        self.max_slots = max_slots
        self._clock = clock
        self._graphs: OrderedDict[GraphSlot, dict[int, Graph[T]]] = OrderedDict()  # LRU first
        self._failed: dict[GraphSlot, str] = {}
        self._bound: GraphSlot | None = None
        self._ready: object | None = None
        self._logged: set[str] = set()
        self.stats = GraphStats(enabled=True, sizes=self.sizes)

    # ---- queries --------------------------------------------------------------------
    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def round_up(self, batch: int) -> int | None:
        """The captured size a batch of ``batch`` replays (None: above every size)."""
        return next((s for s in self.sizes if s >= batch), None)

    def has(self, slot: GraphSlot) -> bool:
        return slot in self._graphs

    def addresses(self, layout: Hashable) -> list[int]:
        """Addresses holding graphs of ``layout``, the most recently used first."""
        return [s.address for s in reversed(self._graphs) if s.layout == layout]

    @property
    def bound(self) -> GraphSlot | None:
        return self._bound

    # ---- binding --------------------------------------------------------------------
    def bind(self, slot: GraphSlot, ready: object | None = None) -> None:
        """A model is bound in ``slot`` now; its bytes are there once ``ready`` fires."""
        self._bound = slot
        self._ready = ready

    def unbind(self) -> None:
        self._bound, self._ready = None, None

    def invalidate(self, why: str) -> None:
        """Drop every graph (what they read moved: the KV region, the static inputs)."""
        if self._graphs:
            log.info("CUDA graphs dropped (%d slots): %s", len(self._graphs), why)
        for graphs in self._graphs.values():
            self.capturer.release(list(graphs.values()))
        self._graphs.clear()
        self._failed.clear()
        self.stats.slots = 0

    # ---- capture --------------------------------------------------------------------
    def capture(self, slot: GraphSlot, make_run: Callable[[int], Callable[[], T]]) -> bool:
        """Capture ``slot``'s graphs now (every size, largest first): ``make_run(size)`` is
        the step of that size over the static inputs. False (and the reason kept) if
        the capturer failed; nothing is captured twice."""
        if slot in self._graphs:
            return True
        if slot in self._failed:
            return False
        while len(self._graphs) >= self.max_slots:
            old, dropped = self._graphs.popitem(last=False)
            self.capturer.release(list(dropped.values()))
            self.stats.evictions += 1
            log.info("CUDA graphs of a slot evicted to make room (address %#x)", old.address)
        start = self._clock()
        graphs: dict[int, Graph[T]] = {}
        try:
            for size in reversed(self.sizes):  # largest first: the smaller reuse its memory
                graphs[size] = self.capturer.capture(make_run(size))
        except CaptureError as exc:
            self.capturer.release(list(graphs.values()))
            self._failed[slot] = str(exc)
            log.warning("CUDA graph capture failed, this slot's steps run eager: %s", exc)
            return False
        seconds = self._clock() - start
        self._graphs[slot] = graphs
        self.stats.slots = len(self._graphs)
        self.stats.captures += len(graphs)
        self.stats.capture_s += seconds
        self.stats.last_capture_s = seconds
        log.info("CUDA graphs captured: %d batch sizes (%s) in %.3f s, %d slots hold graphs",
                 len(graphs), ",".join(map(str, self.sizes)), seconds, len(self._graphs))
        return True

    # ---- a step ---------------------------------------------------------------------
    def replay(self, batch: int,
               make_run: Callable[[int], Callable[[], T]]) -> tuple[int, T] | None:
        """Run a step of ``batch`` rows on the bound slot's graph (capturing the slot's
        graphs first if it has none): ``(size, output)``, or None when the step must run
        eager (``stats.last_eager_reason`` says why)."""
        slot = self._bound
        if slot is None:
            self.note_eager(EAGER_UNBOUND, "no model bound in a graph slot")
            return None
        size = self.round_up(batch)
        if size is None:
            self.note_eager(EAGER_BATCH, f"batch of {batch} above the largest captured size "
                                         f"{self.max_size}")
            return None
        if not self.capture(slot, make_run):
            self.note_eager(EAGER_CAPTURE_FAILED, self._failed[slot])
            return None
        graphs = self._graphs[slot]
        self._graphs.move_to_end(slot)
        if self._ready is not None:  # the bytes of the bound model: copied before it runs
            self.capturer.wait(self._ready)
            self._ready = None
        out = graphs[size].replay()
        self.stats.replays += 1
        return size, out

    def note_eager(self, kind: str, why: str) -> None:
        """A step ran eager: counted by ``kind``, logged once per kind."""
        self.stats.eager_steps += 1
        self.stats.eager_reasons[kind] = self.stats.eager_reasons.get(kind, 0) + 1
        self.stats.last_eager_reason = why
        if kind not in self._logged:  # once per kind: a step is too frequent to log
            self._logged.add(kind)
            log.warning("decode steps run eager (no CUDA graph): %s", why)
