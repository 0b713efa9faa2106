"""Experiment specifications (``prfaas experiment SPEC.yaml``): a scenario, arms that override it,
seeds and repetitions. Every bad value is one `FieldError` naming its key (exit status 2).

    name: policies-on-quick
    scenario: quick                 # a ready scenario's name, or a file (relative to this spec)
    set: {duration: 20s}            # overrides for every arm (optional)
    arms:                           # arm name -> its overrides (key: YAML value, or "key=value" texts as --set)
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

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from testbed.errors import FieldError, UserError
from testbed.validation import (Fields, name_or_stem, path_exists, path_name, planned_runs, random_seed, read_yaml, run_count,
                                text)

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
_STATS = ("mean", "p50", "p90", "p99")
# every summary figure a spec's `metrics:` may name (a run's summary.json, flattened as in results.parquet: a number
# or true/false), with its direction; `tests/unit/test_experiment.py` checks it against a run's summary, so a figure
# added to the summary is added here too
METRICS: dict[str, bool | None] = {
    **DEFAULT_METRICS,
    **{f"{group}.{q}": False for group in ("ttft_s", "ttft_short_s", "ttft_client_s") for q in _STATS},
    **{f"tpot_s.{q}": False for q in _STATS[:3]},
    "output_tokens_per_s": True, "requests_ok": True, "requests_cut": None, "requests_total": None, "duration_s": None,
    "kv_float8_fraction": None, "kv_wire_bytes_offloaded": None, "kv_cc_restarts": None, "scale": None,
    "egress_gbps.mean": None, "egress_gbps.p99": None, "wan_gbps.mean": None, "wan_gbps.p99": None,
    "slo.ttft_s": None, "slo.tpot_s": None,
    "estimator.median_abs_error": False, "estimator.p90_abs_error": False, "estimator.samples": None,
    "estimator.steady_samples": None,
    "prefix_cache.efficiency": True, "prefix_cache.hit_requests": True,
    **{f"prefix_cache.ideal{kind}_hit_{unit}": None for kind in ("", "_checkpoint") for unit in ("requests", "tokens")},
    **{f"queue.{k}": None for k in ("cut_exact", "growing", "growth", "kendall_tau", "p_value", "samples", "slope_low_per_s",
                                    "slope_per_s", "step_s")},
    **{f"kv_transport.{k}": None for k in ("busy_samples", "cwnd_p10_segments", "cwnd_p50_segments", "loss_state_share",
                                           "mss_p50_bytes")},
    "node_cpus": None, "fidelity_ok": None,
    **{f"fidelity_{k}": None for k in ("client_send_late_p99_s", "cross_sent_ratio_p10", "decode_late_ratio_p90",
                                       "delayline_cores_max", "host_busy_share", "intake_late_p99_s", "prefill_late_ratio_p90",
                                       "rate_ratio", "router_tick_late_p99_s", "rtt_configured_s", "rtt_p50_s",
                                       "run_cpu_cores", "schedule_late_p99_s", "sleep_late_p99_s")},
}
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
    """`set:` or an arm's overrides as "key=value" strings, read back as `--set` reads them: a mapping's values are
    written as YAML, so a string stays a string ("a: b" was read back as a mapping). ``seed`` is the spec's own
    (`seeds:`): a run's seed in `set:` or an arm was replaced by it without a word."""
    if value is None:
        return ()
    if isinstance(value, dict):
        out = tuple(f"{k}={_yaml_text(v)}" for k, v in value.items())
    elif isinstance(value, list) and all(isinstance(x, str) and "=" in x for x in value):
        out = tuple(value)
    else:
        raise FieldError(path, "give a mapping of key: value (or a list of \"key=value\" strings)", source)
    if any(item.split("=", 1)[0].strip() == "seed" for item in out):
        raise FieldError(f"{path}.seed", "each run's seed comes from the spec's seeds: (every arm runs every seed, "
                         "paired); give seeds: instead", source)
    return out


def _yaml_text(value: Any) -> str:
    """`value` as YAML text that `load_yaml` reads back as `value` (one line where it can)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return (text[:-4] if text.endswith("\n...\n") else text).strip()


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


def _metrics(value: Any) -> tuple[str, ...]:
    """The metrics a spec compares: figures of a run's summary (`METRICS`), each once. A name that is none was
    dropped from comparison.json without a word, after every run (`ttft_p90` for `ttft_s.p90`)."""
    if not isinstance(value, list) or not value:
        raise ValueError("give a non-empty list of summary metrics, e.g. [throughput_rps, ttft_s.p90]")
    names = tuple(str(m) for m in value)
    for name in names:
        if name not in METRICS:
            near = difflib.get_close_matches(name, list(METRICS), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            raise ValueError(f"{name!r} is not a figure of a run's summary; {hint}the figures: {', '.join(sorted(METRICS))}")
    if len(set(names)) != len(names):
        raise ValueError("a metric is named twice")
    return names


def parse_spec(data: Any, source: str | None = None, base_dir: Path | None = None) -> ExperimentSpec:
    f = Fields(data, "", source)
    name = name_or_stem(f, "the experiment in results.parquet and report.md", "experiment")  # read with `str` before: a list passed
    # a non-empty string: `str` read `scenario: ''` as this spec's folder ("cannot read (Is a directory)", no field named)
    # and `scenario: [1, 2]` as the name "[1, 2]"
    scenario = f.get("scenario", text)
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
    metrics = f.get("metrics", _metrics, tuple(DEFAULT_METRICS))
    f.done()
    return ExperimentSpec(name, scenario, overrides, tuple(arms), seeds, reps, baseline, metrics)


def load_spec(path: str | Path) -> ExperimentSpec:
    p = Path(path)
    if not path_exists(p):  # a name no file can have (too long, a NUL byte) too: an OSError traceback before
        raise UserError(f"{p}: no such experiment file")
    data = read_yaml(p, "an experiment spec (a YAML mapping of scenario, arms, ...: docs/experiments.md)")
    return parse_spec(data, str(p), p.parent.resolve())
