"""A student's answers file, and the verdict on each answer.

An answer holds when it agrees, within the stated tolerance, with the same quantity recomputed from the
student's own run directories (or, for physics such as a BDP, from the configured rate and delay). A
verdict always says what was recomputed, from what, and the tolerance, so a failing answer teaches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from testbed.errors import UserError
from testbed.validation import path_is_file, read_yaml


@dataclass(frozen=True)
class Verdict:
    question: str  # dotted key in the answers file, e.g. "runs.q1.goodput_mbps"
    holds: bool
    why: str


def load_answers(path: Path) -> dict[str, Any]:
    if not path_is_file(path):  # a name no file can have (5000 characters): an OSError traceback before 2026-12-08
        raise UserError(f"{path}: no answers file (`prfaas lab start N` writes the template; fill it in)")
    data = read_yaml(path, "an answers file (a mapping of question -> answer, as in the template)")
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a mapping of question -> answer (see the template)")
    return data


def lookup(answers: dict[str, Any], key: str) -> Any:
    """The answer at a dotted key, or None when missing or left blank. Names may hold dots themselves
    (a run folder ``q0.25``): at each level the longest key that fits is taken."""
    node: Any = answers
    rest = key
    while rest:
        if not isinstance(node, dict):
            return None
        fits = [k for k in node if rest == str(k) or rest.startswith(f"{k}.")]
        if not fits:
            return None
        k = max(fits, key=lambda x: len(str(x)))
        node, rest = node[k], rest[len(str(k)) + 1:]
    return node


def _as_number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):  # 1e400 written out as an int: an OverflowError traceback before 2026-12-07
        return None
    return x if math.isfinite(x) else None


def number(answers: dict[str, Any], key: str, truth: float, *, rel: float, abs_: float = 0.0, unit: str = "",
           source: str = "") -> Verdict:
    """Holds when |answer - truth| <= max(rel x |truth|, abs_)."""
    raw = lookup(answers, key)
    given = _as_number(raw)
    tol = max(rel * abs(truth), abs_)
    src = f" from {source.strip()}" if source else ""
    if raw is None:
        return Verdict(key, False, f"not answered; recomputed{src}: {truth:.4g}{unit}")
    if given is None:
        return Verdict(key, False, f"{raw!r} is not a number; recomputed{src}: {truth:.4g}{unit}")
    ok = abs(given - truth) <= tol
    return Verdict(key, ok, f"you wrote {given:.4g}{unit}, recomputed{src}: {truth:.4g}{unit} (tolerance +/-{tol:.3g}{unit})")


def choice(answers: dict[str, Any], key: str, truth: str | tuple[str, ...], *, rule: str = "") -> Verdict:
    """A word or name; case and surrounding spaces aside it must be the one `rule` picks from the runs
    (or one of several, when the rule ties)."""
    raw = lookup(answers, key)
    if isinstance(raw, bool):  # YAML 1.1 reads an unquoted yes / no (on / off, true / false) as a bool
        raw = "yes" if raw else "no"
    ok_values = (truth,) if isinstance(truth, str) else tuple(truth)
    want = " or ".join(repr(str(t)) for t in ok_values)
    why = f" ({rule})" if rule else ""
    if raw is None:
        return Verdict(key, False, f"not answered; from your runs: {want}{why}")
    ok = str(raw).strip().lower() in {str(t).strip().lower() for t in ok_values}
    return Verdict(key, ok, f"you wrote {raw!r}, from your runs: {want}{why}")


def interval(answers: dict[str, Any], key: str, truth: tuple[float, float], *, rel: float, abs_: float = 0.0, unit: str = "",
             source: str = "") -> Verdict:
    """A [low, high] answer: each end within the tolerance of the recomputed end."""
    raw = lookup(answers, key)
    src = f" from {source.strip()}" if source else ""
    want = f"[{truth[0]:.4g}, {truth[1]:.4g}]{unit}"
    if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and all(_as_number(x) is not None for x in raw)):
        what = "not answered" if raw is None else f"{raw!r} is not [low, high]"
        return Verdict(key, False, f"{what}; recomputed{src}: {want}")
    lo, hi = (_as_number(x) for x in raw)
    tol = [max(rel * abs(t), abs_) for t in truth]
    ok = abs(lo - truth[0]) <= tol[0] and abs(hi - truth[1]) <= tol[1]
    return Verdict(key, ok, f"you wrote [{lo:.4g}, {hi:.4g}]{unit}, recomputed{src}: {want} (tolerance +/-{max(tol):.3g}{unit})")
