"""``prfaas reproduce case-study [--quick]``: the paper's headline measured on the wire.

Lambda_max (`experiments.capacity`) of three configurations of the `case-study` scenario, each with the
throughput model's optimal instance split for that configuration (so measurement and model describe the
same deployment), on a steady WAN (no dip, no cross traffic: the model has neither):

- ``prfaas_pd``: PrfaaS prefill + PD-P + PD-D, policy ``prfaas`` from the model's threshold;
- ``homogeneous_pd``: the PrfaaS GPUs replaced by as many PD GPUs (the model's ``homogeneous_pd``),
  policy ``homogeneous-pd``;
- ``naive_heterogeneous``: every prefill on PrfaaS, every PD instance decodes, policy ``naive-heterogeneous``.

Beside the measurement: the model (Eqs. 3-8) for the same scenario in both readings of Eq. 3, and the
paper's published ratio. Gaps are discussed in docs/analysis.md ("Measured against modelled").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from testbed.validation import path_is_dir

CONFIGURATIONS = ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous")
# The paper's published figure (arXiv 2604.15039, abstract and section 4): PrfaaS-PD serves 1.54x the
# throughput of homogeneous PD at equal GPU count. The naive-heterogeneous ratio is not in our reference.
PAPER_RATIOS = {"prfaas_pd": 1.54, "homogeneous_pd": 1.0, "naive_heterogeneous": None}
# A steady WAN (the model has no dip and no cross traffic). TPOT SLO: the case study's 25 ms is exactly
# the decode step the model assumes (BS_max 20 at 25 ms), so a real step that runs 0.5 ms late misses it
# and no request would ever be good; 30 ms leaves 20% for step jitter (docs/experiments.md).
# TTFT SLO 30 s, not the scenario's 10 s: the paper has no TTFT SLO (only 40 tokens/s), and at 10 s the
# H20 line (0.391 s + 1.41e-4 s/token) cannot prefill any request above 68K tokens in time, 8% of this
# workload, so homogeneous PD misses the 90% bar at every rate and has no Lambda_max (docs/analysis.md,
# "Measured against modelled"). 30 s fits the slowest prefill of any configuration (18.9 s, 128K on H20).
STEADY = ["wan.schedule=[]", "cross_traffic=null", "serving.slo.tpot=30ms", "serving.slo.ttft=30s"]
# --quick: shorter runs and answers (the model is recomputed for the same shortened workload). The
# queue-trend test samples the requests waiting in a queue one median TTFT apart (seconds), so run
# length is set by the good fraction's statistics, not by the test: 45 s (~180 requests near the quick
# edge) and 150 s full (~450; 1024-token answers, whose ~27 s of decode the test does not count).
QUICK = ["duration=45s", "workload.output=128", "serving.timeouts.startup=180s", "serving.timeouts.drain=30s"]
FULL = ["duration=150s"]
# The search per configuration (docs/experiments.md, "Reproducing the case study").
# The search per variant (docs/experiments.md, "Reproducing the case study"): quick trades confidence for
# time everywhere (45-s runs, 15% tolerance, 2 runs at a marginal end, a 1-1 tie a fail); full decides a
# marginal end by a majority of 3 runs, so one workload draw cannot set an edge.
SEARCH = {True: {"rel_tol": 0.15, "max_probes": 5, "repetitions": 2}, False: {"rel_tol": 0.08, "max_probes": 7, "repetitions": 3}}
# Planning figure: a run costs its duration + RUN_OVERHEAD_S + its answer's decode time (start-up of
# 13 workers ~5 s, the drain after the last arrival: the TTFT tail + the answer, teardown and summary).
# Measured on the 2-core VM: 14 runs of 45 s with 128-token answers took 61-92 s, mean 75.3 s.
RUN_OVERHEAD_S = 27.0
DECODE_STEP_S = 0.026  # measured TPOT p90 25.6-25.7 ms


def _counts(n_prfaas: int, n_p: int, n_d: int) -> list[str]:
    return [f"serving.instances.prfaas_prefill={n_prfaas}", f"serving.instances.pd_prefill={n_p}",
            f"serving.instances.pd_decode={n_d}", f"topology.prfaas.prefill={max(n_prfaas, 1)}",
            f"topology.pd.prefill={max(n_p, 1)}", f"topology.pd.decode={n_d}"]


def model_results(base: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the scenario, {reading: {configuration: ModelResult dict}}) for the case study with `base` overrides."""
    from analysis import throughput_model as tm
    from testbed.sections import load_scenario

    sc = load_scenario("case-study", base)
    cm, homo, dist, _ = tm.cluster_model_from_scenario(sc)
    out = {}
    for reading in ("literal", "mean"):
        res = tm.evaluate(cm, homo, dist, reading=reading, step_tokens=256)
        out[reading] = {k: res[k].to_dict() for k in CONFIGURATIONS}
    return sc, out


def configuration_overrides(model: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Each configuration's overrides, with the model's (literal reading) instance split."""
    pf, homo, naive = model["prfaas_pd"], model["homogeneous_pd"], model["naive_heterogeneous"]
    return {
        "prfaas_pd": ["policy.name=prfaas", f"policy.threshold={int(pf['threshold'])}"] + _counts(pf["n_prfaas"], pf["n_p"], pf["n_d"]),
        "homogeneous_pd": ["policy.name=homogeneous-pd"] + _counts(0, homo["n_p"], homo["n_d"]),
        "naive_heterogeneous": ["policy.name=naive-heterogeneous"] + _counts(naive["n_prfaas"], 0, naive["n_d"]),
    }


def planned_wall_s(sc: Any, quick: bool, configurations: int, repetitions: int = 3, at_once: int = 1) -> dict[str, float]:
    """What the reproduction should cost, per configuration: 3 runs when the model's Lambda_max is within
    one bracketing step of the edge and every run is decisive (2 rates + 1 bisection); typically
    2 + `repetitions` (of three rates, two marginal ones decided by 1 + (R - 1) / 2 runs on average:
    a marginal pass needs more of its repetitions than a marginal fail); at worst every rate, and the
    interval's outward steps, with all its repetitions. Failing runs stop early, so these are upper
    figures for them. `at_once`: searches that run side by side (`searches_at_once`), so the wall time
    is that of ceil(configurations / at_once) searches one after another."""
    from experiments.capacity import worst_runs

    run_s = float(sc.duration_s) + RUN_OVERHEAD_S + DECODE_STEP_S * float(sc.section("workload").output.mean())
    rounds = -(-configurations // max(1, at_once))
    return {"run_s": run_s, "best_s": 3 * rounds * run_s, "typical_s": (2 + repetitions) * rounds * run_s,
            "worst_s": worst_runs(SEARCH[quick]["max_probes"], repetitions) * rounds * run_s}


def check_planned_runs(quick: bool, repetitions: int | None, configurations: int, paired_seeds: int = 0) -> int:
    """The most runs a reproduction makes -- each configuration's search at worst (`capacity.worst_runs`), then the
    paired test's two runs a seed for each two configurations adjacent by Lambda_max -- refused (ValueError,
    `validation.planned_runs`) past `validation.MAX_RUNS`."""
    from experiments.capacity import worst_runs
    from testbed.validation import planned_runs

    search = worst_runs(SEARCH[quick]["max_probes"], repetitions or SEARCH[quick]["repetitions"])
    pairs = max(configurations - 1, 0) if paired_seeds else 0
    how = f"{configurations} searches of at most {search} runs" + (
        f" and a paired test of {paired_seeds} seeds x 2 configurations x {pairs} pair(s)" if pairs else "")
    return planned_runs(configurations * search + 2 * paired_seeds * pairs, how)


def searches_at_once(executor: Any, configurations: int) -> tuple[int, int]:
    """(searches run side by side, runs of a rate each may ask for at once) on `executor`. One search per
    slot first: a slot given to another configuration's search runs a run that is always needed, while a
    second slot in the same search runs a repetition that the first run's verdict may make needless
    (`experiments.capacity.search`); slots left over go to the searches' repetitions."""
    slots = max(1, int(getattr(executor, "slots", 1)))
    at_once = max(1, min(configurations, slots))
    return at_once, max(1, slots // at_once)


def _measure_side_by_side(names: tuple[str, ...], measure: Callable[[str, Any], dict[str, Any]], at_once: int,
                          executor: Any, progress: bool) -> dict[str, dict[str, Any]]:
    """`measure(name, progress)` for every name, `at_once` in threads, with one live progress display that
    the searches share (a row per rate being run). When one fails or the user interrupts, the executor's
    runs are cancelled (`Executor.cancel`: every run in progress stops and none starts), so no search
    goes on alone for an hour; the error is raised once the threads have returned."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
    from contextlib import nullcontext

    from experiments.engine import progress_bar

    bar = progress_bar() if progress else None
    pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="search")
    futures = {}
    try:
        with bar if bar is not None else nullcontext():
            futures = {name: pool.submit(measure, name, bar if bar is not None else False) for name in names}
            done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()  # the first search that failed raises here, before the others are waited for
            return {name: f.result() for name, f in futures.items()}
    except BaseException:
        try:
            if hasattr(executor, "cancel"):
                executor.cancel()
        except Exception as exc:  # the searches' error is the one to raise; this one only explains a slow exit
            print(f"prfaas: cancelling the runs in progress failed ({type(exc).__name__}: {exc}); waiting for them", file=sys.stderr)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


DOCUMENT_WHAT = "a reproduction's document (reproduce.json)"


def read_document(path: Path) -> dict[str, Any]:
    """A reproduce.json (or a kept reproduce-<time>.json) as a JSON object; a file that cannot be read, is not JSON
    (`validation.read_json`: nested too deeply included, a RecursionError traceback before) or not an object is one
    `UserError` naming it."""
    from testbed.errors import UserError
    from testbed.validation import read_json

    data = read_json(path, DOCUMENT_WHAT)
    if not isinstance(data, dict):
        raise UserError(f"{path}: must be a JSON object, got {type(data).__name__}; {DOCUMENT_WHAT} is expected")
    return data


def _p_value(v: Any) -> float:
    from testbed.validation import number

    x = number(v)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{v!r} is not a p-value (a number from 0 to 1)")
    return x


def _seeds(v: Any) -> list[int]:
    from testbed.validation import random_seed

    if not isinstance(v, list) or not v:
        raise ValueError(f"must be a non-empty list of seeds, got {v!r}"[:200])
    return [random_seed(s) for s in v]


def read_paired_tests(path: Path) -> list[dict[str, Any]]:
    """The paired tests a reproduce*.json records (its ``paired``), each checked where a new test is checked against
    it: ``higher`` and ``lower`` configurations, ``seeds`` a non-empty list of seeds, ``p_value`` a p-value or null.
    A damaged file or entry is one `UserError` (`FieldError`) naming the file and the field: the seeds it used cannot
    be known, so no new test is checked against it by guesswork (an int for ``seeds`` was a TypeError traceback,
    ``[true, 3]`` read as seeds 1 and 3, and an unreadable file was passed over)."""
    from testbed.validation import Fields

    tests = []
    for pf in Fields(read_document(path), "", str(path)).items("paired"):
        test = {**pf.data, "higher": pf.choice("higher", CONFIGURATIONS), "lower": pf.choice("lower", CONFIGURATIONS),
                "seeds": pf.get("seeds", _seeds)}
        pf.get("p_value", _p_value, None)
        tests.append(test)
    return tests


def write_document(out: str | Path, doc: dict[str, Any], problems: list[str] | None = None) -> Path | None:
    """Write ``OUT/reproduce.json``. An earlier one there (from the invocation whose runs this one resumed,
    or one that named other configurations: `--only`, `--paired`) holds what the runs alone do not, its
    wall time and its configurations, so it is kept beside the new one as ``reproduce-<its UTC time>.json``;
    returns that path (None when there was none). When the earlier one measured the same scenario (the same
    overrides), `doc` also gets ``wall_s_all_invocations`` and ``paired_wall_s_all_invocations``: the sums over
    the invocations in this directory that finished, so a reproduction made in finished parts (`--only`, a
    later `--paired`) reports its whole time. An interrupted invocation writes no document, so its time is
    in no sum: a reproduction resumed after an interruption reports less than it took. An earlier file that
    cannot be read as a reproduction's document (`read_document`) is kept all the same and adds nothing to the
    sums (why is added to `problems`); the new document is always written."""
    import os
    import time

    from testbed.atomic import make_dirs, write_json
    from testbed.errors import UserError

    out = make_dirs(out)
    path, kept = out / "reproduce.json", None
    if os.path.lexists(path):
        try:
            earlier: Any = read_document(path)
        except UserError as exc:  # not JSON (cut short, hand-edited), a folder: kept below, summed with nothing
            earlier = None
            if problems is not None:
                problems.append(str(exc))
        doc.update(invocation_sums(earlier, doc))
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(path.lstat().st_mtime))
        kept, n = out / f"reproduce-{stamp}.json", 1
        while os.path.lexists(kept):
            kept, n = out / f"reproduce-{stamp}-{n}.json", n + 1
        path.rename(kept)
    write_json(path, doc, indent=1)
    return kept


def paired_tests_in(out: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Every paired test recorded in `out` (its reproduce.json and the kept reproduce-*.json, `read_paired_tests`) as
    (file name, test), each test once (by pair and seeds; a kept file repeats its successor's tests when that one
    resumed them). A file that cannot be read is a `UserError` naming it."""
    seen, tests = set(), []
    for f in sorted(Path(out).glob("reproduce*.json")) if path_is_dir(out) else []:
        for p in read_paired_tests(f):
            key = (p["higher"], p["lower"], tuple(p["seeds"]))
            if key not in seen:
                seen.add(key)
                tests.append((f.name, p))
    return tests


def check_paired_seeds_unused(out: str | Path, only: tuple[str, ...], seeds: list[int]) -> None:
    """Refuse (ValueError) `seeds` for a paired test when an earlier paired test in `out` tested two of the
    configurations in `only` on some of them but not on exactly them: that would extend the earlier test, or
    reuse part of its draws, not make a new one. The same seeds again are the same test (its runs are resumed,
    its result read again) and pass."""
    new = set(seeds)
    tests = [(name, p) for name, p in paired_tests_in(out) if {p.get("lower"), p.get("higher")} <= set(only)]
    free = max([max(new)] + [max(p["seeds"]) for _, p in tests]) + 1  # after every recorded test's seeds
    for name, p in tests:
        used = p["seeds"]
        if new & set(used) and new != set(used):
            raise ValueError(
                f"seeds {min(new)}..{max(new)} overlap the paired test of {p.get('higher')} and {p.get('lower')} on seeds "
                f"{min(used)}..{max(used)} ({name}): a second test of the pair needs seeds no test used "
                f"(--paired-from {free}), and its p-value is a second look (docs/experiments.md)")


def paired_test_seeds(out: str | Path, only: tuple[str, ...], quick: bool, repetitions: int | None, n: int,
                      first: int | None = None) -> list[int]:
    """The seeds of a paired test of `n` seeds from `first` after the searches of this variant (`repetitions`
    of them, else the variant's default): fresh (`fresh_seeds`) and not overlapping an earlier test of the
    pair in `out` (`check_paired_seeds_unused`); ValueError otherwise. The CLI and `reproduce_case_study`
    both ask here, so the CLI refuses before anything starts."""
    from experiments.capacity_paired import fresh_seeds

    seeds = fresh_seeds(repetitions or SEARCH[quick]["repetitions"], n, first)
    check_paired_seeds_unused(out, only, seeds)
    return seeds


def earlier_looks(out: str | Path, test: dict[str, Any]) -> list[dict[str, Any]]:
    """The other paired tests of `test`'s two configurations recorded in `out` (other seeds): with them `test` is
    one of several looks at one question, and an order holds only at p < ALPHA / looks (Bonferroni)."""
    pair = {test.get("higher"), test.get("lower")}
    return [p for _, p in paired_tests_in(out)
            if {p.get("higher"), p.get("lower")} == pair and set(p["seeds"]) != set(test.get("seeds") or [])]


def invocation_sums(earlier: Any, doc: dict[str, Any]) -> dict[str, float]:
    """The wall times of `earlier` (a reproduce.json's content, itself possibly a sum) and `doc` added up, when
    both measured the same scenario; nothing otherwise (a different variant or overrides: not one
    reproduction; or an earlier file that is not a reproduction's document, or whose times are not numbers)."""
    from testbed.units import finite_or_none as number

    def overrides(d: Any) -> Any:
        return (d.get("scenario") or {}).get("overrides") if isinstance(d, dict) and isinstance(d.get("scenario"), dict) else None

    same = [overrides(d) for d in (earlier, doc)]
    if None in same or same[0] != same[1] or number(earlier.get("wall_s")) is None:
        return {}
    out = {}
    for k in ("wall_s", "paired_wall_s"):
        before = number(earlier.get(f"{k}_all_invocations", earlier.get(k, 0.0)))
        if before is None:
            return {}
        out[f"{k}_all_invocations"] = before + (number(doc.get(k)) or 0.0)
    return out


def ratio_interval(a: dict[str, Any], b: dict[str, Any]) -> list[float | None]:
    """The ratio a / b over both intervals: [a's low / b's high, a's high / b's low] (None: open end)."""
    (alo, ahi), (blo, bhi) = a["ci"], b["ci"]
    low = alo / bhi if bhi else None
    high = ahi / blo if ahi is not None and blo else None
    return [low, high]


def above_model(measured: dict[str, Any], model: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The configurations measured above the model's fluid bound (both readings), as measured / model (literal).
    The model's Lambda_max is where a stage's average work fills it; above it a queue grows without
    bound. A run that passes there was too short to see its queue grow (the quick variant's 45-s runs:
    docs/analysis.md), or drew a lighter workload than the distribution's mean; either way its figure
    is not a capacity."""
    out = {}
    for k, m in measured.items():
        lit, mean = model["literal"][k]["lambda_max"], model["mean"][k]["lambda_max"]
        if m["lambda_max_rps"] is not None and m["lambda_max_rps"] > max(lit, mean):
            out[k] = m["lambda_max_rps"] / lit
    return out


@dataclass(frozen=True)
class CaseStudyPlan:
    """What a reproduction measures, every configuration checked (`plan_case_study`)."""

    base: list[str]  # the overrides every configuration gets (STEADY and the variant's)
    scenario: Any  # the case study with `base`
    model: dict[str, dict[str, Any]]  # {reading: {configuration: ModelResult dict}} (`model_results`)
    overrides: dict[str, list[str]]  # each configuration's own (`configuration_overrides`)
    checked: dict[str, Any]  # with `out`: each configuration's search scenario as `capacity.check_scenario` gave it


def plan_case_study(quick: bool, only: tuple[str, ...], early_stop: bool = True, executor: Any = None,
                    out: str | Path | None = None) -> CaseStudyPlan:
    """The model of the variant and each configuration in `only` checked as its search would check it
    (`capacity.check_scenario`: a run on `executor` would take it), and, with `out`, every run of an earlier
    reproduction in ``OUT/<configuration>`` (`capacity.check_resume`: a damaged run, or one of other settings --
    ``--quick`` against full, another ``--no-early-stop`` -- is refused now, not when its search reaches it): the
    CLI asks here before it makes the output folder, so a refusal leaves no folder behind."""
    from experiments.capacity import capacity_overrides, check_resume, check_scenario

    base = STEADY + (QUICK if quick else FULL)
    sc, model = model_results(base)
    overrides = configuration_overrides(model["literal"])
    checked = {}
    for name in only:  # every configuration is checked before the first search starts
        search = capacity_overrides(base + overrides[name], early_stop)
        scenario = check_scenario("case-study", search, executor)
        if out is not None:
            check_resume(Path(out) / name, "case-study", search)
            checked[name] = scenario  # handed to the search only with its runs in `out` checked too (`measure_capacity`)
    return CaseStudyPlan(base, sc, model, overrides, checked)


def reproduce_case_study(out: str | Path, *, quick: bool = False, repetitions: int | None = None, only: tuple[str, ...] = CONFIGURATIONS,
                         executor: Any = None, progress: bool = True, early_stop: bool = True, paired_seeds: int = 0,
                         paired_from: int | None = None, plan: CaseStudyPlan | None = None) -> dict[str, Any]:
    """The measured and modelled Lambda_max of each configuration in `only`; with `paired_seeds`, also the
    paired order test of each two configurations adjacent by measured Lambda_max (`paired_orders`). `plan`: the
    variant's `plan_case_study` for `only`, when the caller checked it already."""
    import time

    from experiments.capacity import measure_capacity

    only = tuple(dict.fromkeys(only))  # a configuration named twice is measured once (two searches would share its runs)
    search = {**SEARCH[quick], **({"repetitions": repetitions} if repetitions else {})}
    if paired_from is not None and not paired_seeds:
        raise ValueError(f"paired_from {paired_from}: the first seed of a paired test, but no paired test is asked for")
    check_planned_runs(quick, repetitions, len(only), paired_seeds)
    if paired_seeds:  # refused before the searches, not after them
        seeds = paired_test_seeds(out, only, quick, repetitions, paired_seeds, paired_from)

    t0 = time.monotonic()
    if plan is None:
        plan = plan_case_study(quick, only, early_stop, executor, out)
    base, sc, model, overrides, checked = plan.base, plan.scenario, plan.model, plan.overrides, plan.checked
    at_once, per_search = searches_at_once(executor, len(only))
    plan = planned_wall_s(sc, quick, len(only), search["repetitions"], at_once)
    if progress:
        side = f", {at_once} searches side by side" if at_once > 1 else ""
        print(f"plan: {len(only)} configurations x 3-{2 + search['repetitions']} runs of ~{plan['run_s']:.0f} s{side}: about "
              f"{plan['best_s'] / 60:.0f}-{plan['typical_s'] / 60:.0f} min (at most {plan['worst_s'] / 60:.0f})")

    def measure(name: str, shown: Any) -> dict[str, Any]:
        t1 = time.monotonic()
        cap = measure_capacity("case-study", base + overrides[name], Path(out) / name,
                               start_rps=model["literal"][name]["lambda_max"], executor=executor, progress=shown,
                               early_stop=early_stop, parallel=per_search, label=name if at_once > 1 else "capacity",
                               checked=checked.get(name), **search)
        return {"lambda_max_rps": cap["lambda_max_rps"], "ci": cap["ci"], "ci_dose_response": cap["ci_dose_response"], "runs": cap["runs"],
                "bracketed": cap["bracketed"], "overrides": overrides[name], "probes": cap["probes"],
                "flagged_runs": cap["flagged_runs"], "wall_s": time.monotonic() - t1}

    if at_once > 1:
        measured = _measure_side_by_side(only, measure, at_once, executor, progress)
    else:
        measured = {name: measure(name, progress) for name in only}
    t2 = time.monotonic()
    paired = paired_orders(measured, base, overrides, out, seeds, executor, progress, early_stop) if paired_seeds else []
    paired_wall_s = time.monotonic() - t2
    homo = measured.get("homogeneous_pd", {}).get("lambda_max_rps")
    ratios = {k: (v["lambda_max_rps"] / homo if homo else None) for k, v in measured.items()}
    ratio_ci = {k: ratio_interval(v, measured["homogeneous_pd"]) for k, v in measured.items() if homo}
    return {
        "scenario": {"name": sc.name, "overrides": base, "quick": quick, "search": search, "early_stop": early_stop},
        "wall_s": time.monotonic() - t0,
        "executor": getattr(executor, "name", "local") or "local",
        "executor_slots": max(1, int(getattr(executor, "slots", 1))),
        "searches_at_once": at_once,
        "plan": plan,
        "measured": measured,
        "measured_ratio_vs_homogeneous": ratios,
        "measured_ratio_interval": ratio_ci,
        "model": {k: {"lambda_max_rps": model["literal"][k]["lambda_max"],
                      "lambda_max_rps_mean_reading": model["mean"][k]["lambda_max"],
                      "n_prfaas": model["literal"][k]["n_prfaas"], "n_p": model["literal"][k]["n_p"], "n_d": model["literal"][k]["n_d"],
                      "threshold": model["literal"][k]["threshold"], "bottleneck": model["literal"][k]["bottleneck"]}
                  for k in CONFIGURATIONS},
        "model_ratio_vs_homogeneous": {r: {k: model[r][k]["lambda_max"] / model[r]["homogeneous_pd"]["lambda_max"] for k in CONFIGURATIONS}
                                       for r in ("literal", "mean")},
        "paper_ratio_vs_homogeneous": PAPER_RATIOS,
        "above_model": above_model(measured, model),
        "paired": paired,
        "paired_wall_s": paired_wall_s,
    }


def paired_orders(measured: dict[str, Any], base: list[str], overrides: dict[str, list[str]], out: str | Path, seeds: list[int],
                  executor: Any = None, progress: bool = True, early_stop: bool = True) -> list[dict[str, Any]]:
    """`experiments.capacity_paired.paired_order` for each two configurations adjacent by measured Lambda_max
    (equal ones in `measured`'s order), at the geometric mean of theirs, on `seeds`, with the searches'
    overrides, beside their run directories."""
    from experiments.capacity import capacity_overrides, wire_evaluator
    from experiments.capacity_paired import paired_order, paired_rate

    ranked = sorted((k for k, m in measured.items() if m["lambda_max_rps"]), key=lambda k: measured[k]["lambda_max_rps"])
    docs = []
    for low, high in zip(ranked, ranked[1:]):
        rate = paired_rate(measured[low]["lambda_max_rps"], measured[high]["lambda_max_rps"])
        ev = {k: wire_evaluator("case-study", capacity_overrides(base + overrides[k], early_stop), Path(out) / k, executor, progress)
              for k in (low, high)}
        docs.append(paired_order(ev[high], ev[low], rate, seeds, (high, low)).to_json())
    return docs
