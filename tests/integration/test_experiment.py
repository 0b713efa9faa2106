"""A real 2-arm x 2-seed micro-experiment (``prfaas experiment``): four short runs of the quick scenario
on real namespaces, then results.parquet and comparison.json checked against the runs' own files."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from experiments.experiment import run_experiment
from experiments.spec import load_spec

pytestmark = pytest.mark.timeout(400)

SPEC = {
    "name": "micro",
    "scenario": "quick",
    "set": {"duration": "6s", "wan.schedule": [], "workload.arrivals.rate": "2/s",
            "serving.instances.prfaas_prefill": 1, "serving.instances.pd_prefill": 1, "serving.instances.pd_decode": 1},
    "arms": {"prfaas": {"policy.name": "prfaas"}, "all-local": {"policy.name": "all-local"}},
    "seeds": [1, 2],
    "baseline": "all-local",
    "metrics": ["throughput_rps", "ttft_s.p50", "requests_failed"],
}


def test_two_arms_two_seeds_write_results_and_paired_comparisons(tmp_path: Path):
    spec_file = tmp_path / "micro.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    res = run_experiment(load_spec(spec_file), tmp_path / "out", progress=False)

    df = pd.read_parquet(res["results"])
    assert len(df) == 4 and (df["status"] == "ok").all(), df[["arm", "seed", "status", "error"]].to_string()
    assert sorted(zip(df["arm"], df["seed"])) == [("all-local", 1), ("all-local", 2), ("prfaas", 1), ("prfaas", 2)]
    assert (df.loc[df["arm"] == "all-local", "offload_fraction"] == 0).all()
    # paired: both arms of a seed were offered the same requests at the same times
    for seed in (1, 2):
        a, b = (pd.read_parquet(tmp_path / "out" / r / "requests.parquet").set_index("request_id")["scheduled_arrival_s"].sort_index()
                for r in df[df["seed"] == seed].sort_values("arm")["run_dir"])
        pd.testing.assert_series_equal(a, b)
    for row in df.itertuples():  # each row carries the run's own summary
        summary = json.loads((tmp_path / "out" / row.run_dir / "summary.json").read_text())
        assert row.throughput_rps == pytest.approx(summary["throughput_rps"]) and row.requests_total == summary["requests_total"]

    comp = {c["metric"]: c for c in json.loads(res["comparison"].read_text())}
    assert set(comp) == {"throughput_rps", "ttft_s.p50", "requests_failed"}
    for metric, c in comp.items():
        assert (c["arm_a"], c["arm_b"], c["n"]) == ("prfaas", "all-local", 2)
        a = df[df["arm"] == "prfaas"][metric].mean()
        b = df[df["arm"] == "all-local"][metric].mean()
        assert c["a"] == pytest.approx(a) and c["b"] == pytest.approx(b)
        if b:
            assert c["ratio"] == pytest.approx(a / b)
        # two pairs are too few for an interval (analysis.stats.MIN_PAIRS): it would be their range
        assert (c["ci_low"], c["ci_high"], c["significant"]) == (None, None, False)
        assert c["method"] == "too few pairs"  # named before a zero mean of B (requests_failed), which it also is
    text = res["report"].read_text()
    assert "prfaas vs all-local on throughput_rps: no interval (too few pairs, n = 2)" in text
