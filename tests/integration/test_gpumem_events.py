"""Events across processes: a slow producer and a consumer that waits on the opened handle.

The children are real Python processes (subprocess, not fork) that attach the
shared KV region and the event table; handles travel as msgpack bytes, as in
the services' messages. Their stderr must stay empty: attaching never
involves the resource tracker.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from aegaeon_gpumem import (
    CpuCopyStream,
    CpuEvent,
    EventTable,
    ShmRegion,
    Timeline,
    list_segments,
    open_event,
    unique_name,
)

HERE = Path(__file__).resolve().parent
TAG = f"gmtest{os.getpid()}"
BLOCK = 256 << 10  # one KV block
PIECES = 8


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    yield
    assert list_segments(f"aegaeon-{TAG}-") == []


def _pattern(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _emit(tag: str, payload: object) -> None:
    print(tag, msgpack.packb(payload).hex(), flush=True)


def _expect(proc: subprocess.Popen[str], tag: str) -> object:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    got, _, data = line.strip().partition(" ")
    assert got == tag, (
        f"expected {tag}, got {line!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"
    )
    return msgpack.unpackb(bytes.fromhex(data))


def _spawn(entry: str, args: dict[str, object]) -> subprocess.Popen[str]:
    module = Path(__file__).stem
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import {module} as t; t.{entry}()"
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> None:
    out, err = proc.communicate("done\n", timeout=120)
    assert proc.returncode == 0, err
    assert err == "", err  # no resource-tracker warnings, no tracebacks
    assert out == ""


# ---- child entry points ---------------------------------------------------------


def gated_producer() -> None:
    """Write one KV block into the shared region in pieces, the last one once a ``go``
    line comes on stdin (the stream waits for it), then record an event."""
    args = json.loads(sys.argv[1])
    table = EventTable.attach(args["table"])
    region = ShmRegion.attach(args["region"])
    stream = CpuCopyStream(table, args["slot"])
    data = _pattern(BLOCK, args["seed"])
    off, piece = args["offset"], BLOCK // PIECES
    for i in range(PIECES):
        if i == PIECES - 1:
            stream.launch_host_func(lambda: _gate(sys.stdin.readline()))
        a = i * piece
        stream.copy(region.tensor[off + a : off + a + piece], data[a : a + piece])
    event = stream.record()
    _emit("HANDLE", event.handle().to_dict())
    stream.synchronize()
    sys.stdin.readline()
    stream.close()
    region.close()
    table.close()


def _gate(line: str) -> None:
    assert line.strip() == "go", line


def swap_in_consumer() -> None:
    """Swap a block in: the stream waits on the producer's event, then copies locally."""
    args = json.loads(sys.argv[1])
    produced = open_event(msgpack.unpackb(bytes.fromhex(args["event"])))
    table = EventTable.attach(args["table"])
    region = ShmRegion.attach(args["region"], readonly=True)
    stream = CpuCopyStream(table, args["slot"])
    local = torch.zeros(BLOCK, dtype=torch.uint8)
    stream.wait_event(produced)
    stream.copy(local, region.tensor[args["offset"] : args["offset"] + BLOCK])
    swapped = stream.record()
    _emit("HANDLE", swapped.handle().to_dict())
    assert swapped.wait(60.0)
    _emit("SHA", hashlib.sha256(local.numpy().tobytes()).hexdigest())
    sys.stdin.readline()
    stream.close()
    region.close()
    table.close()


# ---- tests ---------------------------------------------------------------------


def test_consumer_never_reads_before_the_producers_event() -> None:
    offset = 3 * BLOCK
    last = slice(offset + BLOCK - BLOCK // PIECES, offset + BLOCK)  # the held-back piece
    with (
        EventTable.create(unique_name(TAG), 4) as table,
        ShmRegion.create(unique_name(TAG), 8 * BLOCK) as region,
    ):
        proc = _spawn(
            "gated_producer",
            {"table": table.name, "region": region.name, "slot": 2, "offset": offset, "seed": 7},
        )
        try:
            event = open_event(_expect(proc, "HANDLE"))  # type: ignore[arg-type]
            assert isinstance(event, CpuEvent) and event.table.readonly
            # the producer's stream waits at its gate: the event is pending, the last
            # piece not written
            assert not event.query()
            assert not event.wait(0.05)
            assert int(region.tensor[last].sum()) == 0
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert event.wait(60.0)
            # Read only now: every piece, including the last, is there.
            block = region.tensor[offset : offset + BLOCK]
            assert torch.equal(block, _pattern(BLOCK, 7))
            assert int(region.tensor[:offset].sum()) == 0  # nothing else was touched
        finally:
            _finish(proc)


def test_swap_in_stream_waits_for_the_producers_event() -> None:
    offset = 5 * BLOCK
    data = _pattern(BLOCK, 11)
    with (
        EventTable.create(unique_name(TAG), 4) as table,
        ShmRegion.create(unique_name(TAG), 8 * BLOCK) as region,
    ):
        # The producer (this process) is held back by a gate we open later.
        gate_line = Timeline(table, 3)
        gate = CpuEvent(table, 3, gate_line.issue())
        producer = CpuCopyStream(table, 0)
        producer.wait_event(gate)
        producer.copy(region.tensor[offset : offset + BLOCK], data)
        swap_out = producer.record()
        wire = msgpack.packb(swap_out.handle().to_dict()).hex()
        proc = _spawn(
            "swap_in_consumer",
            {
                "table": table.name,
                "region": region.name,
                "slot": 1,
                "offset": offset,
                "event": wire,
            },
        )
        try:
            swapped = open_event(_expect(proc, "HANDLE"))  # type: ignore[arg-type]
            time.sleep(0.3)
            assert not swap_out.query() and not swapped.query()  # both held by the gate
            gate_line.signal(gate.value)
            assert swapped.wait(60.0)  # the consumer's event, seen from here
            assert swap_out.query()  # it could only complete after ours
            assert _expect(proc, "SHA") == hashlib.sha256(data.numpy().tobytes()).hexdigest()
        finally:
            _finish(proc)
            producer.close()
