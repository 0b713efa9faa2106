"""A running least-squares line y = a + b x (the law's S_kv(l) and the clusters' prefill cost)."""

from __future__ import annotations

from typing import Callable


class LineFit:
    """Sums of n, x, y, x^2, x y; `line()` is the fit once two distinct x exist and the slope is >= 0, `model()`
    the function a caller predicts with."""

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1.0
        self.sx, self.sy, self.sxx, self.sxy = self.sx + x, self.sy + y, self.sxx + x * x, self.sxy + x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None with fewer than two distinct x or a negative slope."""
        n, sx, sy, sxx, sxy = self.n, self.sx, self.sy, self.sxx, self.sxy
        den = n * sxx - sx * sx
        if n < 2 or den <= 1e-9 * max(1.0, sxx):
            return None
        b = (n * sxy - sx * sy) / den
        return ((sy - b * sx) / n, b) if b >= 0 else None

    def model(self) -> Callable[[float], float] | None:
        """y(x): the line (clamped at 0); with one point, one distinct x or a slope < 0, y proportional to
        x (sum y / sum x); None before any point."""
        fit = self.line()
        if fit is not None:
            a, b = fit
            return lambda x: max(a + b * x, 0.0)
        if self.n < 1:
            return None
        per = self.sy / max(self.sx, 1.0)
        return lambda x: per * x
