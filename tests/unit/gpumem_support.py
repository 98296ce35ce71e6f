"""Shared names of the gpumem unit tests: the shared-memory tag of this test process."""

from __future__ import annotations

import os

TAG = f"gmtest{os.getpid()}"  # every segment a test makes is named aegaeon-TAG-...
PREFIX = f"aegaeon-{TAG}-"
