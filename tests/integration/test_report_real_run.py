"""A report from a real short run: the `quick` scenario on real namespaces (profile compute), then analysis.

Root is needed (tests/integration is marked ``root`` by conftest); `run_once` brings the network up
and always tears it down itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis import plots
from analysis.report import predict, write_report
from analysis.rundir import load_run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from experiments.runs import run_once
    from testbed.sections import load_scenario

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path_factory.mktemp("quick") / "run"
    run_once(load_scenario("quick"), out, progress=False)
    return out


def test_real_run_summary_matches_figures_computed_by_hand_from_its_files(quick_run):
    run = load_run(quick_run)
    req = pd.read_parquet(quick_run / "requests.parquet")  # read here, not through load_run or summarize
    ok = req[req["status"] == "ok"]
    ttft = (ok["first_token_s"] - ok["arrival_s"]).to_numpy(float)
    scale = yaml.safe_load((quick_run / "scenario.yaml").read_text())["scale"]
    span_s = req["finish_s"].max() - req["arrival_s"].min()
    kv_bits = req.loc[req["route"].astype(str).str.startswith("prfaas"), "kv_bytes"].fillna(0).sum() * 8 * scale
    why = {k: run.summary.get(k) for k in ("failure_reasons", "run_error")}  # what a failed run said about itself
    for figures in (run.summary, run.metrics):  # written by the run, and recomputed by the loader
        assert figures["requests_total"] == len(req) > 0 and figures["requests_ok"] == len(ok) > 0, why
        assert figures["ttft_s"]["mean"] == pytest.approx(ttft.mean())
        assert figures["ttft_s"]["p90"] == pytest.approx(np.percentile(ttft, 90))
        assert figures["egress_gbps"]["mean"] == pytest.approx(kv_bits / span_s / 1e9)
    off = run.requests[run.requests["route"].astype(str).str.startswith("prfaas") & (run.requests["status"] == "ok")]
    assert (off["kv_bytes"] > 0).all()
    assert len(run.link) > 0 and "tx_bytes" in run.link


def test_report_of_a_real_run_embeds_labelled_plots_and_the_model_prediction(quick_run, tmp_path):
    path = write_report([quick_run], tmp_path)
    text = path.read_text()
    assert all(s.startswith("data:image/png;base64,") for s in re.findall(r'src="([^"]+)"', text))
    assert "No model prediction" not in text
    run = load_run(quick_run)
    assert "lambda_max" in predict(run)
    for fig in (plots.congestion_response(run), plots.latency_cdfs([run])):
        assert plots.missing_units(fig) == []
