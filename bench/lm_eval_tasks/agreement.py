"""The share of multiple-choice questions two lm-evaluation-harness runs answer alike.

    python agreement.py SERVED_OUTPUT_DIR HF_OUTPUT_DIR

Each run's ``--log_samples`` file (``samples_aegaeon_mc_*.jsonl``) holds, per question,
every choice's log-likelihood; a run's answer is the choice with the highest. Runs in
lm-evaluation-harness's own venv (the standard library only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def picks(folder: Path) -> dict[int, int]:
    files = sorted(folder.rglob("samples_aegaeon_mc_*.jsonl"))
    if not files:
        raise SystemExit(f"no samples_aegaeon_mc_*.jsonl under {folder}")
    out: dict[int, int] = {}
    for line in files[-1].read_text().splitlines():
        sample = json.loads(line)
        scores = [float(r[0]) for r in sample["filtered_resps"]]
        out[int(sample["doc_id"])] = max(range(len(scores)), key=scores.__getitem__)
    return out


def main() -> None:
    served, hf = picks(Path(sys.argv[1])), picks(Path(sys.argv[2]))
    docs = sorted(set(served) & set(hf))
    same = sum(served[d] == hf[d] for d in docs)
    print(json.dumps({"questions": len(docs), "same_answer": same,
                      "agreement": same / len(docs) if docs else 0.0}))


if __name__ == "__main__":
    main()
