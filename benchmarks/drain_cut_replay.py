"""Replay recorded runs through the drain cut: when would it end each run's drain, with and without cutting
requests that still wait for their first token? (docs/experiments.md, "The drain cut").

    python benchmarks/drain_cut_replay.py RUN_DIR_OR_REPRODUCTION... [--json OUT] [--step 0.2]

For each run directory (or every ``probes/rate=*/seed*`` under a reproduction's folder) the client's own times
(``client_arrival_s``, ``client_first_token_s``, ``client_finish_s`` of ``requests.parquet``) go through
`testbed.serving.early_stop.EarlyStop` every `--step` seconds after the last arrival, as the client agent
polls it: ``first_tokens_s`` is when the rule of 2026-12-03 (every request has its first token) would have cut
the drain, ``waiting_s`` when today's rule (`EarlyStop.step_settled`: requests still waiting may be cut once
they cannot move the queue trend's step) would, both after the last arrival; ``saved_s`` the difference. A run
the early stop ended, or whose drain no rule cuts before its last answer, says so. The replay reads what the
run recorded: a run cut at time T shows nothing after T, so a rule that would fire later than the run's own
cut is not seen (``None``). Nothing is measured on the wire here; the wall times of runs made with each rule
are in docs/experiments.md and docs/analysis.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from testbed.atomic import write_json  # noqa: E402
from testbed.errors import UserError  # noqa: E402
from testbed.serving.early_stop import CUT, EarlyStop  # noqa: E402


def replay(run_dir: Path, step_s: float = 0.2, stop_below: float = 0.9) -> dict[str, Any]:
    """When each rule would cut `run_dir`'s drain, in seconds after its last arrival (client clock)."""
    df = pd.read_parquet(run_dir / "requests.parquet")
    summary = json.loads((run_dir / "summary.json").read_text())
    slo = summary.get("slo") or {}
    row: dict[str, Any] = {"run": str(run_dir), "requests": int(len(df)), "first_tokens_s": None, "waiting_s": None,
                           "saved_s": None, "note": ""}
    if summary.get("early_stop"):
        return {**row, "note": "stopped early"}
    if slo.get("ttft_s") is None or slo.get("tpot_s") is None or not len(df):
        return {**row, "note": "no SLO"}
    arr, first, fin = (df[c].to_numpy(float) for c in ("client_arrival_s", "client_first_token_s", "client_finish_s"))
    ok = (df["status"] == "ok").to_numpy()
    cut = (df["status"] == CUT).to_numpy()
    out = df["output_len"].to_numpy(int)
    last = float(np.nanmax(arr))
    for t in np.arange(last, float(np.nanmax(fin)) + step_s, step_s):
        e = EarlyStop(len(df), float(slo["ttft_s"]), float(slo["tpot_s"]), stop_below)
        done = np.isfinite(fin) & (fin <= t) & ~cut
        for i in np.flatnonzero(done):
            e.finish(arr[i], first[i] if np.isfinite(first[i]) else None, int(out[i]), fin[i], bool(ok[i]))
        flight = [(arr[i], first[i] if np.isfinite(first[i]) and first[i] <= t else None, int(out[i]))
                  for i in np.flatnonzero(~done & np.isfinite(arr))]
        if not flight or (cut.any() and t > np.nanmax(fin[cut]) + step_s):
            break  # past the run's own cut (which the client polls every 0.2 s): what came after was not recorded
        if e.drain_settled(flight, float(t)) is None:
            continue
        row["waiting_s"] = row["waiting_s"] if row["waiting_s"] is not None else float(t - last)
        if all(f is not None for _, f, _ in flight):
            row["first_tokens_s"] = float(t - last)
            break
    if row["waiting_s"] is not None and row["first_tokens_s"] is not None:
        row["saved_s"] = row["first_tokens_s"] - row["waiting_s"]
    elif row["waiting_s"] is None:
        row["note"] = "not cut before its last answer"
    return row


def run_dirs(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += [p] if (p / "requests.parquet").exists() else sorted(p.glob("*/probes/rate=*/seed*")) + sorted(p.glob("probes/rate=*/seed*"))
    return [d for d in out if (d / "requests.parquet").exists() and (d / "summary.json").exists()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/drain_cut_replay.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="run directories, or reproduction folders (their probes/rate=*/seed* runs)")
    ap.add_argument("--json", help="write the rows and their totals here")
    ap.add_argument("--step", type=float, default=0.2, help="seconds between the replay's checks (the client polls every 0.2 s)")
    args = ap.parse_args(argv)
    dirs = run_dirs(args.paths)
    if not dirs:
        raise UserError("no run directory with requests.parquet and summary.json under the paths given")
    if not args.step > 0:
        raise UserError(f"--step: {args.step:g} is not a number of seconds > 0")
    rows = []
    for d in dirs:
        try:
            rows.append(replay(d, args.step))
        except (OSError, ValueError, KeyError) as exc:  # a damaged or older run directory: named, not a traceback
            raise UserError(f"{d}: cannot replay it ({type(exc).__name__}: {exc})") from None
    table = Table("run", "cut: every first token (s)", "cut: waiting too (s)", "saved (s)", "note")
    for r in rows:
        table.add_row("/".join(Path(r["run"]).parts[-4:]), *(f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("first_tokens_s", "waiting_s", "saved_s")), r["note"])
    saved = [r["saved_s"] for r in rows if r["saved_s"] is not None]
    Console().print(table)
    total = {"runs": len(rows), "compared": len(saved), "saved_s_total": float(sum(saved)),
             "saved_s_mean": float(np.mean(saved)) if saved else None}
    print(f"{total['compared']} of {total['runs']} runs compared: {total['saved_s_total']:.1f} s saved in all"
          + (f", {total['saved_s_mean']:.1f} s a run" if saved else ""))
    if args.json:
        write_json(args.json, {"rows": rows, **total})
    return 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
