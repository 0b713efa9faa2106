"""`prfaas traffic stats` and `prfaas traffic generate`: inspect a Mooncake trace, export a scenario's workload."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


from testbed import units
from testbed.errors import UserError
from testbed.validation import Fields, option, output_file_option, random_seed, read_yaml
from testbed.scenario import apply_overrides, find_scenario
from testbed.sections import SCENARIO_KEYS, load_scenario
from testbed.blocks import BLOCK_TOKENS
from traffic.stats import TraceStats, trace_stats
from traffic.trace import SKIP_BAD_OPTION, read_trace, write_trace
from traffic.workload import WorkloadSpec, generate_batch, parse_workload_section


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("traffic", help="workloads: trace statistics, generate a workload as a Mooncake trace")
    tsub = p.add_subparsers(dest="traffic_command", metavar="SUBCOMMAND", parser_class=type(p))
    s = tsub.add_parser("stats", help="request count, lengths, arrival rate and prefix reuse of a Mooncake JSONL trace")
    s.add_argument("file", metavar="FILE", help="Mooncake-format JSONL trace")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON")
    s.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted) instead of stopping at the first")
    s.set_defaults(func=cmd_stats)
    g = tsub.add_parser("generate", help="draw a scenario's workload and write it as a Mooncake JSONL trace")
    g.add_argument("source", metavar="SCENARIO_OR_SPEC", help="a scenario (name or file) with a workload: section, or a YAML file holding only a workload section")
    g.add_argument("--out", type=output_file_option, required=True, metavar="FILE", help="output JSONL file")
    g.add_argument("--duration", metavar="TIME", help="e.g. 10min (default: the scenario's duration, else 60s)")
    g.add_argument("--seed", type=option(random_seed, whole=True), help="default: the scenario's seed, else 1")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario field")
    g.set_defaults(func=cmd_generate)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def cmd_stats(args: argparse.Namespace) -> int:
    data = read_trace(args.file, skip_bad=args.skip_bad, skip_hint=SKIP_BAD_OPTION)
    st = trace_stats(data.requests)
    if args.json:
        out = {"file": str(args.file), "skipped_lines": data.skipped, "problems": list(data.problems), **st.to_dict()}
        print(json.dumps(_finite(out), indent=2))
    else:
        _print_stats(str(args.file), st, data.skipped, data.problems)
    return 0


def _finite(v: Any) -> Any:
    """NaN (statistics of an empty trace) is not JSON: write null."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and v != v else v


def _print_stats(name: str, st: TraceStats, skipped: int, problems: tuple[str, ...]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not st.requests:  # a table of NaN said nothing
        print(f"{name}: no requests" + (f" ({skipped} bad lines skipped)" if skipped else "") + ": nothing to summarise")
        return
    t = Table(title_justify="left", title=f"{name}: {st.requests} requests" + (f" ({skipped} bad lines skipped)" if skipped else ""))
    for col in ("", "mean", "std", "min", "p50", "p90", "p99", "max"):
        t.add_column(col, justify="right" if col else "left", no_wrap=True)
    for label, s, fmt in (("input tokens", st.input_len, ",.0f"), ("output tokens", st.output_len, ",.0f"),
                          ("arrivals/s", st.arrivals.per_second, ".2f")):
        t.add_row(label, *(format(getattr(s, k), fmt) for k in ("mean", "std", "min", "p50", "p90", "p99", "max")))
    console = Console(width=max(100, Console().width))
    console.print(t)
    a = st.arrivals
    console.print(f"duration {a.duration_s:,.1f} s, mean rate {a.mean_rps:.3f} req/s, inter-arrival CV {a.interarrival_cv:.3f}")
    console.print(f"prefix reuse (infinite cache, {BLOCK_TOKENS}-token blocks): hit_ratio {st.hit_ratio:.4f} "
                  f"({st.reusable_tokens:,} of {st.input_tokens:,} input tokens)")
    for p in problems:
        console.print(f"skipped: {p}")


# a scenario's keys that a workload mapping never holds (`seed` is both's): a file with one of them is a scenario
SCENARIO_ONLY_KEYS = SCENARIO_KEYS - {"seed"}


def _load_spec(source: str, overrides: list[str]) -> tuple[WorkloadSpec, int | None, float | None]:
    path = find_scenario(source)
    data: Any = read_yaml(path, "a workload (a YAML mapping of arrivals, input, output, ...: docs/scenario-workload.md) or a "
                                "scenario with a workload: section")
    if isinstance(data, dict) and set(data) & SCENARIO_ONLY_KEYS:
        sc = load_scenario(str(path), overrides)
        spec = sc.section("workload")
        if spec is None:  # was read as a workload mapping: "workload.duration: unknown key" (2026-12-07)
            raise UserError(f"{path}: scenario {sc.name} has no workload: section to draw; add one (docs/scenario-workload.md), "
                            "e.g. --set 'workload={arrivals: {rate: 2}}'")
        return spec, sc.seed, sc.duration_s
    data = apply_overrides(data, overrides)
    return parse_workload_section(Fields(data, "workload", str(path))), None, None


def cmd_generate(args: argparse.Namespace) -> int:
    spec, seed, duration_s = _load_spec(args.source, args.set)
    if args.duration is not None:
        try:
            duration_s = units.parse_duration_s(args.duration, allow_zero=False)
        except ValueError as exc:
            raise UserError(f"--duration: {exc}") from None
    if duration_s is None and spec.trace is None:
        duration_s = 60.0
    seed = args.seed if args.seed is not None else (seed if seed is not None else 1)
    batch = generate_batch(spec, seed, duration_s)
    out = args.out
    n = write_trace(out, batch)
    print(f"wrote {n} requests ({'all' if duration_s is None else units.format_duration(duration_s)}, seed {seed}) to {out}", file=sys.stderr)
    return 0
