"""Subcommands of the analysis area: ``model``, ``report``, ``wall``, ``replay-estimator``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from testbed.atomic import make_output_dir, replace_with
from testbed.errors import FieldError, UserError
from testbed.validation import at_least_one, comma_list, option, path_option


def register(sub: "argparse._SubParsersAction") -> None:
    m = sub.add_parser("model", help="the analytical throughput model (Eqs. 3-8) and its grid search")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", metavar="FILE", help="model the clusters, WAN and workload of a scenario")
    src.add_argument("--paper-case-study", action="store_true", help="the paper's case study (32 H200 + 64 H20, 100 Gbps)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="scenario override (with --scenario)")
    m.add_argument("--reading", choices=("literal", "mean"), default="literal", help="primary reading of Eq. 3 (the other is shown beside it)")
    m.add_argument("--step", type=option(at_least_one, whole=True), default=64, metavar="TOKENS",
                   help="threshold grid step (default 64 tokens; at least 1: a finer grid only costs memory)")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.add_argument("--plots", type=path_option, metavar="DIR", help="write Lambda-vs-t and Lambda-vs-split figures here")
    m.set_defaults(func=cmd_model)

    r = sub.add_parser("report", help="report.html and plots of one run or a comparison of several")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (runs/...): one, or several side by side")
    r.add_argument("--out", type=path_option, metavar="DIR", help="where report.html and plots/ go (default: the run directory; required for several)")
    r.set_defaults(func=cmd_report)

    w = sub.add_parser("wall", help="the bandwidth wall: Phi_kv per model (published, profiles, measured) and cluster egress")
    w.add_argument("--measure", nargs="*", metavar="MODEL", help="also time prefill of these torch models here (default: kimi-linear-48b minimax-m2.5)")
    w.add_argument("--lengths", default="128,256,512", help="token counts to measure (comma separated; default 128,256,512)")
    w.add_argument("--variant", default="faithful", help="torch model variant (faithful keeps the real KV geometry)")
    w.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where --measure runs (default auto: cuda when there is one)")
    w.add_argument("--gpus", type=option(at_least_one, whole=True), default=512, help="cluster size for Eq. 2 (default 512)")
    w.add_argument("--save", type=path_option, metavar="DIR", help="write measured points as DIR/measured-MODEL.csv (a profile for `load_profile`)")
    w.add_argument("--json", action="store_true", help="print the tables as JSON")
    w.add_argument("--plots", type=path_option, metavar="DIR", help="write the bandwidth-wall figure here")
    w.add_argument("--measured", nargs="+", metavar="PROFILE", help="profiles written by `prfaas profile`: their measured "
                   "Phi_kv beside the published Table 3 values")
    w.set_defaults(func=cmd_wall)

    e = sub.add_parser("replay-estimator", help="replay recorded runs' observed signals through the bandwidth estimator "
                       "with other settings (open loop: a design aid, not a measurement)")
    e.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories whose observed signals to replay")
    e.add_argument("--set", action="append", default=[], metavar="policy.estimator.KEY=VALUE",
                   help="estimator setting to replay with (repeatable); none: the run's own, to check the replay's fidelity")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(func=cmd_replay_estimator)


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_model(args: argparse.Namespace) -> int:
    from analysis import throughput_model as tm

    if args.paper_case_study:
        if args.set:  # the paper's fixed inputs: an override was ignored without a word (exit 0)
            raise UserError(f"--set {args.set[0]}: overrides a scenario, so it goes with --scenario, not --paper-case-study")
        cm, homo, dist = tm.paper_case_study()
        inputs = dict(tm.CASE_STUDY_INPUTS)
    else:
        from testbed.models.profiles import check_model
        from testbed.sections import load_scenario

        sc = load_scenario(args.scenario, args.set)
        cm, homo, dist, inputs = tm.cluster_model_from_scenario(sc)
        model = sc.section("model")
        # the model is the profiles' times: another model's were used without a word in a torch-mode scenario (whose
        # check leaves its profiles alone: its run does not use them), 2026-12-07
        for cluster, prof in cm.profiles_not_of(model.spec.name) if model is not None else ():
            try:
                check_model(prof, model.spec.name)
            except UserError as exc:
                raise FieldError(f"serving.profiles.{cluster}", str(exc), sc.source) from None
    other = "mean" if args.reading == "literal" else "literal"
    primary = tm.evaluate(cm, homo, dist, args.reading, args.step)
    alt = tm.evaluate(cm, homo, dist, other, args.step)
    doc = tm.results_json(primary, alt, inputs)
    if args.plots:
        from analysis import plots

        d = Path(args.plots)
        doc["plots"] = [str(plots.save(plots.lambda_vs_threshold(primary["prfaas_pd"], alt["prfaas_pd"]), d / "lambda_vs_threshold.png")),
                        str(plots.save(plots.lambda_vs_split(primary["prfaas_pd"]), d / "lambda_vs_split.png"))]
    if args.json:
        _print_json(doc)
        return 0
    print_model(doc)
    return 0


def print_model(doc: dict[str, Any]) -> None:
    print("Inputs:")
    for k, v in doc["inputs"].items():
        print(f"  {k}: {v}")
    print(f"\nThroughput model (Eqs. 3-8), {doc['reading']} reading of Eq. 3; Theta and Lambda in requests/s, egress in Gbps")
    head = ("configuration", "t(tokens)", "p", "Np/Nd", "Th_prfaas", "Th_pdp", "Th_pdd", "Lambda_max", "x_homog", "egress", "bottleneck", "Lambda(other)")
    f = lambda v, d=4: "-" if v is None else f"{v:.{d}g}"  # noqa: E731
    rows = [head]
    for name in ("prfaas_pd", "homogeneous_pd", "naive_heterogeneous"):
        s = doc[name]
        rows.append((name, f(s.get("threshold"), 6), f(s.get("offload_fraction"), 3), f"{s['n_p']}/{s['n_d']}", f(s.get("theta_prfaas")),
                     f(s.get("theta_pdp")), f(s.get("theta_pdd")), f(s["lambda_max"]), f(doc["speedup_vs_homogeneous_pd"][name], 3),
                     f(s.get("egress_gbps"), 3), s["bottleneck"], f(s["other_reading"]["lambda_max"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for p in doc.get("plots", []):
        print(f"wrote {p}")


def cmd_report(args: argparse.Namespace) -> int:
    import time

    from analysis.report import write_report

    t0 = time.perf_counter()
    path = write_report(args.run_dirs, args.out)
    print(f"wrote {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in comma_list(text, "--lengths", "128,256,512")]
    except ValueError:
        raise UserError(f"--lengths {text!r}: use whole numbers separated by commas, e.g. 128,256,512") from None
    if any(x < 1 for x in out):
        raise UserError("--lengths: every length must be >= 1 token")
    return out


def cmd_wall(args: argparse.Namespace) -> int:
    import numpy as np
    import pandas as pd

    from analysis import bandwidth_wall as bw

    models = (args.measure or ["kimi-linear-48b", "minimax-m2.5"]) if args.measure is not None else []

    def check() -> tuple[list[int], Any]:  # every input read before any timing, and before --save's folder is made
        from testbed.models.spec import load_model_spec

        if args.save and not models:
            raise UserError(f"--save {args.save}: it writes the points --measure times; add --measure [MODEL ...]")
        for m in models:
            load_model_spec(m)
        return (_lengths(args.lengths) if models else []), (bw.measured_profiles_table(args.measured) if args.measured else None)

    lengths, profiles = make_output_dir(args.save, check) if args.save else check()
    published = bw.published_table()
    curves = [bw.profile_curve(m, p, np.geomspace(1024, 131072, 40)) for m, p in bw.PROFILE_CURVES.items()]
    measured = None
    if models:
        from rich.progress import Progress

        parts = []
        with Progress() as bar:
            task = bar.add_task("timing prefill", total=len(models) * len(lengths))
            for m in models:
                parts.append(bw.measure(m, lengths, args.variant, args.device, progress=lambda: bar.advance(task)))
        measured = pd.concat(parts, ignore_index=True)
        if args.save:
            d = Path(args.save)
            for m, part in measured.groupby("model"):
                points = part[["tokens", "prefill_s", "kv_bytes", "phi_gbps", "source"]]
                replace_with(d / f"measured-{m}.csv", lambda tmp: points.to_csv(tmp, index=False))
    cluster = bw.cluster_table(args.gpus)
    doc: dict[str, Any] = {"published": published.to_dict("records"), "cluster_egress": cluster.to_dict("records")}
    if measured is not None:
        doc["measured"] = measured.to_dict("records")
    if args.plots:
        from analysis.plots import save

        doc["plots"] = [str(save(bw.wall_figure(published, curves, measured, args.gpus), Path(args.plots) / "bandwidth_wall.png"))]
    if profiles is not None:
        doc["measured_profiles"] = profiles.to_dict("records")
    if args.json:
        _print_json(doc)
        return 0
    pd.set_option("display.width", 200)
    print("Phi_kv per 8xH200 instance, published (paper Tables 3 and 5); implied prefill = S_kv / Phi_kv with our specs' bytes")
    print(published.pivot(index="model", columns="tokens", values="phi_gbps").to_string(float_format=lambda v: f"{v:.2f}"))
    print(f"\nEq. 2 cluster egress, {args.gpus} GPUs, 8 per instance, L_avg = 32K (Gbps; link lines 10 and 100 Gbps)")
    print(cluster[["model", "kind", "phi_gbps", "egress_gbps", "fits_10gbps", "fits_100gbps"]].to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    if measured is not None:
        print("\nMeasured here (real forward passes; KV bytes of the cache produced):")
        print(measured.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    if args.measured:
        print("\nMeasured profiles beside the published values (Phi_kv in Gbps; S_kv of the geometry that ran / T_prefill;"
              "\n'*' = from the profile's fitted curve beyond 2x its longest measured length, '~' = from the curve within it):")
        print(bw.format_measured_table(pd.DataFrame(doc["measured_profiles"])))
    for p in doc.get("plots", []):
        print(f"wrote {p}")
    return 0


def cmd_replay_estimator(args: argparse.Namespace) -> int:
    from rich.table import Table

    from analysis.replay import replay_run
    from testbed.console import wide_console

    res = [replay_run(Path(d), args.set) for d in args.run_dirs]
    med = lambda e: e["median_abs_error"]  # noqa: E731
    doc = {"set": args.set, "runs": [{"run_dir": str(r.run_dir), "recorded": r.recorded, "replayed": r.replayed} for r in res]}
    both = [(med(r.recorded), med(r.replayed)) for r in res if med(r.recorded) is not None and med(r.replayed) is not None]
    if both:
        doc["mean_median_abs_error"] = {"recorded": sum(a for a, _ in both) / len(both), "replayed": sum(b for _, b in both) / len(both)}
    if args.json:
        _print_json(doc)
        return 0
    t = Table(title="estimator error in steady periods (median |estimate - truth| / truth), recorded and replayed"
                    + (f" with {' '.join(args.set)}" if args.set else " (the runs' own settings)"))
    for c in ("run", "steady samples", "recorded", "replayed", "replayed P90"):
        t.add_column(c)
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in res:
        t.add_row(str(Path(*r.run_dir.parts[-3:])), str(r.replayed["steady_samples"]), f(med(r.recorded)), f(med(r.replayed)), f(r.replayed["p90_abs_error"]))
    if "mean_median_abs_error" in doc:
        m = doc["mean_median_abs_error"]
        t.add_row(f"mean of {len(both)}", "", f(m["recorded"]), f(m["replayed"]), "")
    wide_console().print(t)
    print("open loop: the recorded probes and decisions are replayed as they were; judge a rule by live runs "
          "(benchmarks/signals_bench.py)")
    return 0
