"""The decode step's CUDA graphs: capturers and the static inputs a graph reads.

What decides (which graph, when one is stale, when to run eager) is graphs.py,
plain code; this module holds the few things that touch torch:

- ``CudaCapturer``: ``torch.cuda.CUDAGraph`` captures sharing one memory pool,
  a warm-up run before each capture (Triton compiles, cuBLAS picks its kernels);
- ``EagerCapturer``: "captures" a step by keeping it and replays it by running it
  (the CPU, and a device where graphs are off): the same static inputs and the
  same bookkeeping, so the CPU tests exercise the path a GPU replays;
- ``StaticInputs``: the step's inputs at fixed addresses, ``[tokens | positions |
  slot blocks | slot offsets | context lengths | block table]`` as one int32
  buffer, staged in a (pinned) host mirror and sent with one host-to-device copy
  per step. Rows beyond the batch repeat its first row (graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .graphs import CaptureError, Graph

_FIELDS = 5  # tokens, positions, slot blocks, slot offsets, context lengths


@dataclass
class _Replayed:
    graph: Any  # torch.cuda.CUDAGraph
    output: Any

    def replay(self) -> Any:
        self.graph.replay()
        return self.output


@dataclass
class _Kept:
    run: Callable[[], Any]

    def replay(self) -> Any:
        return self.run()


class CudaCapturer:
    """Captures steps on ``device`` into CUDA graphs sharing one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def capture(self, run: Callable[[], Any]) -> Graph[Any]:
        # on the engine's device whatever thread captures (a worker captures at start-up
        # on a thread of its event loop, and replays on its compute thread)
        with torch.cuda.device(self.device):
            try:
                # warm-up on a side stream (what torch.cuda.graphs asks for), then capture
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    run()
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self._stream):
                    output = run()
                torch.cuda.synchronize(self.device)
            except RuntimeError as exc:
                raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
        return _Replayed(graph, output)

    def release(self, graphs: Sequence[Graph[Any]]) -> None:
        for g in graphs:
            if isinstance(g, _Replayed):
                g.graph.reset()
                g.output = None

    def wait(self, ready: object) -> None:
        if isinstance(ready, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(ready)


class EagerCapturer:
    """Keeps each step and runs it at replay (module docstring)."""

    def capture(self, run: Callable[[], Any]) -> Graph[Any]:
        return _Kept(run)

    def release(self, graphs: Sequence[Graph[Any]]) -> None:
        pass

    def wait(self, ready: object) -> None:
        synchronize = getattr(ready, "synchronize", None)
        if callable(synchronize):
            synchronize()


class StaticInputs:
    """A decode step's inputs at fixed device addresses (module docstring): ``rows``
    rows at most, block tables ``width`` blocks wide."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        size = _FIELDS * rows + rows * width
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        on_cuda = device.type == "cuda"
        self.host = (torch.zeros(size, dtype=torch.int32, pin_memory=True) if on_cuda
                     else self.device_buffer)
        self._copied = torch.cuda.Event() if on_cuda else None  # type: ignore[no-untyped-call]
        fields = self.device_buffer[:_FIELDS * rows].view(_FIELDS, rows)
        self.tokens, self.positions, self.slot_blocks, self.slot_offsets, self.context_lens = (
            fields.unbind(0))
        self.block_table = self.device_buffer[_FIELDS * rows:].view(rows, width)

    def views(self, size: int) -> tuple[torch.Tensor, ...]:
        """``(tokens, positions, slot_blocks, slot_offsets, context_lens, block_table)`` of the
        first ``size`` rows."""
        return (self.tokens[:size], self.positions[:size], self.slot_blocks[:size],
                self.slot_offsets[:size], self.context_lens[:size], self.block_table[:size])

    def stage(self, token_ids: Sequence[int], positions: Sequence[int],
              block_ids: Sequence[Sequence[int]], block_size: int, size: int) -> None:
        """The batch into rows ``[0, size)`` (rows past the batch repeat row 0), then one
        copy to the device. ``block_ids[b]`` covers position ``positions[b]``."""
        batch = len(token_ids)
        host = self._host_ready()
        fields = host[:_FIELDS * self.rows].view(_FIELDS, self.rows)
        rows = list(range(batch)) + [0] * (size - batch)
        used = [positions[r] // block_size + 1 for r in rows]
        if max(used) > self.width:
            r = rows[used.index(max(used))]
            raise ValueError(f"a context of {positions[r] + 1} positions needs {max(used)} "
                             f"blocks; the static block table holds {self.width}")
        # a fixed number of tensor ops whatever the batch (no loop of them over sequences)
        fields[:, :size] = torch.tensor(
            [[token_ids[r] for r in rows], [positions[r] for r in rows],
             [block_ids[r][n - 1] for r, n in zip(rows, used, strict=True)],
             [positions[r] % block_size for r in rows], [positions[r] + 1 for r in rows]],
            dtype=torch.int32)
        where: list[int] = []
        values: list[int] = []
        for row, (r, n) in enumerate(zip(rows, used, strict=True)):
            where.extend(range(row * self.width, row * self.width + n))
            values.extend(block_ids[r][:n])
        table = host[_FIELDS * self.rows:]
        table[torch.tensor(where)] = torch.tensor(values, dtype=torch.int32)
        self._send(_FIELDS * self.rows + size * self.width)

    def stage_null(self, size: int) -> None:
        """Rows that write no K/V and attend to nothing (a capture's warm-up): token 0 at
        position 0, slot block -1, context 0."""
        host = self._host_ready()
        fields = host[:_FIELDS * self.rows].view(_FIELDS, self.rows)
        fields[:, :size] = 0
        fields[2, :size] = -1
        host[_FIELDS * self.rows:_FIELDS * self.rows + size * self.width] = 0
        self._send(_FIELDS * self.rows + size * self.width)

    def _host_ready(self) -> torch.Tensor:
        if self._copied is not None:  # the last step's copy has read the pinned mirror
            self._copied.synchronize()
        return self.host

    def _send(self, count: int) -> None:
        if self.host is self.device_buffer:
            return
        self.device_buffer[:count].copy_(self.host[:count], non_blocking=True)
        assert self._copied is not None
        self._copied.record()
