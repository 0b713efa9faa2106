"""Subcommands of the experiments layer: ``run``, ``quickstart``, ``sweep``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from testbed import rundir
from testbed.errors import UserError


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("run", help="one complete run of a scenario: network, workers, router, workload, results",
                       description="Bring up the scenario's network, start the workers and the router in its hosts, "
                                   "drive the workload, collect the run directory, tear everything down.")
    p.add_argument("scenario", help="a scenario file, or the name of a ready one in topologies/ (e.g. quick)")
    p.add_argument("--out", help="run directory (default: runs/<scenario>-<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario field, e.g. --set wan.rate=20Gbps --set policy.name=fixed-threshold")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    p.set_defaults(func=cmd_run)
    q = sub.add_parser("quickstart", help="run topologies/quick.yaml under two policies and compare them in a report",
                       description="README's main job: the quick scenario under each policy given (default: prfaas, then "
                                   "fixed-threshold on the same workload and WAN), then one comparison report.")
    q.add_argument("--out", help="parent directory of the runs (default: runs/quick-<time>)")
    q.add_argument("--policies", default="prfaas,fixed-threshold", help="comma-separated policies to compare")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cmd_quickstart)

    s = sub.add_parser("sweep", help="run a grid of scenario variations, resumable, ending in one comparison report")
    s.add_argument("scenario", metavar="SCENARIO")
    s.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="e.g. --grid wan.rate=10Gbps,40Gbps --grid seed=1,2")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override applied to every point")
    s.add_argument("--out", required=True, metavar="DIR")
    _executor_option(s)
    s.set_defaults(func=cmd_sweep)


def _executor_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", default="local", metavar="NAME[:ARG]",
                   help="how the runs are run: local (one after another, the default); docs/experiments.md")


def _default_out(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _print_summary(out: Path) -> None:
    s = rundir.read_summary(out)
    ttft, tpot, eg = s.get("ttft_s") or {}, s.get("tpot_s") or {}, s.get("egress_gbps") or {}

    def f(x: object, fmt: str = "{:.3f}") -> str:
        return fmt.format(x) if isinstance(x, (int, float)) else "-"

    print(f"run directory: {out}")
    print(f"  requests: {s['requests_ok']} ok / {s['requests_failed']} failed of {s['requests_total']}"
          f"   throughput {f(s.get('throughput_rps'), '{:.2f}')} req/s   offloaded {f(s.get('offload_fraction'), '{:.0%}')}")
    print(f"  TTFT p50/p90/p99: {f(ttft.get('p50'))} / {f(ttft.get('p90'))} / {f(ttft.get('p99'))} s"
          f"   TPOT mean/p90: {f(tpot.get('mean'), '{:.4f}')} / {f(tpot.get('p90'), '{:.4f}')} s")
    print(f"  WAN egress mean/p99: {f(eg.get('mean'), '{:.2f}')} / {f(eg.get('p99'), '{:.2f}')} Gbps (emulated; scale {s.get('scale')},"
          f" {s.get('compute', '?')} compute, policy {s.get('policy')})")


def _run_report(out: Path) -> None:
    """The run directory's plots/*.png and report.html."""
    from analysis.report import write_report

    print(f"  report: {write_report([out])}")


def cmd_run(args: argparse.Namespace) -> int:
    from experiments.runs import run_once
    from testbed.sections import load_scenario

    scenario = load_scenario(args.scenario, args.overrides)
    out = Path(args.out) if args.out else _default_out(scenario.name)
    if out.exists() and (out / rundir.SUMMARY_FILE).exists():
        raise UserError(f"--out {out}: already holds a run ({rundir.SUMMARY_FILE}); choose another directory")
    run_once(scenario, out, progress=not args.no_progress)
    _print_summary(out)
    _run_report(out)
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """The quick scenario once per policy, then the comparison report."""
    from analysis.report import write_report
    from experiments.runs import run_once
    from testbed.sections import load_scenario

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UserError("--policies: name at least one policy, e.g. prfaas,fixed-threshold")
    scenarios = [load_scenario("quick", [f"policy.name={p}"]) for p in policies]  # all checked before any runs
    parent = Path(args.out) if args.out else _default_out("quick")
    outs = []
    for policy, scenario in zip(policies, scenarios):
        out = parent / policy
        print(f"== quick scenario, policy {policy}")
        run_once(scenario, out, progress=not args.no_progress)
        _print_summary(out)
        _run_report(out)
        outs.append(out)
    print(f"report: {write_report(outs, parent / 'report')}")
    return 0


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
