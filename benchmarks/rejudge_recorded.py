"""Recompute the comparison of a recorded signals_bench JSON with today's statistics (analysis.stats).

The files under docs/measured-policies/ keep `signals_bench.measure`'s per-run rows (shape, arm, seed, long_p90_s,
xfer_p90_s, short_p90_s, slo, ...), in `runs` or under other keys. This finds every such row in the files given, keeps
those whose fields match each --where KEY=VALUE (compared as text) and whose seed is in --seeds, and compares each arm
with --against (fixed-threshold) per seed as signals_bench does: the mean of per-seed ratios of the long, KV and short
P90 TTFT (or, --ratio-of-means, their ratio of means with a paired interval), and the TTFT-SLO difference in points,
each with today's interval (none below `analysis.stats.MIN_PAIRS` seeds). Rows without a shape take --shape. A
(shape, arm, seed) found twice is refused: narrow the rows with --where. docs/router.md, "Issue 9's targets", was
judged again with it (session 68).

  python benchmarks/rejudge_recorded.py docs/measured-policies/cubic-ten-seeds-2026-12-05.json --where kv_cc=cubic
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pandas as pd  # noqa: E402

from analysis import stats  # noqa: E402
from signals_bench import RATIO_METRICS, bootstrap_ci, seed_ratios, slo_differences  # noqa: E402
from testbed.errors import UserError  # noqa: E402

ROW_KEYS = ("arm", "seed", "long_p90_s")  # what makes a dict a signals_bench row


def recorded_rows(doc: Any, where: dict[str, str]) -> list[dict[str, Any]]:
    """Every signals_bench row anywhere in `doc` (a loaded JSON) whose fields match `where` (compared as text)."""
    if isinstance(doc, dict):
        if all(k in doc for k in ROW_KEYS):
            return [doc] if all(str(doc.get(k)) == v for k, v in where.items()) else []
        doc = list(doc.values())
    if isinstance(doc, list):
        return [r for x in doc for r in recorded_rows(x, where)]
    return []


def ratio(a: pd.DataFrame, b: pd.DataFrame, key: str, ratio_of_means: bool) -> tuple[int, float, float, float] | None:
    """(seeds, ratio, low, high) of `key`, `a` over `b` (frames indexed by seed): signals_bench's mean of per-seed
    ratios, or the ratio of means with a paired interval (`analysis.stats.compare`, as sessions 55-58 quoted the case
    study); None where no seed has both."""
    if not ratio_of_means:
        r = seed_ratios(a, b, key)
        return (len(r), *bootstrap_ci(r)) if r else None
    seeds = sorted(set(a.index) & set(b.index))
    c = stats.compare(key, "a", "b", [a.at[s, key] for s in seeds], [b.at[s, key] for s in seeds])
    nan = float("nan")
    return (c.n, c.ratio, nan if c.ci_low is None else c.ci_low, nan if c.ci_high is None else c.ci_high) if c.n else None


def rejudge(rows: list[dict[str, Any]], against: str = "fixed-threshold",
            ratio_of_means: bool = False) -> list[tuple[str, str, str, int, float, float, float]]:
    """(shape, arm, metric, seeds, mean, low, high) of every arm against `against` on the seeds both ran: the
    `RATIO_METRICS` keys as the mean of per-seed ratios (or the ratio of means), "slo_pp" as the mean difference in
    points."""
    df = pd.DataFrame(rows)
    keys = ["shape", "arm", "seed"]
    if df.duplicated(keys).any():
        raise UserError(f"rows repeat: {df[df.duplicated(keys)][keys].values.tolist()[:3]}; narrow them with --where")
    out = []
    for shape, g in df.groupby("shape"):
        b = g[g["arm"] == against].set_index("seed")
        for arm, a in g[g["arm"] != against].groupby("arm"):
            a = a.set_index("seed")
            figures = [(key, ratio(a, b, key, ratio_of_means)) for _, key, _ in RATIO_METRICS]
            d = slo_differences(a, b)
            figures.append(("slo_pp", (len(d), *bootstrap_ci(d)) if d else None))
            out += [(shape, arm, key, *x) for key, x in figures if x]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="keep rows whose KEY is VALUE")
    ap.add_argument("--seeds", help="keep these seeds (comma-separated)")
    ap.add_argument("--shape", default="case-study", help="the shape of rows that name none (the case-study files)")
    ap.add_argument("--against", default="fixed-threshold", help="the arm in the denominator")
    ap.add_argument("--ratio-of-means", action="store_true", help="latency ratios as the ratio of means over seeds")
    a = ap.parse_args()
    bad = [w for w in a.where if "=" not in w]
    if bad:
        raise UserError(f"--where {bad[0]!r}: give KEY=VALUE, e.g. kv_cc=cubic")
    where = dict(w.split("=", 1) for w in a.where)
    rows = [{"shape": a.shape, **r} for f in a.files for r in recorded_rows(json.loads(f.read_text()), where)]
    if a.seeds:
        rows = [r for r in rows if str(r["seed"]) in a.seeds.split(",")]
    if not rows:
        raise UserError("no signals_bench rows match")
    for shape, arm, key, n, m, lo, hi in rejudge(rows, a.against, a.ratio_of_means):
        f = "{:+.1f}" if key == "slo_pp" else "{:.2f}"
        print(f"{shape:18} {arm:45} {key:12} n={n:<3} {f.format(m)} [{f.format(lo)}, {f.format(hi)}]")
    return 0


if __name__ == "__main__":
    from testbed.cli import guarded

    sys.exit(guarded(Path(__file__).name, main))
