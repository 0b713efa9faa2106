"""Labs 1 and 2 done for real, as a student would (short variants): `prfaas lab start`, the handout's
commands, answers derived here from the run folders, `prfaas lab check` -> every answer holds; one wrong
answer -> exit 1 naming it. Full variants: the handouts (labs/lab1-*/handout.md, labs/lab2-*/handout.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from testbed.net import state

ENV = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")


def sh(cmd: list[str], cwd: Path, timeout: float = 240, extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**ENV, **(extra or {})})


def prfaas(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "testbed.cli", *args], cwd, timeout)


@pytest.fixture
def no_network_left():
    before = {p.name for p, _ in state.list_states()}
    try:
        yield
    finally:
        for p, d in state.list_states():
            if p.name not in before:  # a network this test started and a failure left up
                subprocess.run([sys.executable, "-m", "testbed.cli", "net", "down", "--id", str(d["tag"])], capture_output=True, timeout=120)


def _median_ping_ms(path: Path) -> float:
    return float(np.median([float(x) for x in re.findall(r"time=([0-9.]+) ms", path.read_text())]))


def _check(lab: int, answers: dict, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / f"lab{lab}" / "answers.yaml").write_text(yaml.safe_dump(answers))
    return prfaas("lab", "check", str(lab), cwd=cwd)


def test_lab1_queues_checked_against_the_students_own_measurements(tmp_path: Path, no_network_left: None) -> None:
    assert prfaas("lab", "start", "1", cwd=tmp_path).returncode == 0
    lab = tmp_path / "lab1"
    for queue, name in (("0.25bdp", "q0.25"), ("4bdp", "q4")):
        r = sh(["bash", "measure.sh", queue, f"runs/{name}"], lab, extra={"LAB1_SECONDS": "5"})
        assert r.returncode == 0, r.stdout + r.stderr
    answers: dict = {"runs": {}}
    for name in ("q0.25", "q4"):
        d = lab / "runs" / name
        plan = json.loads((d / "check.json").read_text())["directions"][0]
        rate = 100e6  # wan.yaml: 100 Mbit/s at scale 1, RTT 2 x 20 ms
        assert plan["wire_rate_bps"] == rate and plan["rtt_s"] == pytest.approx(0.040)
        answers["bdp_bytes"] = rate / 8 * 0.040
        drain_ms = plan["queue_wire_bytes"] * 8 / rate * 1e3
        idle, loaded = _median_ping_ms(d / "ping-idle.txt"), _median_ping_ms(d / "ping-loaded.txt")
        goodput = json.loads((d / "iperf3.json").read_text())["end"]["sum_received"]["bits_per_second"] / 1e6
        answers["runs"][name] = {"queue_delay_ms": drain_ms, "goodput_mbps": goodput, "rtt_idle_ms": idle,
                                 "rtt_loaded_ms": loaded, "queue_fill": (loaded - idle) / drain_ms}
        assert 38 < idle < 45  # the configured 40 ms RTT
        assert 10 < goodput < 100  # one TCP flow on a 100 Mbit/s link
    runs = answers["runs"]
    assert runs["q4"]["rtt_loaded_ms"] > runs["q0.25"]["rtt_loaded_ms"]  # bufferbloat: the bigger queue holds packets longer
    top = max(r["goodput_mbps"] for r in runs.values())
    answers["best_queue"] = min((n for n in runs if runs[n]["goodput_mbps"] >= 0.9 * top), key=lambda n: runs[n]["rtt_loaded_ms"])
    r = _check(1, answers, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lab 1: 12 of 12 answers hold" in r.stdout
    answers["runs"]["q4"]["rtt_loaded_ms"] = runs["q4"]["rtt_loaded_ms"] * 2 + 10
    r = _check(1, answers, tmp_path)
    assert r.returncode == 1 and "wrong: runs.q4.rtt_loaded_ms" in r.stdout, r.stdout


def test_lab2_wall_checked_against_the_students_own_runs(tmp_path: Path, no_network_left: None) -> None:
    assert prfaas("lab", "start", "2", cwd=tmp_path).returncode == 0
    lab = tmp_path / "lab2"
    answers: dict = {"runs": {}}
    for name in ("hybrid", "dense"):
        r = prfaas("run", f"{name}.yaml", "--set", "duration=8s", "--set", "serving.timeouts.drain=15s", "--out", f"runs/{name}", cwd=lab)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        d = lab / "runs" / name
        df = pd.read_parquet(d / "requests.parquet")
        summary = json.loads((d / "summary.json").read_text())
        scale = summary["scale"]
        off = df[df["route"].astype(str).str.startswith("prfaas") & (df["status"] == "ok")]
        assert len(off) >= 2, f"{name}: too few offloaded requests"
        phi = off["kv_bytes"].astype(float) * scale * 8 / (off["prefill_end_s"] - off["prefill_start_s"])
        answers["runs"][name] = {"kv_mb_per_request": float(off["kv_bytes"].astype(float).mean()) * scale / 1e6,
                                 "phi_kv_gbps": float(np.median(phi)) / 1e9, "egress_gbps": summary["egress_gbps"]["mean"],
                                 "wan_utilisation": summary["egress_gbps"]["mean"] / 10.0,
                                 "kv_wait_p90_s": float(np.percentile(off["transfer_end_s"] - off["prefill_end_s"], 90))}
    runs = answers["runs"]
    assert runs["dense"]["kv_mb_per_request"] > 3 * runs["hybrid"]["kv_mb_per_request"]  # the wall's cause
    answers["hits_the_wall"] = max(runs, key=lambda n: runs[n]["wan_utilisation"])
    r = _check(2, answers, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    answers["runs"]["hybrid"]["phi_kv_gbps"] *= 3
    r = _check(2, answers, tmp_path)
    assert r.returncode == 1 and "wrong: runs.hybrid.phi_kv_gbps" in r.stdout, r.stdout
