"""Subcommands of the experiments layer: ``run``, ``quickstart``, ``sweep``, ``experiment``, ``capacity``, ``reproduce``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from testbed import rundir
from testbed.atomic import make_output_dir
from testbed.errors import UserError
from testbed.validation import comma_list, option, path_option, positive_number, random_seed, run_count

KV_LOSS_STATE_NOTE = 0.01  # `prfaas run` notes the KV connections' RTO recovery from this share of their busy time


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("run", help="one complete run of a scenario: network, workers, router, workload, results",
                       description="Bring up the scenario's network, start the workers and the router in its hosts, "
                                   "drive the workload, collect the run directory, tear everything down.")
    p.add_argument("scenario", help="a scenario file, or the name of a ready one in topologies/ (e.g. quick)")
    p.add_argument("--out", type=path_option, help="run directory (default: runs/<scenario>-<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario field, e.g. --set wan.rate=20Gbps --set policy.name=fixed-threshold")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.set_defaults(func=cmd_run)
    q = sub.add_parser("quickstart", help="run topologies/quick.yaml under two policies and compare them in a report",
                       description="README's main job: the quick scenario under each policy given (default: prfaas, then "
                                   "fixed-threshold on the same workload and WAN), then one comparison report.")
    q.add_argument("--out", type=path_option, help="parent directory of the runs (default: runs/quick-<time>)")
    q.add_argument("--policies", default="prfaas,fixed-threshold", help="comma-separated policies to compare")
    q.add_argument("--no-progress", action="store_true", help="no live progress display (plain lines, e.g. for a log file)")
    q.set_defaults(func=cmd_quickstart)

    s = sub.add_parser("sweep", help="run a grid of scenario variations, resumable, ending in one comparison report")
    s.add_argument("scenario", metavar="SCENARIO", help="a ready scenario's name (topologies/) or a YAML file")
    s.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="e.g. --grid wan.rate=10Gbps,40Gbps --grid seed=1,2")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override applied to every point")
    s.add_argument("--out", type=path_option, required=True, metavar="DIR", help="where the runs and the report go; run again to resume")
    _executor_option(s)
    s.set_defaults(func=cmd_sweep)

    e = sub.add_parser("experiment", help="arms x seeds x repetitions of a scenario, compared with paired 95%% CIs (resumable)",
                       description="Run an experiment spec (docs/experiments.md): results.parquet, comparison.json and report.md in --out.")
    e.add_argument("spec", metavar="SPEC.yaml", help="the experiment: scenario, arms, seeds, repetitions, metrics (docs/experiments.md)")
    e.add_argument("--out", type=path_option, required=True, metavar="DIR", help="where the runs and results go; run again to resume")
    _executor_option(e)
    e.set_defaults(func=cmd_experiment)

    c = sub.add_parser("capacity", help="measured Lambda_max: the highest arrival rate meeting the SLOs with a steady queue",
                       description="Bracket then bisect the Poisson arrival rate of SCENARIO (docs/experiments.md, Capacity).")
    c.add_argument("scenario", metavar="SCENARIO", help="a ready scenario's name (topologies/) or a YAML file with a Poisson workload")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override")
    c.add_argument("--out", type=path_option, metavar="DIR", help="where the probe runs go (default: runs/capacity-<the scenario's name>-<time>, "
                                                "named as prfaas run names its run directory)")
    c.add_argument("--repetitions", type=option(run_count, whole=True), default=3,
                   help="runs (seeds 1..N) that decide a marginal rate at the edge by majority (default 3)")
    c.add_argument("--tolerance", type=option(tolerance), default=0.1,
                   help="stop when (hi - lo) / lo is below this (default 0.1; 0.001 to 1)")
    c.add_argument("--max-probes", type=option(run_count, whole=True), default=8, help="most rates tried (default 8)")
    c.add_argument("--start", type=option(positive_number), metavar="RPS", help="first rate (default: the throughput model's Lambda_max)")
    c.add_argument("--no-early-stop", action="store_true", help="run every probe to its end, even once it cannot pass")
    c.add_argument("--json", action="store_true", help="print lambda_max_rps, ci, runs, slo and scenario as JSON")
    _executor_option(c)
    c.set_defaults(func=cmd_capacity)

    r = sub.add_parser("reproduce", help="the paper's headline on the wire: Lambda_max of PrfaaS-PD, homogeneous PD and naive heterogeneous PD")
    r.add_argument("target", choices=("case-study",), help="what to reproduce: the paper's case study")
    r.add_argument("--quick", action="store_true", help="45-s runs, 128-token answers, 15%% tolerance (docs/experiments.md)")
    r.add_argument("--out", type=path_option, metavar="DIR", help="default: runs/reproduce-case-study-<time>")
    r.add_argument("--repetitions", type=option(run_count, whole=True), help="runs that decide a marginal rate (default: 2 with --quick, 3 without)")
    r.add_argument("--only", default=",".join(("prfaas_pd", "homogeneous_pd", "naive_heterogeneous")),
                   help="comma-separated configurations to measure")
    r.add_argument("--no-early-stop", action="store_true", help="run every probe to its end, even once it cannot pass")
    r.add_argument("--paired", type=option(paired_seed_count, whole=True), default=0, metavar="N",
                   help="then test the order of each two configurations adjacent by Lambda_max: both at the geometric mean "
                        "of theirs on N seeds the searches did not run, McNemar's exact test (docs/experiments.md, "
                        "'Paired order'; N from 6 to 10000, 10-12 to see a clear order; 0, the default, runs none)")
    r.add_argument("--paired-from", type=option(random_seed, whole=True), metavar="SEED",
                   help="the paired test's first seed (default: the one after the searches' seeds); a second test of "
                        "the same pair starts after the first one's seeds (an overlap is refused) and is a second look: "
                        "with k tests of a pair an order needs p < 0.05 / k (the report says so)")
    r.add_argument("--json", action="store_true", help="print the measured and modelled Lambda_max of each configuration as JSON")
    _executor_option(r)
    r.set_defaults(func=cmd_reproduce)


def paired_seed_count(v: Any) -> int:
    """`experiments.capacity_paired.paired_seed_count` (``--paired N``; benchmarks/experiments_bench.py reads its
    ``--paired`` with it too), imported when the option is read."""
    from experiments.capacity_paired import paired_seed_count as read

    return read(v)


def tolerance(v: Any) -> float:
    """`experiments.capacity.tolerance`, imported when an option is read (not with every command's parser)."""
    from experiments.capacity import tolerance as read

    return read(v)


def _executor_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", default="local", metavar="NAME[:ARG]",
                   help="how the runs are run: local (one after another, the default), local:N (N at once on this host), "
                        "ray or ray:ADDRESS (a Ray cluster); docs/scale-out.md")


def _default_out(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _print_summary(out: Path) -> bool:
    """Print the run's summary; True when the run ended early (`rundir.RUN_ERROR`)."""
    s = rundir.read_summary(out)
    ttft, tpot, eg = s.get("ttft_s") or {}, s.get("tpot_s") or {}, s.get("egress_gbps") or {}

    def f(x: object, fmt: str = "{:.3f}") -> str:
        return fmt.format(x) if isinstance(x, (int, float)) else "-"

    print(f"run directory: {out}")
    cut = f" / {s['requests_cut']} cut in the drain" if s.get("requests_cut") else ""
    print(f"  requests: {s['requests_ok']} ok / {s['requests_failed']} failed{cut} of {s['requests_total']}"
          f"   throughput {f(s.get('throughput_rps'), '{:.2f}')} req/s   offloaded {f(s.get('offload_fraction'), '{:.0%}')}")
    print(f"  TTFT p50/p90/p99: {f(ttft.get('p50'))} / {f(ttft.get('p90'))} / {f(ttft.get('p99'))} s"
          f"   TPOT mean/p90: {f(tpot.get('mean'), '{:.4f}')} / {f(tpot.get('p90'), '{:.4f}')} s")
    print(f"  WAN egress mean/p99: {f(eg.get('mean'), '{:.2f}')} / {f(eg.get('p99'), '{:.2f}')} Gbps (emulated; scale {s.get('scale')},"
          f" {s.get('compute', '?')} compute, policy {s.get('policy')}"
          + (f", KV over TCP {s['kv_congestion_control']})" if s.get("kv_congestion_control") else ")"))
    if s.get("kv_float8_fraction"):
        print(f"  float8 KV (policy.kv_compression): {s['kv_float8_fraction']:.0%} of the offloads sent their full-attention KV in float8")
    if s.get("kv_cc_restarts"):
        n = s["kv_cc_restarts"]
        print(f"  KV connections stuck after an RTO: congestion control restarted {'once' if n == 1 else f'{n} times'} (docs/kv.md)")
    kt = s.get("kv_transport") or {}
    if (kt.get("loss_state_share") or 0) >= KV_LOSS_STATE_NOTE:
        sc = f"{float(s.get('scale') or 1):g}"
        print(f"  KV connections: {kt['loss_state_share']:.0%} of their busy time recovering from an RTO, cwnd p50 "
              f"{kt['cwnd_p50_segments']:.0f} segments (at scale {sc} a wire connection holds 1/{sc} of the segments the "
              "emulated line's would; docs/kv.md, \"Two modes of the case study under CUBIC, and what set them\")")
    pc = s.get("prefix_cache") or {}
    if pc.get("ideal_hit_requests"):  # a workload with prefixes to reuse
        from analysis.metrics import model_ideal

        pct = lambda k: f(pc.get(k), "{:.0%}")  # noqa: E731
        ideal = f(model_ideal(pc, "requests"), "{:.0%}")
        if pc.get("hybrid"):
            ideal += f" for this hybrid model, {pct('ideal_hit_requests')} for full attention"
        print(f"  prefix cache: {pct('hit_requests')} of requests hit (an ideal cache: {ideal}); "
              f"efficiency (tokens) {f(pc.get('efficiency'), '{:.2f}')} (docs/analysis.md)")
    for reason, n in (s.get("failure_reasons") or {}).items():
        print(f"  failed x{n}: {reason}")
    if s.get(rundir.RUN_ERROR):
        print(f"  the run ended early: {s[rundir.RUN_ERROR]}")
    return bool(s.get(rundir.RUN_ERROR))


def _run_report(out: Path) -> None:
    """The run directory's plots/*.png and report.html."""
    from analysis.report import write_report

    print(f"  report: {write_report([out])}")


def cmd_run(args: argparse.Namespace) -> int:
    from analysis.scenario_check import check_scenario
    from experiments.runs import run_once
    from testbed.sections import load_scenario

    scenario = load_scenario(args.scenario, args.overrides)
    out = Path(args.out) if args.out else _default_out(scenario.name)
    if out.exists() and (out / rundir.SUMMARY_FILE).exists():
        raise UserError(f"--out {out}: already holds a run ({rundir.SUMMARY_FILE}); choose another directory")
    for w in check_scenario(scenario).warnings:  # `prfaas check`'s, before the minutes a run takes
        print(f"warning: {w}", file=sys.stderr)
    run_once(scenario, out, progress=not args.no_progress)  # the runner makes `out` once `plan_run` has checked the scenario
    ended_early = _print_summary(out)
    _run_report(out)
    return 1 if ended_early else 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """The quick scenario once per policy, then the comparison report."""
    from analysis.report import write_report
    from experiments.engine import check_run
    from experiments.runs import run_once

    policies = comma_list(args.policies, "--policies", "prfaas,fixed-threshold")
    twice = next((p for p in policies if policies.count(p) > 1), None)
    if twice is not None:  # both runs would go to one folder, the second over the first
        raise UserError(f"--policies {args.policies!r}: {twice!r} is given twice; name each policy once")
    parent = Path(args.out) if args.out else _default_out("quick")
    scenarios = make_output_dir(parent, lambda: [check_run("quick", [f"policy.name={p}"]) for p in policies])  # all before any run
    outs, ended_early = [], False
    for policy, scenario in zip(policies, scenarios):
        out = parent / policy
        print(f"== quick scenario, policy {policy}")
        run_once(scenario, out, progress=not args.no_progress)
        ended_early |= _print_summary(out)
        _run_report(out)
        outs.append(out)
    print(f"report: {write_report(outs, parent / 'report')}")
    return 1 if ended_early else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from experiments.executor import make_executor
    from experiments.sweep import run_sweep

    man = run_sweep(args.scenario, args.grid, args.out, args.set, executor=make_executor(args.executor))
    failed = {k: v["status"] for k, v in man["points"].items() if v["status"].startswith("failed")}
    for k, v in man["points"].items():
        print(f"{k}: {v['status']}")
    if "report" in man:
        print(f"wrote {man['report']}")
    return 1 if failed else 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from experiments.executor import make_executor
    from experiments.experiment import run_experiment
    from experiments.spec import load_spec

    res = run_experiment(load_spec(args.spec), args.out, make_executor(args.executor))
    print(res["text"])
    print(f"wrote {res['results']}, {res['comparison']}, {res['report']}")
    return 1 if res["failed"] else 0


def cmd_capacity(args: argparse.Namespace) -> int:
    import json

    from experiments.capacity import (capacity_overrides, check_resume, check_scenario, check_search_size, flagged_lines,
                                      measure_capacity)
    from experiments.executor import make_executor
    from testbed.atomic import write_json

    def check() -> tuple[Path, Any, Any]:
        try:
            check_search_size(args.max_probes, args.repetitions)
        except ValueError as e:
            raise UserError(f"--max-probes {args.max_probes} --repetitions {args.repetitions}: {e}") from None
        executor = make_executor(args.executor)  # before the scenario: `scale: auto` is checked at what a run on it resolves
        overrides = capacity_overrides(args.set, not args.no_early_stop)
        sc = check_scenario(args.scenario, overrides, executor)
        # the default folder is named as `prfaas run`'s is, by the scenario's name (`validation.name_or_stem`: its
        # `name:` or its file's name, a plain name of at most MAX_NAME_BYTES): the file's stem was used unchecked, and a
        # 250-byte file name with a `name:` in it was a "cannot create this folder (File name too long)" once checked
        out = Path(args.out) if args.out else _default_out(f"capacity-{sc.name}")
        check_resume(out, args.scenario, overrides)  # an earlier search's runs in --out: damaged or of other settings, refused now
        return out, executor, sc

    out, executor, sc = make_output_dir(lambda checked: checked[0], check)  # the folder before the plan, after every refusal
    doc = measure_capacity(args.scenario, args.set, out, repetitions=args.repetitions, rel_tol=args.tolerance,
                           max_probes=args.max_probes, start_rps=args.start, executor=executor,
                           progress=not args.json, early_stop=not args.no_early_stop, checked=sc)
    write_json(out / "capacity.json", doc, indent=1)
    if args.json:
        print(json.dumps({k: doc[k] for k in ("lambda_max_rps", "ci", "ci_dose_response", "runs", "flagged_runs", "slo", "scenario")}))
        return 0
    lo, hi = doc["ci"]
    print(f"Lambda_max {doc['lambda_max_rps']:.3g} req/s (every repetition passed at {lo:.3g}, "
          f"{'every one failed at ' + format(hi, '.3g') if hi is not None else 'no rate failed in every repetition'}); "
          f"{doc['runs']} runs; SLO TTFT {doc['slo']['ttft_s']:g} s, TPOT {doc['slo']['tpot_s'] * 1e3:g} ms, "
          f">= {doc['slo']['good_fraction']:.0%} good, queue not growing")
    dr = doc["ci_dose_response"]
    print(f"  dose-response 95% interval of the majority's edge: {format_interval(dr['ci'])} ({dr['method']}"
          f"{'; ' + dr['note'] if dr['note'] else ''})")
    for p in doc["probes"]:
        print(f"  {p['rate_rps']:.4g} req/s: {'pass' if p['passed'] else 'fail'}  "
              + "; ".join(f"seed {r['seed']}: {'ok' if r['passed'] else r['reason']}" for r in p["runs"]))
    for line in flagged_lines(doc["flagged_runs"]):
        print(line)
    print(f"wrote {out / 'capacity.json'}")
    return 0 if doc["bracketed"] else 1


def format_interval(ci: Sequence[float | None]) -> str:
    """[lo, hi] to 3 digits; an open end (None) is -inf / inf."""
    lo, hi = ci
    return f"[{'-inf' if lo is None else format(lo, '.3g')}, {'inf' if hi is None else format(hi, '.3g')}]"


def _p_text(p: Any) -> str:
    return f"{p:.3g}" if isinstance(p, (int, float)) else "none (no discordant seed)"


def cmd_reproduce(args: argparse.Namespace) -> int:
    import json

    from experiments.capacity import flagged_lines
    from experiments.capacity_paired import ALPHA, PairedOrder
    from experiments.executor import make_executor
    from experiments.reproduce import (CONFIGURATIONS, check_planned_runs, earlier_looks, plan_case_study, reproduce_case_study,
                                      write_document)

    only = tuple(comma_list(args.only, "--only", ",".join(CONFIGURATIONS)))  # (reproduce_case_study measures each once)
    bad = [x for x in only if x not in CONFIGURATIONS]
    if bad:
        raise UserError(f"--only {args.only!r}: choose from {', '.join(CONFIGURATIONS)}")
    if args.paired_from is not None and not args.paired:
        raise UserError(f"--paired-from {args.paired_from}: it names the first seed of a paired test; add --paired N")
    out = Path(args.out) if args.out else _default_out("reproduce-case-study")

    def check() -> tuple[Any, Any]:  # everything before the folder is made: a refusal left an empty runs/reproduce-case-study-<time>
        if args.paired:  # its count was read with `paired_seed_count`: 0 (none) or 6..MAX_RUNS
            if len(set(only)) < 2:
                raise UserError(f"--paired {args.paired}: the order test needs two configurations, --only names {len(set(only))}")
        try:
            check_planned_runs(args.quick, args.repetitions, len(set(only)), args.paired)
        except ValueError as e:
            given = (f" --repetitions {args.repetitions}" if args.repetitions else "") + (f" --paired {args.paired}" if args.paired else "")
            raise UserError(f"{('--quick' if args.quick else 'the full variant') + given}: {e}") from None
        if args.paired:
            from experiments.reproduce import paired_test_seeds

            try:
                paired_test_seeds(out, only, args.quick, args.repetitions, args.paired, args.paired_from)
            except ValueError as e:
                raise UserError(f"--paired-from {args.paired_from}: {e}" if args.paired_from is not None else f"--paired {args.paired}: {e}") from None
        executor = make_executor(args.executor)
        # every configuration checked, and its runs already in --out (damaged, or of other settings): refused now, not hours in
        return executor, plan_case_study(args.quick, tuple(dict.fromkeys(only)), not args.no_early_stop, executor, out)

    executor, plan = make_output_dir(out, check)  # before the plan is printed, after every refusal
    doc = reproduce_case_study(out, quick=args.quick, repetitions=args.repetitions, only=only, executor=executor,
                               progress=not args.json, early_stop=not args.no_early_stop, paired_seeds=args.paired,
                               paired_from=args.paired_from, plan=plan)
    unread: list[str] = []
    kept = write_document(out, doc, unread)
    if kept is not None:
        print(f"kept the earlier {out / 'reproduce.json'} as {kept}"
              + (f" (unreadable, so its time is in no sum: {unread[0]})" if unread else ""), file=sys.stderr)
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"case study ({'quick' if args.quick else 'full'}), Lambda_max in req/s; {doc['wall_s'] / 60:.1f} min")
    print(f"{'configuration':20} {'measured':>8} {'interval':>15} {'dose-resp.':>15} {'runs':>4} {'model lit.':>10} {'model mean':>10} "
          f"{'ratio meas.':>11} {'ratio interval':>15} {'model lit.':>10} {'model mean':>10} {'paper':>5}")
    nan = float("nan")
    for k in CONFIGURATIONS:
        m, md = doc["measured"].get(k), doc["model"][k]
        r = doc["measured_ratio_vs_homogeneous"].get(k)
        ci = f"[{m['ci'][0]:.3g}, {m['ci'][1]:.3g}]" if m and m["ci"][1] is not None else "-"
        rci = doc["measured_ratio_interval"].get(k)
        rci = f"[{rci[0]:.3g}, {rci[1]:.3g}]" if rci and None not in rci else "-"
        paper = doc["paper_ratio_vs_homogeneous"][k]
        mr = doc["model_ratio_vs_homogeneous"]
        dr = format_interval(m["ci_dose_response"]["ci"]) if m else "-"
        print(f"{k:20} {m['lambda_max_rps'] if m else nan:8.3g} {ci:>15} {dr:>15} {m['runs'] if m else 0:4d} {md['lambda_max_rps']:10.3g} "
              f"{md['lambda_max_rps_mean_reading']:10.3g} {r if r is not None else nan:11.3g} {rci:>15} "
              f"{mr['literal'][k]:10.3g} {mr['mean'][k]:10.3g} {paper if paper is not None else nan:5.3g}")
    for k, m in doc["measured"].items():
        for line in flagged_lines(m.get("flagged_runs") or [], k):  # (documents written before 2026-12-03 have none)
            print(line)
    for k, x in doc["above_model"].items():
        print(f"note: {k} measured {x:.2f}x the model's fluid bound, where its queues grow without end: the runs were too "
              f"short to show it{' (quick variant: run the full one)' if args.quick else ''}, or drew a lighter workload than "
              "the mean; not a capacity (docs/analysis.md)")
    for p in doc["paired"]:
        print(f"paired: {PairedOrder(**p).sentence()}")
        others = earlier_looks(out, p)
        if others:
            looks = len(others) + 1
            print(f"  note: {looks} paired tests of this pair in {out} (the others: "
                  + "; ".join(f"seeds {min(o['seeds'])}..{max(o['seeds'])}, p = {_p_text(o.get('p_value'))}"
                              for o in others)
                  + f"): an order holds over them only where a test's p < {ALPHA:g} / {looks} = {ALPHA / looks:.3g} (Bonferroni)")
    print(f"wrote {out / 'reproduce.json'}")
    return 0
