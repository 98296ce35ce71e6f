"""This instance process, in the proxy's eyes.

Pids repeat (PID 1 in every container), so each process draws a random number: its
hello carries it, the proxy stamps the work it sends this process with it, and every
reading of what the process holds names it (a late message of the process it replaced
never stands for this one).
"""

from __future__ import annotations

import secrets

INCARNATION = secrets.randbits(62) + 1  # never 0
