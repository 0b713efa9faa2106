"""Token-length distributions for prompts and outputs, sampled in bulk with numpy.

Every distribution is a frozen dataclass with ``sample(rng, n) -> int64 array`` and an analytic (or exact
empirical) ``mean()``, so a workload of a million requests is a handful of vector operations and tests can
compare sample statistics against the closed form. `parse_length` reads the scenario form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from scipy import special

from testbed import units
from testbed.errors import FieldError, UserError
from testbed.validation import Fields, number, path_exists

DISTRIBUTIONS = ("fixed", "uniform", "lognormal", "empirical", "mixture")


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...

    def mean(self) -> float: ...

    def least(self) -> int: ...


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.tokens, dtype=np.int64)

    def mean(self) -> float:
        return float(self.tokens)

    def least(self) -> int:
        return self.tokens


@dataclass(frozen=True)
class Uniform:
    """Whole numbers in [low, high], both ends included."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)

    def mean(self) -> float:
        return (self.low + self.high) / 2.0

    def least(self) -> int:
        return self.low


@dataclass(frozen=True)
class TruncatedLogNormal:
    """exp(N(mu, sigma^2)) conditioned on [low, high] (the paper: mu 9.90, sigma 1.00, [128, 128K]).

    Sampled by inverting the normal CDF between the truncation points: exact, no rejection loop.
    Values are rounded to whole tokens.
    """

    mu: float
    sigma: float
    low: int
    high: int

    def _cdf_bounds(self) -> tuple[float, float]:
        z = (np.log([self.low, self.high]) - self.mu) / self.sigma
        return float(special.ndtr(z[0])), float(special.ndtr(z[1]))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        a, b = self._cdf_bounds()
        u = a + (b - a) * rng.random(n)
        x = np.exp(self.mu + self.sigma * special.ndtri(u))
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)

    def mean(self) -> float:
        """E[X | low <= X <= high] = e^(mu + s^2/2) (Phi(beta - s) - Phi(alpha - s)) / (Phi(beta) - Phi(alpha))."""
        alpha, beta = (math.log(self.low) - self.mu) / self.sigma, (math.log(self.high) - self.mu) / self.sigma
        s = self.sigma
        num = special.ndtr(beta - s) - special.ndtr(alpha - s)
        den = special.ndtr(beta) - special.ndtr(alpha)
        return float(math.exp(self.mu + s * s / 2) * num / den)

    def least(self) -> int:
        return self.low

    def survival(self, tokens: float) -> float:
        """P(X > tokens), the offload fraction p of the paper's Eq. 6 for a threshold t."""
        if tokens >= self.high:
            return 0.0
        if tokens < self.low:
            return 1.0
        a, b = self._cdf_bounds()
        c = float(special.ndtr((math.log(tokens) - self.mu) / self.sigma))
        return (b - c) / (b - a)


@dataclass(frozen=True)
class Empirical:
    """Resampling (with replacement) of observed lengths, e.g. a trace's ``input_length`` column."""

    values: tuple[int, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        arr = np.asarray(self.values, dtype=np.int64)
        return arr[rng.integers(0, len(arr), size=n)]

    def mean(self) -> float:
        return float(np.mean(self.values))

    def least(self) -> int:
        return min(self.values)


@dataclass(frozen=True)
class Mixture:
    """Each sample comes from component i with probability weights[i] (weights sum to 1)."""

    weights: tuple[float, ...]
    components: tuple[Any, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        which = rng.choice(len(self.components), size=n, p=np.asarray(self.weights))
        out = np.empty(n, dtype=np.int64)
        for i, comp in enumerate(self.components):
            mask = which == i
            out[mask] = comp.sample(rng, int(mask.sum()))
        return out

    def mean(self) -> float:
        return float(sum(w * c.mean() for w, c in zip(self.weights, self.components)))

    def least(self) -> int:
        """The least value a sample can take: of the components that have any weight."""
        return min(c.least() for w, c in zip(self.weights, self.components) if w > 0)


PAPER_INPUT = TruncatedLogNormal(mu=9.90, sigma=1.00, low=128, high=128 * 1024)
PAPER_OUTPUT = Fixed(1024)


def _tokens(v: Any) -> int:
    return units.parse_tokens(v)


def parse_length(value: Any, path: str, source: str | None = None, base_dir: Path | None = None) -> LengthDist:
    """A scalar (``1024``, ``32K``) is a fixed length; a mapping names a distribution with ``dist``."""
    if not isinstance(value, dict):
        try:
            return Fixed(units.parse_tokens(value))
        except ValueError as exc:
            raise FieldError(path, f"{exc}; or a mapping with dist: {', '.join(DISTRIBUTIONS)}", source) from None
    f = Fields(value, path, source)
    dist = f.choice("dist", DISTRIBUTIONS)
    out: LengthDist
    if dist == "fixed":
        out = Fixed(f.get("tokens", _tokens))
    elif dist == "uniform":
        out = Uniform(f.get("min", _tokens), f.get("max", _tokens))
        if out.high < out.low:
            raise f.error("max", f"{out.high} is below min {out.low}")
    elif dist == "lognormal":
        sigma = f.get("sigma", number)
        if sigma <= 0:
            raise f.error("sigma", f"{sigma:g} must be > 0")
        out = TruncatedLogNormal(f.get("mu", number), sigma, f.get("min", _tokens, 1), f.get("max", _tokens, 128 * 1024))
        if out.low < 1 or out.high <= out.low:
            raise f.error("max", f"the truncation range [{out.low}, {out.high}] must satisfy 1 <= min < max")
        a, b = out._cdf_bounds()
        if b - a < 1e-12:
            median = math.exp(out.mu) if out.mu < 709 else math.inf  # exp(1e30) overflowed: a traceback
            raise f.error("mu", f"exp(mu) = {median:.3g} with sigma {out.sigma:g} puts no probability in [{out.low}, {out.high}]")
    elif dist == "empirical":
        out = _parse_empirical(f, base_dir)
    else:
        comps = f.items("components")
        if not comps:
            raise f.error("components", "a mixture needs at least one component, each {weight: ..., dist: ...}")
        weights, dists = [], []
        for c in comps:
            w = c.get("weight", number)
            if w < 0:
                raise c.error("weight", f"{w:g} must be >= 0")
            rest = {k: v for k, v in c.data.items() if k != "weight"}
            weights.append(w)
            dists.append(parse_length(rest, c.path, source, base_dir))
        total = sum(weights)
        if not 0 < total < math.inf:  # 1e308 + 1e308 is inf: numpy's draw failed on the NaN shares
            raise f.error("components", f"the weights must add up to more than 0 and less than 1e308 (they add up to {total:g})")
        out = Mixture(tuple(w / total for w in weights), tuple(dists))
    f.done()
    return out


def _parse_empirical(f: Fields, base_dir: Path | None) -> Empirical:
    if f.has("values"):
        vals = f.get("values", lambda v: tuple(units.parse_tokens(x) for x in v))
        if not vals:
            raise f.error("values", "needs at least one length")
        f.mark_read("trace", "field")
        return Empirical(vals)
    from traffic.trace import read_trace

    path = f.get("trace", lambda v: Path(str(v)))
    if base_dir is not None and not path.is_absolute() and not path_exists(path):
        path = base_dir / path
    column = f.choice("field", ("input_length", "output_length"), "input_length")
    try:
        reqs = read_trace(path).requests  # a length source reads every line
    except UserError as exc:  # the trace's own error, named by this field
        raise f.error("trace", str(exc)) from None
    if not reqs:
        raise f.error("trace", f"{path} has no requests")
    attr = "input_len" if column == "input_length" else "output_len"
    return Empirical(tuple(getattr(r, attr) for r in reqs))
