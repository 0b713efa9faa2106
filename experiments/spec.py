"""Experiment specifications (``prfaas experiment SPEC.yaml``): a scenario, arms that override it,
seeds and repetitions. Every bad value is one `FieldError` naming its key (exit status 2).

    name: policies-on-quick
    scenario: quick                 # a ready scenario's name, or a file (relative to this spec)
    set: {duration: 20s}            # overrides for every arm (optional)
    arms:                           # arm name -> its overrides (key: value, as --set key=value)
      prfaas: {policy.name: prfaas}
      fixed: {policy.name: fixed-threshold}
    seeds: [1, 2]                   # or a count: 3 means 1, 2, 3
    repetitions: 1                  # runs per (arm, seed); repeats measure the emulator's own noise
    baseline: fixed                 # optional: compare every arm with this one (default: every pair)
    metrics: [throughput_rps, ttft_s.p90]   # optional: the metrics compared (default: DEFAULT_METRICS)

Arms share seeds (and repetition numbers), so run (seed s, repetition r) of arm A and of arm B saw the
same workload and the same WAN schedule: comparisons are paired.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from testbed.errors import FieldError, UserError
from testbed.validation import Fields, name_or_stem, path_name, planned_runs, random_seed, read_yaml, run_count

# metric -> True when higher is better, False when lower is better, None when it has no direction
DEFAULT_METRICS: dict[str, bool | None] = {
    "throughput_rps": True,
    "goodput_rps": True,
    "good_fraction": True,
    "ttft_s.p50": False,
    "ttft_s.p90": False,
    "ttft_short_s.p90": False,
    "tpot_s.mean": False,
    "requests_failed": False,
    "offload_fraction": None,
    "prefix_cache.hit_tokens": True,
}
KNOWN_DIRECTIONS: dict[str, bool | None] = {**DEFAULT_METRICS, "ttft_s.p99": False, "ttft_s.mean": False, "tpot_s.p90": False,
                                            "ttft_client_s.p90": False, "ttft_client_s.p99": False,
                                            "egress_gbps.mean": None, "prefix_cache.efficiency": True}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]  # "key=value"


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    scenario: str  # a ready scenario's name or an absolute path
    overrides: tuple[str, ...]  # for every arm
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    repetitions: int
    baseline: str | None
    metrics: tuple[str, ...]

    def pairs(self) -> list[tuple[str, str]]:
        """The (A, B) comparisons: every arm against the baseline, or every pair in spec order."""
        names = [a.name for a in self.arms]
        if self.baseline is not None:
            return [(n, self.baseline) for n in names if n != self.baseline]
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def _overrides(value: Any, path: str, source: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list) and all(isinstance(x, str) and "=" in x for x in value):
        return tuple(value)
    raise FieldError(path, "give a mapping of key: value (or a list of \"key=value\" strings)", source)


def _seeds(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise ValueError("give a count or a list of whole numbers")
    if isinstance(value, int):
        return tuple(range(1, run_count(value) + 1))  # seeds 1 to the count (at most MAX_RUNS, far below MAX_SEED)
    if isinstance(value, list) and value:
        seeds = tuple(random_seed(s) for s in value)  # a seed of every run's scenario, read as the scenario reads it
        if len(set(seeds)) != len(seeds):
            raise ValueError("seeds repeat; use repetitions to run a seed again")
        return seeds
    raise ValueError("give a count (e.g. 3) or a list of whole numbers >= 0 (e.g. [1, 2])")


def parse_spec(data: Any, source: str | None = None, base_dir: Path | None = None) -> ExperimentSpec:
    f = Fields(data, "", source)
    name = name_or_stem(f, "the experiment in results.parquet and report.md", "experiment")  # read with `str` before: a list passed
    scenario = f.get("scenario", str)
    if base_dir is not None and (scenario.endswith((".yaml", ".yml")) or "/" in scenario):
        try:
            scenario = str((base_dir / scenario).resolve())
        except (OSError, ValueError) as exc:  # a NUL byte (ValueError), a link loop: tracebacks before 2026-12-07
            raise f.error("scenario", f"{scenario!r} is not a file name ({exc})") from None
    overrides = _overrides(f.data.get("set"), "set", source)
    f.mark_read("set")
    raw_arms = f.data.get("arms")
    f.mark_read("arms")
    if not isinstance(raw_arms, dict) or not raw_arms:
        raise f.error("arms", "give at least one arm: a mapping of arm name -> its overrides")
    arms = []
    for arm_name, ov in raw_arms.items():
        if not NAME_RE.match(str(arm_name)):
            raise f.error(f"arms.{arm_name}", "an arm name may hold letters, digits and _ . + - only")
        try:
            path_name(str(arm_name), "its runs' directory DIR/runs/<arm>")
        except ValueError as exc:
            raise f.error("arms", str(exc)) from None
        arms.append(Arm(str(arm_name), _overrides(ov, f"arms.{arm_name}", source)))
    seeds = f.get("seeds", _seeds, (1,))
    reps = f.get("repetitions", run_count, 1)
    try:
        planned_runs(len(arms) * len(seeds) * reps, f"{len(arms)} arm(s) x {len(seeds)} seed(s) x {reps} repetition(s)")
    except ValueError as exc:
        raise f.error("repetitions" if reps > 1 else "seeds", f"{exc}; use fewer, or split the "
                      "experiment") from None
    baseline = f.get("baseline", str, None)
    if baseline is not None and baseline not in raw_arms:
        raise f.error("baseline", f"{baseline!r} is not an arm; arms: {', '.join(map(str, raw_arms))}")
    metrics = f.get("metrics", lambda v: tuple(str(m) for m in v) if isinstance(v, list) and v else (_ for _ in ()).throw(
        ValueError("give a non-empty list of summary metrics, e.g. [throughput_rps, ttft_s.p90]")), tuple(DEFAULT_METRICS))
    f.done()
    return ExperimentSpec(name, scenario, overrides, tuple(arms), seeds, reps, baseline, metrics)


def load_spec(path: str | Path) -> ExperimentSpec:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such experiment file")
    data = read_yaml(p)
    return parse_spec(data, str(p), p.parent.resolve())
