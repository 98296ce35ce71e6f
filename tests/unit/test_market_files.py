"""A model's files against what market.json records (``aegaeon_common.market_files``)."""

from __future__ import annotations

import os
from pathlib import Path

from aegaeon_common.market_files import (
    MarketRecords,
    digest_problem,
    record_files,
    size_problem,
)
from aegaeon_common.market_index import Manifest, MarketEntry


def _market(root: Path, content: bytes) -> Path:
    model = root / "m"
    (model / "sub").mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "w.bin").write_bytes(content)
    entry = MarketEntry("m", model, files=record_files(model))
    (root / "market.json").write_text(Manifest(0, "", "", (entry,)).to_json(root))
    return model


def test_sizes_then_contents_are_checked_and_named(tmp_path: Path) -> None:
    model = _market(tmp_path, b"abcdef")
    files = record_files(model)
    assert [(f.name, f.size) for f in files] == [("config.json", 2), ("sub/w.bin", 6)]
    assert size_problem(model, files) is None and digest_problem(model, files) is None
    (model / "sub" / "w.bin").write_bytes(b"abcdeX")  # same size: only the digest tells
    assert size_problem(model, files) is None
    problem = digest_problem(model, files)
    assert problem is not None and problem.startswith(f"{model / 'sub' / 'w.bin'}: content")
    (model / "sub" / "w.bin").write_bytes(b"abc")
    weights = model / "sub" / "w.bin"
    assert size_problem(model, files) == f"{weights}: 3 bytes, market.json records 6"
    (model / "config.json").unlink()
    assert "config.json: missing file" in str(size_problem(model, files))


def test_the_records_follow_market_json_when_it_changes(tmp_path: Path) -> None:
    model = _market(tmp_path, b"abcdef")
    records = MarketRecords(tmp_path)
    assert [f.size for f in records.files(model)] == [2, 6]
    assert records.files(tmp_path / "other") == () and MarketRecords(None).files(model) == ()
    _market(tmp_path, b"a longer file")  # `market add --replace`: market.json rewritten
    stat = (tmp_path / "market.json").stat()
    os.utime(tmp_path / "market.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert [f.size for f in records.files(model)] == [2, 13]
