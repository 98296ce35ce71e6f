"""Without matplotlib (the optional `sim` extra) the drawing commands say how to get it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# runs the CLI with matplotlib made unimportable
NO_MPL = ("import sys; sys.modules['matplotlib'] = None; "
          "from aegaeon_cli.main import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_MPL, *argv], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def test_report_and_sim_figures_print_the_install_hint(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("")
    report = _run("bench", "report", str(trace), "--out", str(tmp_path / "out"))
    assert report.returncode == 2, report.stderr
    assert "matplotlib" in report.stderr and "'.[sim]'" in report.stderr
    theorem = _run("sim", "--theorem", "--out", str(tmp_path / "sim"))
    assert theorem.returncode == 2, theorem.stderr
    assert "matplotlib" in theorem.stderr and "'.[sim]'" in theorem.stderr
    figure = _run("sim", "--figure", "11a", "--out", str(tmp_path / "fig"))
    assert figure.returncode == 2, figure.stderr
    assert "matplotlib" in figure.stderr and "'.[sim]'" in figure.stderr
