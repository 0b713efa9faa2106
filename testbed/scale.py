"""`Scale`: how many emulated units one wire unit stands for.

A scenario is written in emulated units (a 100 Gbps WAN, KV caches of a 1T model). The host cannot
carry that, so the wire carries everything divided by the scale S: rates, KV bytes, queue limits.
Every measurement taken on the wire (tx counters, backlog, bytes sent) is multiplied by S to be read
in emulated units again. This is the one place that knows the direction of each conversion, and the
only place that checks S >= 1 (see docs/network.md, "Scale").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

# float, int, numpy arrays and pandas Series all convert the same way.
N = TypeVar("N")


@dataclass(frozen=True)
class Scale:
    """Emulated units per wire unit (``Scale(20)``: a 100 Gbps scenario runs at 5 Gbps on the wire)."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise ValueError(f"{f!r} must be a number >= 1 (the wire carries emulated rates / scale)")
        object.__setattr__(self, "factor", float(f))

    @classmethod
    def of(cls, value: "Scale | float") -> "Scale":
        """A `Scale` from a number (configs and JSON carry the factor) or a `Scale` itself."""
        return value if isinstance(value, Scale) else cls(value)

    def __float__(self) -> float:
        return self.factor

    def __str__(self) -> str:
        return f"{self.factor:g}"

    # rates (bit/s)
    def wire_bps(self, emulated_bps: N) -> N:
        """The rate the wire carries for an emulated rate."""
        return emulated_bps / self.factor  # type: ignore[operator]

    def emulated_bps(self, wire_bps: N) -> N:
        """The emulated rate a rate measured on the wire stands for."""
        return wire_bps * self.factor  # type: ignore[operator]

    # bytes (KV caches, transfers, queue backlog)
    def wire_bytes(self, emulated_bytes: N) -> N:
        """Bytes on the wire for emulated bytes (not rounded: callers round where a count is needed)."""
        return emulated_bytes / self.factor  # type: ignore[operator]

    def emulated_bytes(self, wire_bytes: N) -> N:
        """The emulated bytes that bytes counted on the wire (sent, queued) stand for."""
        return wire_bytes * self.factor  # type: ignore[operator]
