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
    for argv in (("bench", "report", str(trace), "--out", str(tmp_path / "out")),
                 ("sim", "--theorem", "--out", str(tmp_path / "sim")),
                 ("sim", "--figure", "11a", "--out", str(tmp_path / "fig"))):
        done = _run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert "matplotlib" in done.stderr and "'.[sim]'" in done.stderr, argv
