"""matplotlib for the commands that draw (``bench report``, ``bench sweep``'s PNG,
``aegaeon sim``): an optional dependency, the ``sim`` extra, never imported at the
top of a module; without it those commands say how to install it."""

from __future__ import annotations

from types import ModuleType

HINT = ("plots need matplotlib, which is the optional 'sim' extra: "
        "pip install -e '.[sim]' (or pip install 'matplotlib>=3.8')")  # fmt: skip


class PlotsUnavailableError(RuntimeError):
    """matplotlib is not installed (the message is the install hint)."""


def use_agg() -> ModuleType:
    """``matplotlib`` with the Agg backend selected (no display), or PlotsUnavailableError."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailableError(HINT) from None
    matplotlib.use("Agg")
    return matplotlib


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend, or PlotsUnavailableError."""
    use_agg()
    import matplotlib.pyplot as plt

    return plt
