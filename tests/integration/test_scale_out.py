"""Scale out for real (issue 14): two isolated runs at once on this host with their fidelity records
(`--executor local:2`), and a real local Ray cluster of two nodes -- started by the test, always
stopped -- running a 2-run experiment, then losing its worker node mid-run: the lost run is retried on
the head node, nothing is lost or duplicated, and `prfaas clean` leaves nothing behind.

Runs are micro runs (6 s of traffic at 1 req/s, one instance per role) so that the file stays near
three minutes on a 2-core host; Ray comes from the project's `ray` extra, which the test setup
installs (scripts/bootstrap.sh test)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from experiments.executor import RunOutcome, RunTask
from testbed.net import state
from testbed.scenario import builtin_scenarios_dir
from tests.integration.test_run_e2e import processes_mentioning

pytestmark = pytest.mark.timeout(400)

MICRO = {
    "duration": "6s", "policy": {"name": "fixed-threshold", "threshold": "4K"},
    "wan": {"rate": "5Gbps", "delay": "5ms", "queue": "1bdp",
            "schedule": [{"at": "2s", "rate": "2Gbps", "for": "2s", "direction": "prfaas_to_pd"}]},
    "workload": {"output": 16, "arrivals": {"process": "poisson", "rate": "1/s"}},
}


def micro_scenario(tmp: Path) -> str:
    data = yaml.safe_load((builtin_scenarios_dir() / "quick.yaml").read_text())
    for key, value in MICRO.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    data["name"] = "micro"
    data["serving"]["instances"] = {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1}
    path = tmp / "micro.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def tasks_for(tmp: Path, seeds: list[int]) -> list[RunTask]:
    sc = micro_scenario(tmp)
    return [RunTask(key=f"s{s}", scenario=sc, overrides=(f"seed={s}",), out_dir=tmp / "runs" / f"s{s}") for s in seeds]


def our_bridges() -> list[str]:
    from testbed.net.cleanup import _our_bridges

    return _our_bridges()


def assert_complete_run(task: RunTask, outcome: RunOutcome) -> dict[str, Any]:
    import pandas as pd

    assert outcome.status == "ok", outcome.error
    summary = json.loads((task.out_dir / "summary.json").read_text())
    df = pd.read_parquet(task.out_dir / "requests.parquet")
    assert len(df) >= 2 and (df["status"] == "ok").all(), df[["request_id", "status", "reason"]].to_string()
    assert summary["requests_failed"] == 0
    fid = json.loads((task.out_dir / "fidelity.json").read_text())
    # every figure measured, the verdict consistent with the tolerances, and carried into the summary
    assert fid["wan"]["ping_replies"] == 20 and 0.008 < fid["wan"]["rtt_p50_s"] < 0.05 and fid["wan"]["configured_rtt_s"] == 0.010
    assert 0.3 < fid["wan"]["rate_ratio"] <= 1.0
    assert fid["sleep"]["samples"] > 100 and fid["sleep"]["late_p99_s"] >= 0
    assert fid["schedule"]["errors"] == [] and fid["cross"] == {"errors": [], "notes": []}  # both reach the record (none here)
    assert fid["schedule"]["fired"] == 2 and 0 < fid["cpu"]["window_s"] and set(fid["cpu"]["delayline_cores"]) == {"prfaas_to_pd", "pd_to_prfaas"}
    assert fid["ok"] == (not fid["flags"]) and summary["fidelity_ok"] == fid["ok"] and summary["node"] == fid["node"]
    assert summary["fidelity_sleep_late_p99_s"] == fid["sleep"]["late_p99_s"]
    # profile-mode compute timed by the workers' own paced sleeps: every prefill, and every stream of two tokens or more
    assert fid["compute"]["prefill"]["n"] == len(df) and df["prefill_late_s"].notna().all() and (df["prefill_late_s"] >= 0).all()
    assert fid["compute"]["decode"]["n"] == int((df["output_len"] > 1).sum()) and (df["decode_late_s"] >= 0).all()
    assert summary["fidelity_prefill_late_ratio_p90"] == fid["compute"]["prefill"]["late_ratio_p90"]
    # the router's control loop timed by itself: a tick per signals row of the scheduler log
    sched = pd.read_parquet(task.out_dir / "scheduler.parquet")
    assert fid["router"]["ticks"] == int((sched["kind"] == "signals").sum()) > 0 and fid["router"]["tick_late_max_s"] >= 0
    assert summary["fidelity_router_tick_late_p99_s"] == fid["router"]["tick_late_p99_s"]
    # the client's sending against the schedule (open loop: every request) and the router's intake of each
    assert fid["client"]["sent"] == len(df) == fid["client"]["taken_in"] and (df["client_send_late_s"] >= 0).all()
    assert (df["arrival_s"] >= df["client_arrival_s"]).all() and fid["client"]["intake_late_max_s"] >= fid["client"]["intake_late_p99_s"] >= 0
    assert summary["fidelity_intake_late_p99_s"] == fid["client"]["intake_late_p99_s"]
    assert summary["fidelity_client_send_late_p99_s"] == fid["client"]["send_late_p99_s"]
    return fid


@pytest.fixture
def leftovers_checked(tmp_path: Path):
    """Afterwards: no network state of ours, no bridge, no process of these runs."""
    yield tmp_path
    assert not state.list_states(), [p.name for p, _ in state.list_states()]
    assert not our_bridges()
    assert not processes_mentioning(str(tmp_path))


def test_two_isolated_runs_at_once_each_with_its_fidelity_record(leftovers_checked: Path):
    from experiments.parallel import ParallelExecutor
    from testbed.net.emulation import host_capacity_bps

    tmp = leftovers_checked
    tasks = tasks_for(tmp, [1, 2])
    seen: dict[str, dict] = {}
    stop = threading.Event()

    def watch() -> None:  # the two networks as they run side by side
        while not stop.is_set():
            for _, d in state.live_states():
                seen.setdefault(str(d.get("tag")), d)
            time.sleep(0.2)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    ex = ParallelExecutor(2, warn=False)
    outcomes: list[RunOutcome] = []
    try:
        ex.run(tasks, outcomes.append)
    finally:
        stop.set()
        w.join(5)
    by_key = {o.task.key: o for o in outcomes}
    assert sorted(by_key) == ["s1", "s2"]
    fids = [assert_complete_run(t, by_key[t.key]) for t in tasks]
    # they did run at once, on two networks with their own tags, bridges and run ids
    assert len(seen) == 2, seen
    runs = {d["run_id"]: d for d in seen.values()}
    assert set(runs) == {"s1", "s2"}
    assert not set(runs["s1"]["bridges"]) & set(runs["s2"]["bridges"])
    for t in tasks:
        env = json.loads((t.out_dir / "environment.json").read_text())
        assert env["run_id"] == t.key
        # the host's capacity is shared: each of the two runs got half of it
        assert env["calibration"]["capacity_bps"] == pytest.approx(host_capacity_bps()[0] / 2)
    assert all(f["node"] for f in fids)


@pytest.fixture(scope="module")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        # not a host capability, so not a skip: the test setup installs it
        pytest.fail(
            "ray: the Ray tests need the project's `ray` extra, which the test setup installs: "
            "`bash scripts/bootstrap.sh test` (or `pip install -e '.[test,ray]'`)",
            pytrace=False,
        )
    import tempfile

    from experiments.ray_local import LocalRayCluster

    scratch = set(Path(tempfile.gettempdir()).glob("prfaas-ray-*"))
    cluster = LocalRayCluster(workers=1)
    try:
        cluster.start()
        yield cluster
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        assert not processes_mentioning(str(cluster.temp_dir)), "Ray processes left behind"
        # the killed node's run could not remove its scratch directory; it lay in the cluster's, removed with it
        assert set(Path(tempfile.gettempdir()).glob("prfaas-ray-*")) == scratch, "Ray run directories left in the temp dir"


def test_a_two_run_experiment_on_a_real_two_node_ray_cluster(ray_cluster: Any, leftovers_checked: Path):
    from experiments.engine import run_tasks
    from experiments.ray_executor import RayExecutor

    tasks = tasks_for(leftovers_checked, [1, 2])
    ex = RayExecutor(ray_cluster.address, progress=False)
    assert ex.slots == 2  # one run at a time on each of the two nodes: a capacity search may ask for two at once
    outcomes = run_tasks(tasks, ex, progress=False)
    assert sorted(outcomes) == ["s1", "s2"]
    for t in tasks:
        fid = assert_complete_run(t, outcomes[t.key])
        assert fid["node"] == outcomes[t.key].node  # the node's name and calibration travel with the run
    assert len({o.node for o in outcomes.values()}) == 2  # one run on each node, at once
    # each node asked what a run there is checked against: its capacity (scale: auto) and its kernel
    from experiments.engine import check_run
    from testbed.net.emulation import host_capacity_bps

    hosts = ex.run_hosts(("cubic",))
    assert {h.name for h in hosts} == {o.node for o in outcomes.values()}
    assert [h.capacity_bps for h in hosts] == [host_capacity_bps()[0]] * 2 and [h.cc_refused for h in hosts] == [(), ()]
    assert all("'nosuchcc' cannot be set on this host" in dict(h.cc_refused)["nosuchcc"] for h in ex.run_hosts(("cubic", "nosuchcc")))
    assert check_run(tasks[0].scenario, ["scale=auto"], executor=ex).scale == "auto"


def test_a_run_on_a_lost_node_is_retried_and_nothing_is_lost_duplicated_or_left(ray_cluster: Any, leftovers_checked: Path):
    from experiments.ray_executor import RayExecutor
    from experiments.ray_local import kill_node_when_running
    from testbed.net import cleanup

    tasks = tasks_for(leftovers_checked, [3, 4])
    outcomes: list[RunOutcome] = []
    ex = RayExecutor(ray_cluster.address, progress=False)
    t = threading.Thread(target=ex.run, args=(tasks, outcomes.append), daemon=True)
    t.start()
    killed = kill_node_when_running(ray_cluster, 1)
    assert killed is not None, "no run started on the worker node"
    t.join(300)
    assert not t.is_alive()
    by_key = {}
    for o in outcomes:
        assert o.task.key not in by_key, f"{o.task.key} reported twice"
        by_key[o.task.key] = o
    assert sorted(by_key) == ["s3", "s4"]
    for task in tasks:
        assert_complete_run(task, by_key[task.key])
    assert len({o.node for o in outcomes}) == 1  # both finished on the head node, one of them retried there
    assert not state.owner_alive(killed)
    # the dead node's run left its network behind (its state file and root-namespace bridges; its host
    # processes die with the owner's terminals); `prfaas clean` removes it, and the fixture checks nothing is left
    rep = cleanup.clean()
    assert rep.networks == [f"net-{killed['owner_pid']}-{killed['tag']}.json"] and set(killed["bridges"]) <= set(rep.bridges)
    assert not subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip()
