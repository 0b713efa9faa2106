"""The one units parser of the project: rates, durations, sizes, fractions, queue limits, token counts.

Every parser takes a string such as ``"100Gbps"``, ``"10ms"``, ``"2MB"``, ``"0.1%"``, ``"1bdp"``, ``"32K"``
and returns a number in base units (bit/s, seconds, bytes, a fraction, tokens). A value without a
unit is refused where a unit is needed, so ``rate: 100`` cannot silently mean 100 bit/s.
Parsers raise ``ValueError`` whose message lists what is allowed; `validation.Fields` adds the field name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from testbed.packet import MTU_BYTES

_NUM = r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_RE = re.compile(rf"^\s*{_NUM}\s*([A-Za-z%]*)\s*$")

RATE_UNITS = {
    "bps": 1.0, "bit": 1.0,
    "kbps": 1e3, "kbit": 1e3,
    "mbps": 1e6, "mbit": 1e6,
    "gbps": 1e9, "gbit": 1e9,
    "tbps": 1e12, "tbit": 1e12,
}
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}
# The longest duration and the highest rate a value may be: a week (no emulated run or timeout comes near; Python's
# waits overflow at ~292 years) and 1000 Tbps (past any link; a tc rate overflows at ~1.5e20 bit/s). Both accepted
# 1e30 before (`duration: 1e30s` was "valid" until the workload refused it at run time; 2026-12-06).
MAX_DURATION_S = 7 * 24 * 3600.0
MAX_RATE_BPS = 1e15
# The lowest rate the wire may be shaped or paced at: 8 Kbps (1000 bytes/s). Every rate of a scenario is one the wire
# carries (divided by `scale`), so it is the lowest a rate may be, and `scale` may not take one below it. tc hands the
# kernel a shaper's burst as a 32-bit count of 64-ns ticks (at most ~275 s), and the shaper's smallest burst (two
# 64 KiB GSO packets, `testbed.net.shaping.MIN_BURST_BYTES`) lasts longer than that below 3.82 Kbps: HTB and TBF both
# failed to install there (pyroute2: "'I' format requires 0 <= number <= 4294967295"), and below 8 bit/s the rate is
# 0 bytes/s, tc's unit. iperf3 (cross traffic) reads a rate under 1 bit/s as 0, unlimited. 8 Kbps is twice the burst
# bound and a whole number of bytes/s. `scale: 1e30` put a 100 Gbps WAN at 1e-19 bit/s and passed (2026-12-07).
MIN_WIRE_RATE_BPS = 8e3
# The most tokens a count may be: 16M, past any model's context (the longest published is ~10M) and still a small
# number for the arrays a workload draws. `workload.input: 1e30` was a numpy OverflowError traceback, a 10**30-token
# uniform range another, and `policy.threshold: 1e30` passed (2026-12-06).
MAX_TOKENS = 16 * 1024 * 1024

# The largest queue: 4 GiB - 1 byte, the kernel's 32-bit byte limit of the queue (bfifo, tbf), and at most 1000 BDPs.
# `queue: 1e300MB` passed `prfaas check` (tc refuses it in a run) and `queue: 1e300bdp` was an OverflowError traceback
# in it (2026-12-07). A BDP queue's bytes on the wire (rate / scale x RTT) are not bounded here.
MAX_QUEUE_BYTES = 2**32 - 1
MAX_QUEUE_BDP = 1000.0
# The largest size: 2**63 - 1 bytes (8 EiB), the most a signed 64-bit count holds (a numpy or parquet column, a C
# struct), past any memory or disk. `kv_state_bytes: 1e308TB` was an OverflowError traceback (the bytes are infinite as a
# float), and `1e300MB` passed as a 307-digit count (2026-12-08).
MAX_SIZE_BYTES = 2**63 - 1

RATE_HELP = "a positive number with a unit: bps, Kbps, Mbps, Gbps, Tbps (e.g. 100Gbps)"
DURATION_HELP = "a number with a unit: us, ms, s, min, h (e.g. 10ms)"
SIZE_HELP = "a number with a unit: B, KB, MB, GB (10^3) or KiB, MiB, GiB (2^10) (e.g. 2MB)"
FRACTION_HELP = "a percentage between 0% and 100% (e.g. 0.1%) or a number between 0 and 1"
QUEUE_HELP = "a size (e.g. 2MB), a packet count (e.g. 1000p) or a multiple of the bandwidth-delay product (e.g. 1bdp)"
TOKENS_HELP = "a whole number of tokens, optionally with K (x1024) or M (x1024^2), e.g. 32K"


# A number in exponent notation that YAML 1.1 (PyYAML) reads as text: it takes one only with a '.' and a signed exponent
# (1.0e+3), so `probe_bdp: 1e308` or `--set x=1e3` gave "'1e308' is not a number" (2026-12-07).
_YAML_TEXT_EXPONENT = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?)(\d+)$")


def finite_number(v: object, what: str) -> float:
    """An int or float (not a bool) as a finite float, else ``ValueError`` saying `v` is not `what`. YAML's
    ``.nan`` / ``.inf`` are floats and a whole number past 1.8e308 (``10**400``) has no float: neither is a quantity.
    Text that is a number in exponent notation (``1e3``: YAML did not read it as one) is refused saying how to write it."""
    m = _YAML_TEXT_EXPONENT.match(v.strip()) if isinstance(v, str) else None
    if m and math.isfinite(float(m.group(0))):
        mantissa, sign, exponent = m.groups()
        written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign or '+'}{exponent}"
        raise ValueError(f"{v!r} is text, not {what} (YAML reads a number with an exponent only with a '.' and a sign: "
                         f"write {written})")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{v!r} is not {what}")
    try:
        x = float(v)
    except OverflowError:
        raise ValueError(f"a {len(str(abs(v)))}-digit number is out of range; use {what}") from None
    if not math.isfinite(x):
        raise ValueError(f"{v!r} is not {what}")
    return x


def _split(text: object, what: str) -> tuple[float, str]:
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not {what}")
    if isinstance(text, (int, float)):
        return finite_number(text, what), ""
    m = _RE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not {what}")
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not {what}")
    return value, m.group(2).lower()


def parse_rate_bps(text: object) -> float:
    """``"10Gbps"`` -> 1e10. Decimal prefixes, as tc and iperf3 use for bits."""
    value, unit = _split(text, RATE_HELP)
    if value <= 0:  # said first: a bare -1 was "has no rate unit", and -1Gbps refused next
        raise ValueError(f"{text!r} must be positive; use {RATE_HELP}")
    if unit not in RATE_UNITS:
        raise ValueError(f"{text!r} has no rate unit; use {RATE_HELP}")
    bps = value * RATE_UNITS[unit]
    if bps < MIN_WIRE_RATE_BPS:
        raise ValueError(f"{text!r} is less than 8Kbps, the lowest rate the wire can be shaped at; use 8Kbps or more")
    if bps > MAX_RATE_BPS:
        raise ValueError(f"{text!r} is more than 1000Tbps, past any network link; use {RATE_HELP}")
    return bps


def parse_duration_s(text: object, *, allow_zero: bool = True, most_s: float = MAX_DURATION_S,
                     most: str = "a week (168h), the most a duration may be") -> float:
    """``"10ms"`` -> 0.01. A bare ``0`` is accepted (zero needs no unit); other bare numbers are not. Longer than
    `most_s` is refused, the message saying "longer than `most`"."""
    value, unit = _split(text, DURATION_HELP)
    if value < 0:  # said first: a bare -1 was "has no time unit", and -1s refused next
        raise ValueError(f"{text!r} must not be negative; use {DURATION_HELP}")
    if unit == "" and value == 0:
        return 0.0 if allow_zero else _refuse_zero(text)
    if unit not in DURATION_UNITS:
        raise ValueError(f"{text!r} has no time unit; use {DURATION_HELP}")
    seconds = value * DURATION_UNITS[unit]
    if seconds > most_s:
        raise ValueError(f"{text!r} is longer than {most}")
    if seconds == 0 and not allow_zero:
        _refuse_zero(text)
    return seconds


def _refuse_zero(text: object) -> float:
    raise ValueError(f"{text!r} must be greater than zero; use {DURATION_HELP}")


def parse_size_bytes(text: object) -> int:
    """``"2MB"`` -> 2_000_000, ``"1MiB"`` -> 1_048_576."""
    value, unit = _split(text, SIZE_HELP)
    if value < 0:  # said first: a bare -1 was "has no size unit", and -1B refused next
        raise ValueError(f"{text!r} must not be negative; use {SIZE_HELP}")
    if unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} has no size unit; use {SIZE_HELP}")
    n = value * SIZE_UNITS[unit]
    if n > MAX_SIZE_BYTES:
        raise ValueError(f"{text!r} is more than 8EiB (2**63 - 1 bytes), past any memory or disk; use {SIZE_HELP}")
    return int(round(n))


def parse_fraction(text: object) -> float:
    """``"0.1%"`` -> 0.001; a bare number is a fraction in [0, 1]."""
    value, unit = _split(text, FRACTION_HELP)
    if unit == "%":
        value /= 100.0
    elif unit != "":
        raise ValueError(f"{text!r} is not {FRACTION_HELP}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{text!r} is out of range; use {FRACTION_HELP}")
    return value


def parse_tokens(text: object) -> int:
    """``"32K"`` -> 32768 (the paper's convention: 1K = 1024 tokens)."""
    value, unit = _split(text, TOKENS_HELP)
    if unit not in TOKEN_UNITS:
        raise ValueError(f"{text!r} is not {TOKENS_HELP}")
    n = value * TOKEN_UNITS[unit]
    if n > MAX_TOKENS:  # first: ``1e308K`` is infinitely many, which `round` cannot take (an OverflowError traceback)
        raise ValueError(f"{text!r} is more than 16M tokens, past any model's context; use {TOKENS_HELP}")
    if n < 0 or abs(n - round(n)) > 1e-9 * max(1.0, n):
        raise ValueError(f"{text!r} is not {TOKENS_HELP}")
    return int(round(n))


@dataclass(frozen=True)
class QueueLimit:
    """A queue limit as the user wrote it: bytes, packets, or a multiple of the bandwidth-delay product."""

    kind: str  # "bytes" | "packets" | "bdp"
    value: float

    def to_bytes(self, rate_bps: float, rtt_s: float, mtu_bytes: int = MTU_BYTES) -> int:
        """Resolve against a link: the BDP uses the rate and the round-trip time; floor one MTU."""
        if self.kind == "bytes":
            n = self.value
        elif self.kind == "packets":
            n = self.value * mtu_bytes
        else:
            n = self.value * rate_bps * rtt_s / 8.0
        return max(int(n), mtu_bytes)

    def __str__(self) -> str:
        suffix = {"bytes": "B", "packets": "p", "bdp": "bdp"}[self.kind]
        return f"{self.value:g}{suffix}"


def parse_queue(text: object) -> QueueLimit:
    """``"1bdp"``, ``"1000p"``, ``"1000pkt"``, ``"30MB"``."""
    value, unit = _split(text, QUEUE_HELP)
    if value <= 0:
        raise ValueError(f"{text!r} must be positive; use {QUEUE_HELP}")
    if unit == "bdp":
        if value > MAX_QUEUE_BDP:
            raise ValueError(f"{text!r} is more than {MAX_QUEUE_BDP:g}bdp, a queue of {MAX_QUEUE_BDP:g} round trips; use {QUEUE_HELP}")
        return QueueLimit("bdp", value)
    packets = unit in ("p", "pkt", "pkts", "packets")
    if not packets and unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not {QUEUE_HELP}")
    # its bytes bounded before any is made whole: 1e308p and 1e308TB are infinitely many as a float, which `int` cannot
    # take (an OverflowError traceback, 2026-12-08)
    if value * (MTU_BYTES if packets else SIZE_UNITS[unit]) > MAX_QUEUE_BYTES:  # a packet counts one MTU
        raise ValueError(f"{text!r} is more than {MAX_QUEUE_BYTES} bytes (4 GiB - 1), the most a queue's byte limit holds (tc's is 32-bit); use {QUEUE_HELP}")
    if packets and value != int(value):
        raise ValueError(f"{text!r}: a packet count must be whole; use {QUEUE_HELP}")
    return QueueLimit("packets", value) if packets else QueueLimit("bytes", float(parse_size_bytes(text)))


def format_rate(bps: float) -> str:
    for unit, scale in (("Tbps", 1e12), ("Gbps", 1e9), ("Mbps", 1e6), ("Kbps", 1e3)):
        if abs(bps) >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bps"


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


REQUEST_RATE_HELP = "a request rate: a number of requests per second, or with a unit: 2/s, 120/min, 2rps (e.g. 2/s)"
_REQUEST_RATE_UNITS = {"": 1.0, "/s": 1.0, "rps": 1.0, "/sec": 1.0, "/min": 1 / 60.0, "/m": 1 / 60.0, "/h": 1 / 3600.0}


def parse_request_rate_rps(text: object) -> float:
    """``"120/min"`` -> 2.0 requests/s; a bare number is requests per second (zero allowed: no arrivals)."""
    if isinstance(text, str) and "/" in text:
        num, _, unit = text.strip().partition("/")
        value, rest = _split(num, REQUEST_RATE_HELP)
        unit = "/" + unit.strip().lower()
        if rest:
            raise ValueError(f"{text!r} is not {REQUEST_RATE_HELP}")
    else:
        value, unit = _split(text, REQUEST_RATE_HELP)
    if unit not in _REQUEST_RATE_UNITS:
        raise ValueError(f"{text!r} is not {REQUEST_RATE_HELP}")
    rps = value * _REQUEST_RATE_UNITS[unit]
    if rps < 0:
        raise ValueError(f"{text!r} must not be negative; use {REQUEST_RATE_HELP}")
    return rps


def finite_or_none(x: object) -> float | None:
    """`x` as a float when it is a finite number, else None (missing, NaN, inf, not a number)."""
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
