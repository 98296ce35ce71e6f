"""``aegaeon bench overload --clients``: the verdict of a closed-loop run (pure)."""

from __future__ import annotations

from aegaeon_bench.serve.overload_clients import format_rows, summarize


def _row(clients: int, per_s: float, refused: int = 0, other: int = 0) -> dict[str, object]:
    return {"clients": clients, "completed": int(per_s * 30), "completed_per_s": per_s,
            "refused": refused, "errors": 0, "other": other, "open_at_end": clients}


def test_the_flood_is_held_against_the_best_of_fewer_clients() -> None:
    report = summarize([_row(1, 1.0), _row(4, 2.0), _row(256, 1.9, refused=900)])
    assert report["goodput_ratio"] == 1.9 / 2.0 and report["ok"]
    assert "0.95" in format_rows(report).splitlines()[-1]
    collapsed = summarize([_row(1, 1.0), _row(256, 0.25, refused=16000)])
    assert collapsed["goodput_ratio"] == 0.25 and not collapsed["ok"]


def test_nothing_completed_without_the_flood_is_no_verdict() -> None:
    report = summarize([_row(1, 0.0), _row(64, 1.0)])
    assert report["goodput_ratio"] is None and not report["ok"]
    assert not summarize([_row(1, 1.0), _row(64, 1.0, other=3)])["ok"]  # 5xx: not held


def test_client_counts_are_checked_before_any_node_starts() -> None:
    from aegaeon_bench.serve.overload import _client_counts

    assert _client_counts("1,4,256") == [1, 4, 256]
    assert _client_counts("5") is None and _client_counts("0,8") is None
    assert _client_counts("1,x") is None
