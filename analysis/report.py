"""``report.html`` of one run or a comparison of several: self-contained (PNGs embedded), scenario and
environment shown, a summary table with the throughput model's prediction beside each measurement.

Analyse -> plot -> report are separate steps over saved run data (Pantheon's habit): this module only
loads runs (`analysis.rundir`), asks `analysis.metrics` and `analysis.plots`, and writes HTML.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from analysis import plots
from analysis.metrics import model_ideal
from analysis.rundir import Run, load_run
from testbed.atomic import make_dirs, write_text
from testbed.errors import UserError


def predict(run: Run) -> dict[str, Any]:
    """The throughput model (literal reading) for the run's scenario and policy, or ``{"error": why}``.

    ``prfaas``: the optimum over t; ``fixed-threshold`` and ``oracle-step``: the scenario's t; ``homogeneous-pd`` / ``all-local``:
    the run's PD instances alone; ``naive-heterogeneous``: p = 1. The N_p / N_d split is the model's best.
    """
    from dataclasses import replace

    from analysis import throughput_model as tm
    from testbed.sections import parse_scenario

    try:
        sc = parse_scenario(run.scenario, str(run.path / "scenario.yaml"))
        cm, _, dist, _ = tm.cluster_model_from_scenario(sc)
        policy = sc.section("policy")
        name = getattr(policy, "name", "prfaas")
        if name in ("fixed-threshold", "oracle-step"):  # oracle-step: its threshold on the steady line
            res = tm.at_threshold(cm, dist, policy.threshold_tokens)
        elif name in ("homogeneous-pd", "all-local"):
            res = tm.homogeneous_pd(replace(cm, prfaas_profile=None, n_prfaas=0), dist)
        elif name == "naive-heterogeneous":
            res = tm.naive_heterogeneous(cm, dist)
        else:
            res = tm.search_prfaas_pd(cm, dist, step_tokens=256)
    except (UserError, ImportError, AttributeError, KeyError, TypeError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return res.to_dict()


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return html.escape(str(v))


def summary_rows(runs: Sequence[Run], predictions: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["run", "policy", "scale", "ok / total", "throughput (req/s)", "model Lambda_max (req/s)", "TTFT mean (s)",
            "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)", "TPOT mean (ms)", "TPOT p90 (ms)", "offloaded (fraction)",
            "model offload (fraction)", "model threshold (tokens)", "KV egress mean (Gbps)", "model egress at Lambda_max (Gbps)",
            "WAN sent mean (Gbps)", "prefix hits (requests, of the model's ideal)", "prefix-cache efficiency (tokens)", "timing fidelity"]
    rows = []
    for r, pr in zip(runs, predictions):
        m = r.metrics
        ms = lambda v: v * 1e3 if v is not None else None  # noqa: E731
        rows.append([
            r.path.name, m["policy"] + (" [ORACLE signals]" if m["policy"] == "prfaas" and m.get("signals") == "oracle" else ""), _fmt(r.scale), f"{m['requests_ok']} / {m['requests_total']}", _fmt(m["throughput_rps"]),
            _fmt(pr.get("lambda_max")), _fmt(m["ttft_s"]["mean"]), _fmt(m["ttft_s"]["p50"]), _fmt(m["ttft_s"]["p90"]),
            _fmt(m["ttft_s"]["p99"]), _fmt(ms(m["tpot_s"]["mean"])), _fmt(ms(m["tpot_s"]["p90"])), _fmt(m["offload_fraction"]),
            _fmt(pr.get("offload_fraction")), _fmt(pr.get("threshold")), _fmt(m["egress_gbps"]["mean"]), _fmt(pr.get("egress_gbps")),
            _fmt(m.get("wan_gbps", {}).get("mean")), prefix_cell(m.get("prefix_cache") or {}),
            _fmt((m.get("prefix_cache") or {}).get("efficiency")), fidelity_cell(r.summary),
        ])
    return head, rows


def prefix_cell(pc: dict[str, Any]) -> str:
    """The share of requests with a prefix hit against the ideal of the run's model (`metrics.prefix_cache`):
    "28% of 70%"; "-" when the run has no prefix figures."""
    hit, ideal = pc.get("hit_requests"), model_ideal(pc, "requests")
    if hit is None:
        return "-"
    return f"{hit:.0%}" + (f" of {ideal:.0%}" if ideal is not None else "")


def fidelity_cell(summary: dict[str, Any]) -> str:
    """A run's timing-fidelity verdict (testbed.fidelity): ok, FLAGGED, or - when it was not measured."""
    ok = summary.get("fidelity_ok")
    return "-" if ok is None else ("ok" if ok else "<b>FLAGGED</b>")


def fidelity_notes(runs: Sequence[Run]) -> list[str]:
    """One warning paragraph per run whose timing fidelity fell outside tolerance."""
    return [f"<p class='note'><b>Timing fidelity flagged for {html.escape(r.path.name)}</b> (node {html.escape(str(r.summary.get('node')))}): "
            f"{html.escape(str(r.summary.get('fidelity_flags')))}. Its latencies may include this host's interference "
            "(docs/scale-out.md, Timing fidelity).</p>" for r in runs if r.summary.get("fidelity_ok") is False]


def _table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    tr = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}"><figcaption>{html.escape(path.name)}</figcaption></figure>'


CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#f3f3f3}img{max-width:100%}
figure{margin:1em 0}pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:12px}.note{color:#555}"""


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> Path:
    """Load the runs, draw every plot into ``out/plots/*.png`` and write ``out/report.html``.

    `out_dir` defaults to the run directory for one run; several runs need one.
    """
    if not run_dirs:
        raise UserError("give at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    if out_dir is None:
        if len(runs) > 1:
            raise UserError("several runs need --out DIR for the comparison report")
        out_dir = runs[0].path
    out = Path(out_dir)
    pdir = out / "plots"
    predictions = [predict(r) for r in runs]
    figs: list[Path] = []
    for r in runs:
        tag = r.path.name if len(runs) > 1 else "run"
        figs.append(plots.save(plots.congestion_response(r), pdir / f"congestion_{tag}.png"))
        if r.tcp is not None:
            figs.append(plots.save(plots.kv_connections(r), pdir / f"kv_connections_{tag}.png"))
    figs.append(plots.save(plots.latency_cdfs(runs), pdir / "latency_cdfs.png"))
    if len(runs) > 1:
        figs.append(plots.save(plots.policies_across_dip(runs), pdir / "policies_across_dip.png"))
        figs.append(plots.save(plots.pantheon_summary(runs), pdir / "throughput_vs_p95_ttft.png"))
        figs.append(plots.save(plots.kv_pushback(runs), pdir / "kv_pushback.png"))
    head, rows = summary_rows(runs, predictions)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>prfaas report</title><style>{CSS}</style></head><body>",
             f"<h1>prfaas-testbed report: {html.escape(', '.join(r.path.name for r in runs))}</h1>",
             f"<p class='note'>Generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}. Rates and bytes in emulated units "
             "(wire x scale). Model columns: the analytical throughput model (Eqs. 3-8, literal reading of Eq. 3) for each run's "
             "scenario; it predicts the maximum sustainable rate, so a run offered less load measures less.</p>",
             "<h2>Summary</h2>", _table(head, rows), *fidelity_notes(runs)]
    errs = [(r, p["error"]) for r, p in zip(runs, predictions) if "error" in p]
    if errs:
        parts.append("<p class='note'>No model prediction for: " + "; ".join(f"{html.escape(r.path.name)} ({html.escape(e)})" for r, e in errs) + "</p>")
    parts.append("<h2>Figures</h2>")
    parts += [_img(p) for p in figs]
    parts.append("<h2>Runs</h2>")
    for r in runs:
        parts.append(f"<details><summary>{html.escape(r.path.name)}: scenario, environment, summary.json</summary>"
                     f"<h3>scenario.yaml</h3><pre>{html.escape(yaml.safe_dump(r.scenario, sort_keys=False))}</pre>"
                     f"<h3>environment.json</h3><pre>{html.escape(json.dumps(r.environment.to_json(), indent=2, default=str))}</pre>"
                     f"<h3>summary.json</h3><pre>{html.escape(json.dumps(r.summary, indent=2))}</pre></details>")
    parts.append("</body></html>")
    make_dirs(out)
    return write_text(out / "report.html", "\n".join(parts))
