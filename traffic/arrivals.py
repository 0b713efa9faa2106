"""Arrival processes: when requests arrive, as sorted numpy arrays of seconds from the workload start.

Open-loop processes (`Poisson` with rate steps and ramps, `OnOff`, `MarkovModulated`, `TraceTimes`) are
fully determined by the seed and drawn in bulk. `ClosedLoop` (N users, think time) depends on when the
system answers, so it offers `after()` for the load generator and, for offline generation, `times()`
under the stated assumption that every response is instantaneous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from testbed import units
from testbed.errors import FieldError
from testbed.validation import Fields, at_least_one, number

PROCESSES = ("poisson", "onoff", "mmpp", "closed", "trace")


class ArrivalProcess(Protocol):
    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray: ...

    def mean_rate_rps(self) -> float: ...


@dataclass(frozen=True)
class RateStep:
    """From `at_s` on, the rate is `rate_rps`; with `ramp_s` > 0 it moves there linearly over that long."""

    at_s: float
    rate_rps: float
    ramp_s: float = 0.0


@dataclass(frozen=True)
class Poisson:
    """A (possibly time-varying) Poisson process; the rate follows `steps` (piecewise linear).

    Drawn by thinning a homogeneous process at the peak rate, which is exact for any rate curve.
    """

    rate_rps: float
    steps: tuple[RateStep, ...] = ()

    def rate_curve(self, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Breakpoints (t_s, rate_rps) of the piecewise-linear rate over [0, duration_s]."""
        ts, rs = [0.0], [self.rate_rps]
        for st in self.steps:
            ts.append(st.at_s)
            rs.append(rs[-1])
            ts.append(st.at_s + st.ramp_s)
            rs.append(st.rate_rps)
        ts.append(max(duration_s, ts[-1]))
        rs.append(rs[-1])
        return np.asarray(ts), np.asarray(rs)

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        ts, rs = self.rate_curve(duration_s)
        peak = float(rs.max())
        if peak <= 0 or duration_s <= 0:
            return np.empty(0)
        n = rng.poisson(peak * duration_s)
        t = np.sort(rng.random(n) * duration_s)
        if self.steps:
            t = t[rng.random(n) * peak < np.interp(t, ts, rs)]
        return t

    def mean_rate_rps(self, duration_s: float | None = None) -> float:
        if not self.steps:
            return self.rate_rps
        d = duration_s if duration_s is not None else self.steps[-1].at_s + self.steps[-1].ramp_s
        ts, rs = self.rate_curve(d)
        keep = ts <= d
        return float(np.trapezoid(rs[keep], ts[keep]) / d) if d > 0 else self.rate_rps


def _modulated(rng: np.random.Generator, duration_s: float, rates: tuple[float, float], means_s: tuple[float, float], exponential: bool) -> np.ndarray:
    """Poisson arrivals whose rate alternates between two states (state 0 first, random phase)."""
    def periods(k: int) -> np.ndarray:
        lens = np.empty(2 * k)
        if exponential:
            lens[0::2] = rng.exponential(means_s[0], k)
            lens[1::2] = rng.exponential(means_s[1], k)
        else:
            lens[0::2], lens[1::2] = means_s
        return lens

    k = int(duration_s / (means_s[0] + means_s[1]) * 1.5) + 20
    lens = periods(k)
    # Start in a random phase of the cycle so that t = 0 is not always the start of a burst.
    start = -rng.random() * (lens[0] + lens[1])
    while start + lens.sum() < duration_s:
        lens = np.concatenate([lens, periods(k)])
    starts = start + np.concatenate([[0.0], np.cumsum(lens)[:-1]])
    rate = np.tile(np.asarray(rates, dtype=float), len(lens) // 2)
    counts = rng.poisson(rate * lens)
    t = np.repeat(starts, counts) + rng.random(int(counts.sum())) * np.repeat(lens, counts)
    t = t[(t >= 0) & (t < duration_s)]
    return np.sort(t)


@dataclass(frozen=True)
class OnOff:
    """Bursts of Poisson arrivals at `rate_rps` for `on_s`, silence for `off_s` (exponential or fixed periods)."""

    rate_rps: float
    on_s: float
    off_s: float
    exponential: bool = True

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        return _modulated(rng, duration_s, (self.rate_rps, 0.0), (self.on_s, self.off_s), self.exponential)

    def mean_rate_rps(self) -> float:
        return self.rate_rps * self.on_s / (self.on_s + self.off_s)


@dataclass(frozen=True)
class MarkovModulated:
    """Two-state Markov-modulated Poisson process with a given mean rate and burst factor.

    In the burst state the rate is ``burst_factor x rate_rps``; bursts take `burst_fraction` of the time
    and last `burst_s` on average (exponential); the quiet rate makes the long-run mean exactly
    `rate_rps`. burst_factor = 1 is plain Poisson; burst_factor = 1 / burst_fraction is on/off.
    """

    rate_rps: float  # long-run mean
    burst_factor: float
    burst_fraction: float = 0.1
    burst_s: float = 1.0

    @property
    def rates_rps(self) -> tuple[float, float]:
        hi = self.burst_factor * self.rate_rps
        lo = self.rate_rps * (1 - self.burst_factor * self.burst_fraction) / (1 - self.burst_fraction)
        return hi, max(lo, 0.0)

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        quiet_s = self.burst_s * (1 - self.burst_fraction) / self.burst_fraction
        return _modulated(rng, duration_s, self.rates_rps, (self.burst_s, quiet_s), True)

    def mean_rate_rps(self) -> float:
        return self.rate_rps


@dataclass(frozen=True)
class ClosedLoop:
    """N users, each sending its next request a think time (exponential, mean `think_s`) after the last answer."""

    users: int
    think_s: float

    def after(self, rng: np.random.Generator, finish_s: float) -> float:
        """When a user whose request finished at `finish_s` sends the next one (the load generator calls this)."""
        return finish_s + float(rng.exponential(self.think_s))

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        """Offline approximation: every answer is instantaneous, so each user is a renewal process."""
        if self.think_s <= 0:
            raise ValueError("a closed loop with zero think time has no offline arrival times")
        k = int(duration_s / self.think_s * 1.2) + 20
        gaps = rng.exponential(self.think_s, size=(self.users, k))
        gaps[:, 0] = rng.random(self.users) * self.think_s  # users start staggered over one think time
        t = np.cumsum(gaps, axis=1)
        while t[:, -1].min() < duration_s:
            more = np.cumsum(rng.exponential(self.think_s, size=(self.users, k)), axis=1) + t[:, -1:]
            t = np.concatenate([t, more], axis=1)
        t = t.ravel()
        return np.sort(t[t < duration_s])

    def mean_rate_rps(self) -> float:
        return self.users / self.think_s


@dataclass(frozen=True)
class TraceTimes:
    """A trace's own timestamps, multiplied by `time_scale` (0.5 replays twice as fast)."""

    timestamps_s: tuple[float, ...]
    time_scale: float = 1.0

    def times(self, rng: np.random.Generator, duration_s: float) -> np.ndarray:
        t = np.asarray(self.timestamps_s, dtype=float) * self.time_scale
        return t[t < duration_s]

    def mean_rate_rps(self) -> float:
        t = np.asarray(self.timestamps_s) * self.time_scale
        span = float(t.max() - t.min()) if len(t) > 1 else 0.0
        return (len(t) - 1) / span if span > 0 else 0.0


def _positive_duration(v: Any) -> float:
    return units.parse_duration_s(v, allow_zero=False)


def _positive_rate(v: Any) -> float:
    r = units.parse_request_rate_rps(v)
    if r <= 0:
        raise ValueError(f"{v!r} must be above zero")
    return r


def parse_arrivals(value: Any, path: str, source: str | None = None) -> ArrivalProcess:
    """The scenario form: ``{process: poisson, rate: 2/s, steps: [...]}``, ``onoff``, ``mmpp``, ``closed``.

    ``trace`` arrivals come from the workload's trace (see traffic.workload); here they need no options.
    """
    f = Fields(value, path, source)
    kind = f.choice("process", PROCESSES, "poisson")
    out: Any
    if kind == "poisson":
        steps = []
        for s in f.items("steps"):
            steps.append(RateStep(s.get("at", units.parse_duration_s), s.get("rate", units.parse_request_rate_rps), s.get("ramp", units.parse_duration_s, 0.0)))
            s.done()
        for i in range(1, len(steps)):
            if steps[i].at_s < steps[i - 1].at_s + steps[i - 1].ramp_s:
                raise FieldError(f"{f.name('steps')}[{i}].at", "steps must be in time order and not start inside the previous ramp", source)
        out = Poisson(f.get("rate", units.parse_request_rate_rps), tuple(steps))
    elif kind == "onoff":
        out = OnOff(f.get("rate", _positive_rate), f.get("on", _positive_duration), f.get("off", _positive_duration),
                    f.choice("periods", ("exponential", "fixed"), "exponential") == "exponential")
    elif kind == "mmpp":
        out = MarkovModulated(f.get("rate", _positive_rate), f.get("burst_factor", number),
                              f.get("burst_fraction", units.parse_fraction, 0.1), f.get("burst", _positive_duration, 1.0))
        if out.burst_factor < 1:
            raise f.error("burst_factor", f"{out.burst_factor:g} must be >= 1 (peak rate / mean rate)")
        if not 0 < out.burst_fraction < 1:
            raise f.error("burst_fraction", "must be strictly between 0 and 1")
        if out.burst_factor * out.burst_fraction > 1 + 1e-9:
            raise f.error("burst_factor", f"{out.burst_factor:g} x burst_fraction {out.burst_fraction:g} exceeds 1: "
                          f"the bursts alone would exceed the mean rate; use burst_factor <= {1 / out.burst_fraction:g}")
    elif kind == "closed":
        out = ClosedLoop(f.get("users", at_least_one), f.get("think", _positive_duration))
    else:
        out = TraceTimes(())  # the workload fills in the trace's timestamps and workload.trace.time_scale
    f.done()
    return out
