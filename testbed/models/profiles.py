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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from testbed.errors import UserError
from testbed.validation import path_exists, path_is_file, read_yaml

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
    """Least-squares polynomial (degree <= 2, <= points - 1) in increasing powers; refuses curves that fall or go <= 0."""
    l = np.asarray(tokens, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if l.size == 0 or l.size != t.size:
        raise UserError("prefill points: need at least one (tokens, seconds) pair")
    if np.any(l <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise UserError("prefill points: tokens and seconds must be positive numbers")
    deg = min(2, l.size - 1) if degree is None else degree
    if deg > l.size - 1:
        raise UserError(f"prefill fit of degree {deg} needs at least {deg + 1} points, got {l.size}")
    coeffs = np.polyfit(l, t, deg)[::-1] if deg > 0 else np.array([t.mean()])
    grid = np.linspace(0, l.max(), 256)
    curve = np.polyval(coeffs[::-1], grid)
    if np.any(curve <= 0) or np.any(np.diff(curve) < -1e-12):
        raise UserError("prefill points: the fitted curve is not positive and non-decreasing over 0..max tokens; check or add points")
    return tuple(float(c) for c in coeffs)


def _decode(d: Any, where: str) -> DecodeProfile | None:
    if d is None:
        return None
    if not isinstance(d, dict) or "step_s" not in d:
        raise UserError(f"{where}: decode must be a mapping with step_s (and optional per_sequence_s, max_batch, provenance)")
    unknown = set(d) - {"step_s", "per_sequence_s", "max_batch", "provenance", "points"}
    if unknown:
        raise UserError(f"{where}: decode.{sorted(unknown)[0]}: unknown key; allowed: step_s, per_sequence_s, max_batch, provenance, points")
    try:
        out = DecodeProfile(float(d["step_s"]), float(d.get("per_sequence_s", 0.0)), int(d.get("max_batch", 1)), str(d.get("provenance", "")))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: decode: {exc}") from None
    if out.step_s <= 0 or out.max_batch < 1 or out.per_sequence_s < 0:
        raise UserError(f"{where}: decode: step_s must be > 0, per_sequence_s >= 0, max_batch >= 1")
    return out


_KEYS = {"name", "chip", "model", "gpus_per_instance", "provenance", "prefill", "decode", "scaled_from", "measured"}


def profile_from_dict(data: Any, where: str) -> ComputeProfile:
    """Build a profile from its YAML mapping (``prefill.points`` fitted, or ``scaled_from`` another profile)."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a profile must be a mapping")
    unknown = set(data) - _KEYS
    if unknown:
        raise UserError(f"{where}: {sorted(unknown)[0]}: unknown key; allowed: {', '.join(sorted(_KEYS))}")
    name = str(data.get("name", Path(where).stem))
    decode = _decode(data.get("decode"), where)
    if "scaled_from" in data:
        s = data["scaled_from"]
        if not isinstance(s, dict) or "profile" not in s or "factor" not in s:
            raise UserError(f"{where}: scaled_from needs profile and factor")
        base = load_profile(str(s["profile"]))
        k = float(s["factor"])
        if k <= 0:
            raise UserError(f"{where}: scaled_from.factor must be > 0")
        coeffs = tuple(c * k for c in base.coefficients)
        pts_l, pts_s = base.points_tokens, tuple(v * k for v in base.points_s)
        extra = {"scaled_from": base.name, "factor": k}
    else:
        pre = data.get("prefill")
        if not isinstance(pre, dict) or "points" not in pre:
            raise UserError(f"{where}: prefill.points is required: a list of [tokens, seconds] pairs")
        try:
            pts = np.asarray(pre["points"], dtype=float)
        except (TypeError, ValueError):
            raise UserError(f"{where}: prefill.points must be a list of [tokens, seconds] pairs") from None
        if pts.ndim != 2 or pts.shape[1] != 2:
            raise UserError(f"{where}: prefill.points must be a list of [tokens, seconds] pairs")
        coeffs = fit_prefill(pts[:, 0], pts[:, 1], pre.get("degree"))
        pts_l, pts_s = tuple(pts[:, 0]), tuple(pts[:, 1])
        extra = {}
    if data.get("measured") is not None:  # written by `prfaas profile` (testbed.models.profiling): host, variant, fit errors
        if not isinstance(data["measured"], dict):
            raise UserError(f"{where}: measured must be a mapping (as `prfaas profile` writes it)")
        extra["measured"] = data["measured"]
    if isinstance(data.get("decode"), dict) and data["decode"].get("points") is not None:
        extra["decode_points"] = data["decode"]["points"]
    try:
        gpus = int(data.get("gpus_per_instance", 8))
    except (TypeError, ValueError):
        raise UserError(f"{where}: gpus_per_instance must be a whole number") from None
    return ComputeProfile(
        name=name,
        chip=str(data.get("chip", "unknown")),
        model=str(data.get("model", "unknown")),
        coefficients=coeffs,
        points_tokens=pts_l,
        points_s=pts_s,
        decode=decode,
        gpus_per_instance=gpus,
        provenance=str(data.get("provenance", "")).strip(),
        source=where,
        extra=extra,
    )


def measured_profile(path: Path, chip: str = "this-host", model: str = "measured") -> ComputeProfile:
    """A profile from measured points: CSV with columns ``tokens,prefill_s`` (optionally ``batch_size,decode_step_s``
    rows) or JSON ``{"prefill": [[tokens, s], ...], "decode": {...}, "chip": ..., "model": ..., "provenance": ...}``."""
    where = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"{where}: cannot read measured profile ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: measured profile is not UTF-8 text (at byte offset {exc.start}); CSV or JSON is expected") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, dict) or "prefill" not in data:
            raise UserError(f'{where}: expected {{"prefill": [[tokens, seconds], ...], ...}}')
        doc = {
            "name": data.get("name", path.stem),
            "chip": data.get("chip", chip),
            "model": data.get("model", model),
            "provenance": data.get("provenance", f"measured points from {where}"),
            "prefill": {"points": data["prefill"]},
            "decode": data.get("decode"),
        }
        return profile_from_dict(doc, where)
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or "tokens" not in rows[0] or "prefill_s" not in rows[0]:
        raise UserError(f"{where}: a measured CSV needs a header with columns tokens,prefill_s")
    pts = []
    for i, r in enumerate(rows, start=2):
        try:
            if r.get("tokens") not in (None, "") and r.get("prefill_s") not in (None, ""):
                pts.append((float(r["tokens"]), float(r["prefill_s"])))
        except ValueError:
            raise UserError(f"{where}: line {i}: tokens and prefill_s must be numbers") from None
    doc = {"name": path.stem, "chip": chip, "model": model, "provenance": f"measured points from {where}", "prefill": {"points": pts}}
    return profile_from_dict(doc, where)


def available_profiles() -> list[str]:
    return sorted([p.stem for p in PROFILES_DIR.glob("*.yaml")] + list(ALIASES))


def load_profile(name_or_file: str | Path) -> ComputeProfile:
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
    data = read_yaml(path)
    return profile_from_dict(data, str(path))
