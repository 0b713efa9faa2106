"""Hardware compute profiles: how long one instance takes to prefill l tokens and to run one decode step.

A profile is a fitted curve plus the data it was fitted to and where that data came from, so every
figure computed from it can say how it was obtained. Profiles are data (YAML in ``profiles/``), or a
CSV/JSON of measured points. The serving plane's ``profile`` compute mode and the analytical
throughput model (``analysis/throughput_model.py``) both read them through `load_profile`.

Prefill model: ``T(l) = c0 + c1 l + c2 l^2`` (a polynomial of degree <= 2 fitted by least squares to
the published / measured points; the quadratic term is attention's cost). With a cached prefix of c
tokens only the increment is computed: ``T(l | c) = c0 + c1 (l - c) + c2 (l^2 - c^2)`` (the per-request
overhead stays; new tokens still attend to the cached ones).
Decode model: ``T_step(b) = step_s + per_sequence_s * b`` for a batch of b <= max_batch.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from testbed import units
from testbed.errors import UserError
from testbed.validation import (Fields, count_up_to, mapping, non_negative, path_exists, path_is_file, plain_name, positive_number,
                                read_json, read_text, read_yaml, string, text)

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
# Short names: a chip alone means that chip running the paper's 1T hybrid (the case study's profiles).
ALIASES = {"h200": "h200-paper-1t-hybrid", "h20": "h20-paper-1t-hybrid"}


@dataclass(frozen=True)
class DecodeProfile:
    step_s: float
    per_sequence_s: float = 0.0
    max_batch: int = 1
    provenance: str = ""

    def step_time_s(self, batch_size: Any) -> Any:
        b = np.asarray(batch_size, dtype=float)
        if np.any(b < 1) or np.any(b > self.max_batch):
            raise UserError(f"decode batch size must be within 1..{self.max_batch} (the profile's max_batch)")
        out = self.step_s + self.per_sequence_s * b
        return float(out) if np.ndim(out) == 0 else out


@dataclass(frozen=True)
class ComputeProfile:
    """One chip type running one model, `gpus_per_instance` GPUs per instance."""

    name: str
    chip: str
    model: str
    coefficients: tuple[float, ...]  # c0 [s], c1 [s/token], c2 [s/token^2]
    points_tokens: tuple[float, ...] = ()
    points_s: tuple[float, ...] = ()
    decode: DecodeProfile | None = None
    gpus_per_instance: int = 8
    provenance: str = ""
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def prefill_time_s(self, tokens: Any, cached_tokens: Any = 0) -> Any:
        """Prefill latency of one request of `tokens` total tokens of which `cached_tokens` are a prefix hit."""
        l = np.asarray(tokens, dtype=float)
        c = np.asarray(cached_tokens, dtype=float)
        if np.any(l < 0) or np.any(c < 0) or np.any(c > l):
            raise UserError("prefill tokens must be >= 0 and cached_tokens within 0..tokens")
        c0, c1, c2 = (tuple(self.coefficients) + (0.0, 0.0, 0.0))[:3]
        out = c0 + c1 * (l - c) + c2 * (l * l - c * c)
        return float(out) if np.ndim(out) == 0 else out

    def decode_step_s(self, batch_size: Any) -> Any:
        if self.decode is None:
            raise UserError(f"profile {self.name!r} has no decode data (it is a prefill-only profile)")
        return self.decode.step_time_s(batch_size)

    @property
    def max_batch(self) -> int:
        if self.decode is None:
            raise UserError(f"profile {self.name!r} has no decode data (it is a prefill-only profile)")
        return self.decode.max_batch

    def fit_residuals_s(self) -> np.ndarray:
        """Fitted minus given latency at each data point (how well the curve matches its source)."""
        return np.asarray(self.prefill_time_s(np.array(self.points_tokens))) - np.array(self.points_s)


def fit_prefill(tokens: Any, seconds: Any, degree: int | None = None) -> tuple[float, ...]:
    """Least-squares polynomial (degree <= 2, below the number of distinct lengths) in increasing powers; refuses curves
    that fall or go <= 0."""
    l = np.asarray(tokens, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if l.size == 0 or l.size != t.size:
        raise UserError("prefill points: need at least one (tokens, seconds) pair")
    if np.any(l <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise UserError("prefill points: tokens and seconds must be positive numbers")
    distinct = np.unique(l).size  # repeated lengths do not make a curve: three points at one length fitted a quadratic
    deg = min(2, distinct - 1) if degree is None else degree
    if deg > distinct - 1:
        raise UserError(f"prefill fit of degree {deg} needs points at {deg + 1} lengths or more, got {distinct}")
    coeffs = np.polyfit(l, t, deg)[::-1] if deg > 0 else np.array([t.mean()])
    grid = np.linspace(0, l.max(), 256)
    curve = np.polyval(coeffs[::-1], grid)
    if np.any(curve <= 0) or np.any(np.diff(curve) < -1e-12):
        raise UserError("prefill points: the fitted curve is not positive and non-decreasing over 0..max tokens; check or add points")
    return tuple(float(c) for c in coeffs)


# What a profile file may hold (docs/analysis.md, "Compute profiles"): a prefill point's tokens within
# 1..`units.MAX_TOKENS`, every time above 0 and at most a week (`units.MAX_DURATION_S`), a decode batch of at most
# MAX_BATCH and an instance of at most MAX_GPUS GPUs. NaN, infinite, 1e400 or a word in any of them, a
# `scaled_from` loop, or a degree that is not 0-2 were tracebacks or read as is before 2026-12-07.
MAX_BATCH = 65536
MAX_GPUS = 1024


def _seconds(v: Any) -> float:
    x = positive_number(v)
    if x > units.MAX_DURATION_S:
        raise ValueError(f"{v!r} is more than a week ({units.MAX_DURATION_S:g} s)")
    return x


def _point(v: Any) -> tuple[float, float]:
    """One measured prefill point: [tokens, seconds]."""
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(f"{v!r} is not a [tokens, seconds] pair")
    tokens = units.finite_number(v[0], "a number of tokens")
    if not 1 <= tokens <= units.MAX_TOKENS:
        raise ValueError(f"tokens {v[0]!r} is not within 1..{units.MAX_TOKENS}")
    return tokens, _seconds(v[1])


def _points(v: Any) -> list[tuple[float, float]]:
    if not isinstance(v, list) or not v:
        raise ValueError("must be a non-empty list of [tokens, seconds] pairs")
    out = []
    for i, p in enumerate(v, start=1):
        try:
            out.append(_point(p))
        except ValueError as exc:
            raise ValueError(f"point {i}: {exc}") from None
    return out


def _degree(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2:
        raise ValueError(f"{v!r} is not 0, 1 or 2 (the polynomial's degree)")
    return v


def _label(v: Any) -> str:
    """A name, chip or model: a plain name (`validation.plain_name`: text, a whole number read as one, at most
    `MAX_NAME_BYTES`); ``name: .inf`` or a 400-digit number were names before 2026-12-07."""
    return plain_name(v, "the profile, its chip or its model")


def _time_or_zero(v: Any) -> float:
    return 0.0 if non_negative(v) == 0 else _seconds(v)


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"must be a list of [batch, context, seconds], got {type(v).__name__}")
    return v


def _decode(parent: Fields) -> DecodeProfile | None:
    """The ``decode`` mapping of `parent` (None when it has none, or null)."""
    if parent.data.get("decode") is None:
        parent.mark_read("decode")
        return None
    f = parent.section("decode")
    out = DecodeProfile(f.get("step_s", _seconds), f.get("per_sequence_s", _time_or_zero, 0.0),
                        f.get("max_batch", count_up_to(MAX_BATCH), 1), f.get("provenance", string, ""))
    f.get("points", _list, None)  # as measured, kept beside the fit (extra["decode_points"])
    f.done()
    return out


def _fitted(where: str, name: str, points: list[tuple[float, float]], degree: int | None, decode: DecodeProfile | None,
            **rest: Any) -> ComputeProfile:
    try:
        coeffs = fit_prefill([p[0] for p in points], [p[1] for p in points], degree)
    except UserError as exc:  # fit_prefill's own words, with the file's name
        raise UserError(f"{where}: {exc}") from None
    return ComputeProfile(name=name, coefficients=coeffs, points_tokens=tuple(p[0] for p in points),
                          points_s=tuple(p[1] for p in points), decode=decode, source=where, **rest)


def profile_from_dict(data: Any, where: str, _chain: tuple[str, ...] = ()) -> ComputeProfile:
    """Build a profile from its YAML mapping (``prefill.points`` fitted, or ``scaled_from`` another profile).
    `_chain`: the files being read, so a profile scaled from itself is an error, not a RecursionError."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a profile must be a mapping of keys to values, got {type(data).__name__}")
    f = Fields(data, "", where)
    decode = _decode(f)
    rest = {"chip": f.get("chip", _label, "unknown"), "model": f.get("model", _label, "unknown"),
            "gpus_per_instance": f.get("gpus_per_instance", count_up_to(MAX_GPUS), 8),
            "provenance": f.get("provenance", string, "").strip()}
    name = f.get("name", _label, Path(where).stem)
    measured = f.get("measured", mapping, None)  # written by `prfaas profile` (testbed.models.profiling): host, variant, fit errors
    if f.has("scaled_from"):
        if f.has("prefill"):
            raise f.error("prefill", "give prefill points or scaled_from, not both")
        sf = f.section("scaled_from")
        base = load_profile(sf.get("profile", text), _chain=_chain + (where,))
        k = sf.get("factor", positive_number)
        for t in base.points_s:  # the scaled times are read as the file's own: 1e300 made a profile of 1e299-s prefills
            try:
                _seconds(t * k)
            except ValueError as exc:
                raise sf.error("factor", f"{k:g} x the {t:g}-s point of {base.name}: {exc}") from None
        sf.done()
        extra: dict[str, Any] = {"scaled_from": base.name, "factor": k}
        out = ComputeProfile(name=name, coefficients=tuple(c * k for c in base.coefficients), points_tokens=base.points_tokens,
                             points_s=tuple(v * k for v in base.points_s), decode=decode, source=where, extra=extra, **rest)
    else:
        pre = f.section("prefill")
        if not f.has("prefill") or not isinstance(data.get("prefill"), dict):
            raise f.error("prefill", "is required: a mapping with points, a list of [tokens, seconds] pairs (or give scaled_from)")
        points = pre.get("points", _points)
        degree = pre.get("degree", _degree, None)
        pre.done()
        out = _fitted(where, name, points, degree, decode, extra={}, **rest)
    f.done()
    if measured is not None:
        out.extra["measured"] = measured
    if decode is not None and isinstance(data["decode"].get("points"), list):
        out.extra["decode_points"] = data["decode"]["points"]
    return out


def measured_profile(path: Path, chip: str = "this-host", model: str = "measured") -> ComputeProfile:
    """A profile from measured points: CSV with columns ``tokens,prefill_s`` (optionally ``batch_size,decode_step_s``
    rows) or JSON ``{"prefill": [[tokens, s], ...], "decode": {...}, "chip": ..., "model": ..., "provenance": ...}``
    (other keys of the JSON are ignored)."""
    where = str(path)
    if path.suffix == ".json":
        data = read_json(path, 'a measured profile ({"prefill": [[tokens, seconds], ...], ...})')
        if not isinstance(data, dict) or "prefill" not in data:
            raise UserError(f'{where}: expected {{"prefill": [[tokens, seconds], ...], ...}}')
        f = Fields(data, "", where)
        return _fitted(where, f.get("name", _label, path.stem), f.get("prefill", _points), None, _decode(f),
                       chip=f.get("chip", _label, chip), model=f.get("model", _label, model), gpus_per_instance=8,
                       provenance=f.get("provenance", string, f"measured points from {where}"), extra={})
    text_ = read_text(path, "a measured profile (CSV with columns tokens,prefill_s)")
    try:
        rows = list(csv.DictReader(text_.splitlines()))
    except csv.Error as exc:
        raise UserError(f"{where}: not CSV ({exc})") from None
    if not rows or "tokens" not in rows[0] or "prefill_s" not in rows[0]:
        raise UserError(f"{where}: a measured CSV needs a header with columns tokens,prefill_s and a row under it")
    pts = []
    for i, r in enumerate(rows, start=2):
        if r.get("tokens") not in (None, "") and r.get("prefill_s") not in (None, ""):
            try:
                pts.append(_point((float(r["tokens"]), float(r["prefill_s"]))))
            except ValueError as exc:
                raise UserError(f"{where}: line {i}: tokens and prefill_s must be numbers ({exc})") from None
    if not pts:
        raise UserError(f"{where}: no row has both tokens and prefill_s")
    return _fitted(where, path.stem, pts, None, None, chip=chip, model=model, gpus_per_instance=8,
                   provenance=f"measured points from {where}", extra={})


# What a profile's `model` is when its file does not say: a YAML profile without `model`, a measured CSV or JSON without it.
UNNAMED_MODELS = ("unknown", "measured")


def is_of_model(profile: ComputeProfile, model: str) -> bool:
    """Whether `profile`'s times can stand for `model` (a spec's name): a case-insensitive match, as presets are; a
    profile that names no model (`UNNAMED_MODELS`) is taken as given."""
    return profile.model in UNNAMED_MODELS or profile.model.lower() == model.lower()


def check_model(profile: ComputeProfile, model: str) -> None:
    """Refuse `profile` for a run or model of `model` (a spec's name) when the profile is of another model
    (`is_of_model`): its times are another model's. A scenario of kimi-linear-48b with the paper's 1T-hybrid profiles
    ran without a word before 2026-12-07: that model's KV bytes at another model's prefill times."""
    if not is_of_model(profile, model):
        raise UserError(f"profile {profile.name!r} is of model {profile.model!r}, not {model!r} (the scenario's model): "
                        f"name a profile of {model!r}, or write one (prfaas profile --model ...; a profile scaled_from another "
                        f"with its own model: {model})")


def available_profiles() -> list[str]:
    return sorted([p.stem for p in PROFILES_DIR.glob("*.yaml")] + list(ALIASES))


def load_profile(name_or_file: str | Path, *, _chain: tuple[str, ...] = ()) -> ComputeProfile:
    """A ready profile by name (``h200-paper-1t-hybrid``), a YAML profile file, or measured points (.csv/.json)."""
    if not isinstance(name_or_file, (str, Path)) or not str(name_or_file):
        raise UserError(f"profile: give a name or a file, got {name_or_file!r} (ready: {', '.join(available_profiles())})")
    p = Path(name_or_file)
    if p.suffix in (".csv", ".json"):
        return measured_profile(p)
    if p.suffix in (".yaml", ".yml") and path_exists(p):
        path = p
    else:
        path = PROFILES_DIR / f"{ALIASES.get(str(name_or_file), name_or_file)}.yaml"
        if not path_exists(path):
            if path_is_file(p):  # a file, but not a kind a profile can be
                raise UserError(f"profile {str(name_or_file)!r}: a profile file ends in .yaml or .yml (a profile), or .csv or "
                                f".json (measured points); this one ends in {repr(p.suffix) if p.suffix else 'no suffix'}")
            raise UserError(f"profile {str(name_or_file)!r}: no such file, and not a ready profile (ready: {', '.join(available_profiles())})")
    if str(path) in _chain:
        raise UserError(f"{_chain[-1]}: scaled_from.profile: {str(name_or_file)!r} is scaled from itself "
                        f"({' -> '.join(_chain + (str(path),))})")
    data = read_yaml(path, "a compute profile (a YAML mapping of chip, model, ...: docs/analysis.md)")
    return profile_from_dict(data, str(path), _chain)
