"""Shared-memory regions: create/attach/close, read-only mapping, cleanup, no tracker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from aegaeon_gpumem import ShmRegion, cleanup_prefix, list_segments, unique_name
from gpumem_support import PREFIX, TAG

pytestmark = pytest.mark.usefixtures("no_leaked_segments")


def test_create_attach_share_bytes_zero_copy() -> None:
    name = unique_name(TAG)
    with ShmRegion.create(name, 10_000) as owner:
        assert owner.nbytes == 10_000 and owner.name == name and owner.owner
        assert os.path.exists(f"/dev/shm/{name}")
        owner.tensor[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
        with ShmRegion.attach(name) as other:
            assert other.nbytes == 10_000 and not other.owner
            assert other.tensor[:5].tolist() == [1, 2, 3, 4, 5]
            other.tensor[9_999] = 42  # writes land in the owner's view: same pages
            assert int(owner.tensor[9_999]) == 42
            assert other.tensor.data_ptr() == other.tensor.data_ptr()  # cached, zero copy
        assert os.path.exists(f"/dev/shm/{name}")  # an attacher's close never unlinks
    assert not os.path.exists(f"/dev/shm/{name}")


def test_tensor_outlives_close() -> None:
    # close() must not unmap under a live tensor (that would segfault on access).
    region = ShmRegion.create(unique_name(TAG), 4096)
    t = region.tensor
    t[0] = 7
    region.close()
    region.close()  # idempotent
    assert region.closed
    t[1] = 8
    assert t[:2].tolist() == [7, 8]
    with pytest.raises(ValueError, match="closed"):
        _ = region.tensor


def test_name_rules_and_errors() -> None:
    with pytest.raises(ValueError, match="aegaeon-"):
        ShmRegion.create("other-name", 10)
    with pytest.raises(ValueError):
        ShmRegion.create("aegaeon-a/b", 10)
    with pytest.raises(ValueError):
        ShmRegion.create(unique_name(TAG), 0)
    with pytest.raises(FileNotFoundError):
        ShmRegion.attach(unique_name(TAG))
    name = unique_name(TAG)
    with ShmRegion.create(name, 10), pytest.raises(FileExistsError):
        ShmRegion.create(name, 10)


def test_cleanup_prefix_removes_stale_segments() -> None:
    crashed = [ShmRegion.create(unique_name(TAG + "-crash"), 100) for _ in range(3)]
    keep = ShmRegion.create(unique_name(TAG + "-keep"), 100)
    removed = cleanup_prefix(f"aegaeon-{TAG}-crash")
    assert sorted(removed) == sorted(r.name for r in crashed)
    assert list_segments(PREFIX) == [keep.name]
    for r in crashed:
        r.close()  # the name is gone already; close tolerates that
    keep.close()
    with pytest.raises(ValueError):
        cleanup_prefix("/")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_readonly_attach_cannot_write() -> None:
    with ShmRegion.create(unique_name(TAG), 4096) as owner:
        owner.tensor[0] = 5
        ro = ShmRegion.attach(owner.name, readonly=True)
        assert ro.readonly and int(ro.tensor[0]) == 5
        with pytest.raises(TypeError):
            ro.mapping[0] = 1  # the buffer itself refuses writes
        ro.close()
        # A write through the tensor hits PROT_READ pages: the process dies with
        # SIGSEGV rather than changing the owner's bytes.
        proc = _run(f"""
            from aegaeon_gpumem import ShmRegion
            r = ShmRegion.attach({owner.name!r}, readonly=True)
            r.tensor[0] = 99
            print("wrote")
        """)
        assert proc.returncode == -11, proc.stderr
        assert "wrote" not in proc.stdout
        assert int(owner.tensor[0]) == 5


def test_attach_in_another_process_no_resource_tracker() -> None:
    with ShmRegion.create(unique_name(TAG), 4096) as owner:
        proc = _run(f"""
            import warnings
            warnings.simplefilter("always")
            from aegaeon_gpumem import ShmRegion
            r = ShmRegion.attach({owner.name!r})
            r.tensor[0] = 3
            ro = ShmRegion.attach({owner.name!r}, readonly=True)
            assert int(ro.tensor[0]) == 3
            r.close(); ro.close()
        """)
        assert proc.returncode == 0, proc.stderr
        assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr
        assert proc.stderr == ""
        # The attacher's exit did not unlink the owner's segment.
        assert os.path.exists(f"/dev/shm/{owner.name}")
        assert int(owner.tensor[0]) == 3


def test_populated_attach_and_linked_after_unlink() -> None:
    name = unique_name(TAG)
    owner = ShmRegion.create(name, 1 << 20)
    owner.tensor[-1] = 7
    reader = ShmRegion.attach(name, readonly=True, populate=True)
    assert int(reader.tensor[-1]) == 7 and reader.linked() and owner.linked()
    data = reader.tensor
    owner.close()  # unlinks the name; the reader's pages stay while it maps them
    assert not reader.linked() and not owner.linked()
    assert int(data[-1]) == 7
    reader.close()
