"""Small dense least squares in pure Python (a handful of unknowns).

The estimators have at most four coefficients, so normal equations solved by
Gaussian elimination are exact enough once every feature is divided by a
reference magnitude (scaled features are O(1), which keeps ``X^T X`` well
conditioned even though raw features span twelve orders of magnitude).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# Relative ridge added to the diagonal: only guards against exact singularity,
# far below anything that would bias a fit.
_TINY_RIDGE = 1e-10


def solve(matrix: Sequence[Sequence[float]], rhs: Sequence[float]) -> list[float] | None:
    """Solve ``matrix @ x = rhs`` by Gaussian elimination with partial pivoting.

    Returns ``None`` when the system is singular (a pivot vanishes).
    """
    n = len(rhs)
    a = [[float(v) for v in row] + [float(rhs[i])] for i, row in enumerate(matrix)]
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-14 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f != 0.0:
                for c in range(col, n + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))
        x[r] = acc / a[r][r]
    return x


def _accumulate3(
    xtx: list[list[float]], xty: list[float], z: list[float], y: float, w: float
) -> None:
    """``WindowedFit._accumulate`` for three features, unrolled (the same products in the
    same order, so the same sums to the last bit; about 3x faster)."""
    z0, z1, z2 = z
    a = w * z0
    r = xtx[0]
    xty[0] += a * y
    r[0] += a * z0
    r[1] += a * z1
    r[2] += a * z2
    a = w * z1
    r = xtx[1]
    xty[1] += a * y
    r[0] += a * z0
    r[1] += a * z1
    r[2] += a * z2
    a = w * z2
    r = xtx[2]
    xty[2] += a * y
    r[0] += a * z0
    r[1] += a * z1
    r[2] += a * z2


def relative_weight(y: float) -> float:
    """Weight that turns squared errors into squared *relative* errors.

    Latencies span three orders of magnitude (a 16-token prefill vs a
    4k-token one); unweighted least squares would fit the big ones and let
    the small ones drift by tens of percent.
    """
    return 1.0 / max(y * y, 1e-18)


def fit(
    rows: Sequence[Sequence[float]],
    targets: Sequence[float],
    scales: Sequence[float],
    weights: Sequence[float] | None = None,
) -> list[float] | None:
    """Weighted least squares ``targets ~ rows @ coef``; ``None`` if under-determined.

    ``scales`` are reference magnitudes of the features (same units), used
    only for conditioning; the returned coefficients are in raw units.
    """
    k = len(scales)
    if len(rows) < k:
        return None
    xtx = [[0.0] * k for _ in range(k)]
    xty = [0.0] * k
    ws = weights if weights is not None else [1.0] * len(targets)
    for row, y, w in zip(rows, targets, ws, strict=True):
        z = [v / s for v, s in zip(row, scales, strict=True)]
        for i in range(k):
            xty[i] += w * z[i] * y
            for j in range(k):
                xtx[i][j] += w * z[i] * z[j]
    for i in range(k):
        xtx[i][i] += _TINY_RIDGE * max(xtx[i][i], 1e-30)
    coef = solve(xtx, xty)
    if coef is None:
        return None
    return [c / s for c, s in zip(coef, scales, strict=True)]


class WindowedFit:
    """Least squares over a sliding window of recent samples, shrunk toward a prior.

    Minimises ``sum_window (y - x.c)^2 + sum_j rho_j (c_j - prior_j)^2`` in
    scaled units, where ``rho_j`` is worth ``prior_weight`` typical samples:
    with few or uninformative samples (e.g. every decode step of the same
    batch size) the fit stays at the prior instead of going singular; with a
    full window of varied samples the data dominate. Running sums make an
    update O(k^2) and a refit O(k^3).
    """

    def __init__(
        self,
        prior: Sequence[float],
        scales: Sequence[float],
        *,
        window: int = 256,
        prior_weight: float = 8.0,
    ) -> None:
        self._scales = [float(s) for s in scales]
        self._prior = [c * s for c, s in zip(prior, self._scales, strict=True)]
        self._k = len(self._scales)
        self._window: deque[tuple[list[float], float, float]] = deque()
        self._max = window
        self._prior_weight = prior_weight
        self._xtx = [[0.0] * self._k for _ in range(self._k)]
        self._xty = [0.0] * self._k
        self._evictions = 0

    def __len__(self) -> int:
        return len(self._window)

    def _accumulate(self, z: list[float], y: float, w: float) -> None:
        if self._k == 3:  # Eq. 5 and Eq. 6's three terms: every decode step adds one
            _accumulate3(self._xtx, self._xty, z, y, w)
            return
        for i in range(self._k):
            self._xty[i] += w * z[i] * y
            row = self._xtx[i]
            for j in range(self._k):
                row[j] += w * z[i] * z[j]

    def add(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        z = [v / s for v, s in zip(x, self._scales, strict=True)]
        self._window.append((z, y, weight))
        self._accumulate(z, y, weight)
        if len(self._window) > self._max:
            old_z, old_y, old_w = self._window.popleft()
            self._accumulate(old_z, old_y, -old_w)
            self._evictions += 1
            if self._evictions >= self._max:
                # Rebuild the sums now and then so subtraction rounding never accumulates.
                self._evictions = 0
                self._xtx = [[0.0] * self._k for _ in range(self._k)]
                self._xty = [0.0] * self._k
                for wz, wy, ww in self._window:
                    self._accumulate(wz, wy, ww)

    def coefficients(self) -> list[float]:
        """Current fit in raw units (the prior while the window is empty)."""
        n = len(self._window)
        if n == 0:
            return [c / s for c, s in zip(self._prior, self._scales, strict=True)]
        xtx = [row[:] for row in self._xtx]
        xty = self._xty[:]
        for j in range(self._k):
            rho = self._prior_weight * max(xtx[j][j] / n, 1e-12)
            xtx[j][j] += rho
            xty[j] += rho * self._prior[j]
        coef = solve(xtx, xty)
        if coef is None:
            coef = self._prior
        return [c / s for c, s in zip(coef, self._scales, strict=True)]
