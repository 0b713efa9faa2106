"""A report from a real short run: the `quick` scenario on real namespaces (profile compute), then analysis.

Root is needed (tests/integration is marked ``root`` by conftest); `run_scenario` brings the network up
and always tears it down itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from analysis import plots
from analysis.report import predict, write_report
from analysis.rundir import load_run


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testbed.run import run_scenario
    from testbed.sections import load_scenario

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp_path_factory.mktemp("quick") / "run"
    run_scenario(load_scenario("quick"), out, progress=False)
    return out


def test_real_run_directory_loads_and_its_summary_is_what_metrics_computes(quick_run):
    run = load_run(quick_run)
    assert run.metrics["requests_total"] == run.summary["requests_total"] > 0
    assert run.metrics["ttft_s"] == pytest.approx(run.summary["ttft_s"])
    assert run.metrics["requests_ok"] > 0
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
