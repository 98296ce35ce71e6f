"""``with`` for an object that frees what it owns in ``close()``."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with obj:`` gives ``obj`` and calls ``obj.close()`` at the end, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
