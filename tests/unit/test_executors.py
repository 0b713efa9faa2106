"""The scale-out executors behind the experiment engine's interface, without a network: choosing them,
refusing what the host cannot hold, tasks and outcomes as plain data, run directories packed and
unpacked, and local:N's child processes turning a bad task into a failed outcome (issue 14)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest

from experiments.executor import RunOutcome, RunTask, SequentialExecutor, make_executor
from experiments.parallel import ParallelExecutor, outcome_from_dict, outcome_to_dict, task_from_dict, task_to_dict
from testbed.errors import UserError


def test_executor_names_and_bad_arguments():
    assert isinstance(make_executor("local"), SequentialExecutor) and isinstance(make_executor("local:1"), SequentialExecutor)
    for bad in ("local:0", "local:x", "local:-2"):
        with pytest.raises(UserError, match="N must be a whole number >= 1"):
            make_executor(bad)
    with pytest.raises(UserError, match="unknown executor; allowed: local, local:N, ray, ray:ADDRESS"):
        make_executor("slurm")


def test_local_n_beyond_the_cores_is_refused_and_within_them_warns(capsys: pytest.CaptureFixture[str]):
    cpus = os.cpu_count() or 1
    with pytest.raises(UserError, match=f"local:{cpus + 1}: {cpus + 1} runs at once on {cpus} cores"):
        make_executor(f"local:{cpus + 1}")
    ex = make_executor(f"local:{max(2, cpus)}") if cpus >= 2 else None
    if ex is not None:
        assert isinstance(ex, ParallelExecutor) and ex.n == max(2, cpus)
        if cpus < 5:  # fewer than 5 cores: doctor suggests 1, so 2 or more at once is warned about
            assert "doctor` suggests local:1" in capsys.readouterr().err


def test_tasks_and_outcomes_travel_as_plain_data(tmp_path: Path):
    task = RunTask(key="a-s1", scenario="quick", overrides=("seed=1", "wan.rate=1Gbps"), out_dir=tmp_path / "a-s1")
    assert task_from_dict(task_to_dict(task)) == task
    o = RunOutcome(task=task, status="failed", error="why", wall_s=1.5, node="n/0123abcd")
    assert outcome_from_dict(outcome_to_dict(o)) == o


def test_a_run_directory_round_trips_as_files_and_a_hostile_archive_is_refused(tmp_path: Path):
    from experiments.ray_executor import pack_dir, unpack_dir

    src = tmp_path / "src"
    (src / "plots").mkdir(parents=True)
    (src / "summary.json").write_text('{"ok": 1}')
    (src / "plots" / "a.png").write_bytes(bytes(range(256)) * 10)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "stale.txt").write_text("from an interrupted try")
    unpack_dir(pack_dir(src), dest)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["plots", "plots/a.png", "summary.json"]
    assert (dest / "plots" / "a.png").read_bytes() == (src / "plots" / "a.png").read_bytes()

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        unpack_dir(buf.getvalue(), tmp_path / "d2")
    assert not (tmp_path / "escaped.txt").exists()


def test_local_n_runs_each_task_in_its_own_process_and_reports_failures_as_outcomes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)  # two child processes at once, whatever this host's cores
    ex = ParallelExecutor(2, warn=False)
    tasks = [RunTask(key=f"t{i}", scenario=f"no-such-scenario-{i}", overrides=(), out_dir=tmp_path / f"t{i}") for i in range(2)]
    got: list[RunOutcome] = []
    ex.run(tasks, got.append)
    assert sorted(o.task.key for o in got) == ["t0", "t1"]
    for o in got:
        assert o.status == "failed" and f"no-such-scenario-{o.task.key[1]}" in (o.error or "") and o.node


def test_the_experiment_report_names_runs_whose_timing_fidelity_was_flagged():
    from experiments.experiment import fidelity_lines, results_frame

    rows = [{"run_dir": "runs/a/seed1-rep1", "status": "ok", "node": "n1", "fidelity_ok": True, "fidelity_flags": ""},
            {"run_dir": "runs/a/seed2-rep1", "status": "ok", "node": "n2", "fidelity_ok": False,
             "fidelity_flags": "sleeps late by 7.0 ms at p99 (tolerance 5 ms)"},
            {"run_dir": "runs/b/seed1-rep1", "status": "failed", "node": "n1", "fidelity_ok": None, "fidelity_flags": None}]
    lines = fidelity_lines(results_frame(rows))
    assert "flagged for 1 run(s)" in lines[1]
    assert lines[2:] == ["- runs/a/seed2-rep1 (node n2): sleeps late by 7.0 ms at p99 (tolerance 5 ms)"]
    assert fidelity_lines(results_frame(rows[:1])) == [] and fidelity_lines(results_frame([{"status": "ok"}])) == []


class FakeChild:
    """Stands in for a run's child process (`subprocess.Popen`): it 'runs' for `run_s` unless signalled,
    and counts how many run at once."""

    lock = threading.Lock()
    active = 0
    most = 0
    signalled: list[str] = []
    run_s = {"short": 0.05, "long": 1.0}

    def __init__(self, argv, **kw) -> None:
        self.key = json.loads(argv[-2])["key"]
        self.ended = threading.Event()
        self.returncode = None
        with FakeChild.lock:
            FakeChild.active += 1
            FakeChild.most = max(FakeChild.most, FakeChild.active)

    def communicate(self):
        self.ended.wait(FakeChild.run_s[self.key.split("-")[0]])
        with FakeChild.lock:
            FakeChild.active -= 1
        self.returncode = 0
        self.ended.set()
        return "", None

    def poll(self):
        return self.returncode

    def send_signal(self, sig) -> None:
        FakeChild.signalled.append(self.key)
        self.ended.set()

    def wait(self, timeout=None):
        self.ended.wait(timeout)
        return 0


@pytest.fixture
def fake_children(monkeypatch: pytest.MonkeyPatch):
    FakeChild.active = FakeChild.most = 0
    FakeChild.signalled = []
    monkeypatch.setattr("experiments.parallel.subprocess.Popen", FakeChild)
    monkeypatch.setattr("os.cpu_count", lambda: 8)  # two runs at once, whatever this host's cores
    return ParallelExecutor(2, warn=False)


def _tasks(tmp_path: Path, kind: str, n: int) -> list[RunTask]:
    return [RunTask(key=f"{kind}-{i}", scenario="micro", overrides=(), out_dir=tmp_path / f"{kind}-{i}") for i in range(n)]


def test_callers_of_local_n_at_once_share_its_n_slots_and_each_stops_only_its_own_runs(fake_children, tmp_path: Path):
    ex, got = fake_children, []
    callers = [threading.Thread(target=ex.run, args=(_tasks(tmp_path, kind, 3), got.append)) for kind in ("short", "long")]
    for c in callers:
        c.start()
    for c in callers:
        c.join(30)
    assert sorted(o.task.key for o in got) == sorted(f"{k}-{i}" for k in ("short", "long") for i in range(3))
    assert FakeChild.most == 2  # two callers with two slots each never ran more than the executor's two
    assert FakeChild.signalled == []  # the caller that finished first did not stop the other's runs


def test_cancel_stops_the_runs_in_progress_and_starts_none(fake_children, tmp_path: Path):
    from experiments.parallel import CANCELLED

    ex, got = fake_children, []
    caller = threading.Thread(target=ex.run, args=(_tasks(tmp_path, "long", 4), got.append))
    caller.start()
    for _ in range(100):
        if FakeChild.active == 2:
            break
        threading.Event().wait(0.01)
    ex.cancel()
    caller.join(30)
    assert sorted(FakeChild.signalled) == ["long-0", "long-1"]
    assert len(got) == 4 and sum(o.error == CANCELLED for o in got) == 2 and all(o.status == "failed" for o in got)


def test_a_shared_progress_display_gets_a_row_per_batch_of_runs_and_loses_it_when_they_are_done(tmp_path: Path):
    from rich.progress import Progress

    from experiments.engine import run_tasks

    class Recording(SequentialExecutor):
        def run(self, tasks, on_done):
            rows.append([t.description for t in bar.tasks])
            for t in tasks:
                on_done(RunOutcome(task=t, status="ok", error=None, wall_s=0.0, node="here"))

    rows: list[list[str]] = []
    bar = Progress(disable=True)
    tasks = [RunTask(key=f"s{i}", scenario="micro", overrides=(), out_dir=tmp_path / f"s{i}") for i in range(2)]
    out = run_tasks(tasks, Recording(), label="prfaas_pd 2.8 req/s", progress=bar)
    assert rows == [["prfaas_pd 2.8 req/s"]] and sorted(out) == ["s0", "s1"]
    assert bar.tasks == []  # the row is gone: the next rate of the search gets its own


# --------------------------------------------------------------------- the hosts a run is checked against


class OnHosts(SequentialExecutor):
    """An executor whose runs may land on the given hosts (what `RayExecutor.run_hosts` answers)."""

    def __init__(self, hosts: list) -> None:
        self.hosts, self.asked = hosts, []

    def run_hosts(self, ccs):
        self.asked.append(ccs)
        return self.hosts


def test_each_run_is_checked_on_every_host_it_may_land_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from experiments import engine
    from experiments.engine import check_run
    from experiments.executor import RunHost
    from testbed.errors import FieldError
    from testbed.kv.transport import congestion_control_refused
    from testbed.net.emulation import host_capacity_bps

    here = SequentialExecutor().run_hosts(("cubic",))  # this host: its whole capacity, and its kernel asked
    assert here == [RunHost("this host", host_capacity_bps()[0], ())]
    assert SequentialExecutor().run_hosts(())[0].cc_refused == ()  # the hosts' defaults: nothing to ask
    refused = dict(SequentialExecutor().run_hosts(("cubic", "nosuchcc"))[0].cc_refused)  # only the refused one
    assert list(refused) == ["nosuchcc"] and refused["nosuchcc"] == congestion_control_refused("nosuchcc")
    assert "'nosuchcc' cannot be set on this host" in refused["nosuchcc"]
    assert ParallelExecutor(1, warn=False).run_hosts(())[0].capacity_bps == host_capacity_bps()[0]

    no_bbr = (("bbr", "'bbr' cannot be set on this host (no such)"),)
    a, b = RunHost("a/0000000a", 5e9, ()), RunHost("b/0000000b", 5e9, no_bbr)
    auto = ["scale=auto", "serving.kv_congestion_control=bbr"]
    ex = OnHosts([a, a])
    assert check_run("quick", auto, executor=ex).scale == "auto" and ex.asked == [("bbr",)]
    with pytest.raises(FieldError, match=r"quick\.yaml: serving\.kv_congestion_control: 'bbr' cannot be set on this host \(no such\) "
                                         r"\(on b/0000000b\)$"):
        check_run("quick", auto, executor=OnHosts([a, b]))
    # quick's 5 Gbps WAN: scale 1 at 5 Gbps, 10 at 500 Mbps -- the runs would not be comparable
    slow = RunHost("c/0000000c", 5e8, ())
    with pytest.raises(FieldError, match=r"quick\.yaml: scale: 'auto' resolves differently on the hosts the runs may land on "
                                         r"\(a/0000000a: 5 Gbps, scale 1, c/0000000c: 500 Mbps, scale 10\)"):
        check_run("quick", ["scale=auto"], executor=OnHosts([a, slow]))
    assert check_run("quick", ["scale=10"], executor=OnHosts([a, slow])).scale == 10  # a number is the same everywhere
    with pytest.raises(FieldError, match=r"\(on d/0000000d\)$"):  # a host so small that a wire rate falls below 8 Kbps
        check_run("quick", ["scale=auto"], executor=OnHosts([a, RunHost("d/0000000d", 1.0, ())]))
    with pytest.raises(FieldError, match=r"quick\.yaml: serving\.kv_congestion_control: 'bbr' cannot be set on this host \(no such\)$"):
        check_run("quick", auto, executor=OnHosts([RunHost("this host", 5e9, b.cc_refused)]))  # alone: no "(on ...)"
    # a run finished in out_dir is checked as a file only: no host is asked
    monkeypatch.setattr("experiments.engine.run_state", lambda out: engine.FINISHED if out == tmp_path else engine.TO_RUN)
    ex = OnHosts([b])
    assert check_run("quick", auto, tmp_path, executor=ex).scale == "auto" and ex.asked == []
    with pytest.raises(FieldError, match="on b/0000000b"):
        check_run("quick", auto, tmp_path / "not-run", executor=ex)


def test_a_cross_traffic_flow_congestion_control_a_host_refuses_is_refused_naming_the_flow_and_the_host():
    """Until 2026-12-07 `check_run` asked each host for the KV's congestion control only: a TCP cross-traffic flow's
    (iperf3 -C) that a node lacked passed, and every period's iperf3 there exited at once, the run going on without
    the flow. Each name is asked once; a scenario naming only a flow's, at a numeric scale, still asks the hosts."""
    from experiments.engine import check_run
    from experiments.executor import RunHost
    from testbed.errors import FieldError

    flows = ["topology.prfaas.cross=1", "topology.pd.cross=1",
             "cross_traffic={flows: [{name: a, protocol: tcp, direction: prfaas_to_pd, congestion: cubic}, "
             "{name: b, protocol: tcp, direction: prfaas_to_pd, congestion: bbr}]}"]
    no_bbr = RunHost("b/0000000b", 5e9, (("bbr", "'bbr' cannot be set on this host (no such)"),))
    ex = OnHosts([RunHost("a/0000000a", 5e9, ()), no_bbr])
    with pytest.raises(FieldError, match=r"quick\.yaml: cross_traffic\.flows\[1\]\.congestion: 'bbr' cannot be set on this "
                                         r"host \(no such\) \(on b/0000000b\)$"):
        check_run("quick", flows, executor=ex)
    assert ex.asked == [("cubic", "bbr")]  # scale 10: only the flows' names made it ask
    ex = OnHosts([no_bbr])  # the KV's bbr too: its field is named first, and bbr asked once
    with pytest.raises(FieldError, match=r"serving\.kv_congestion_control: 'bbr' cannot"):
        check_run("quick", [*flows, "serving.kv_congestion_control=bbr"], executor=ex)
    assert ex.asked == [("bbr", "cubic")]


def test_ray_asks_each_live_node_that_takes_runs_once_and_names_one_that_does_not_answer(monkeypatch: pytest.MonkeyPatch):
    """`RayExecutor.run_hosts` on a stand-in `ray` module (the real cluster: tests/integration/test_scale_out.py):
    one task per live node with the run resource, pinned to it (not soft), asking no CPU; answers kept per
    congestion control; a node that does not answer in time is named, and its task cancelled."""
    import sys
    import types

    from experiments import ray_executor
    from experiments.executor import RunHost
    from experiments.ray_executor import NODE_RESOURCE, RayExecutor

    ray, util, strategies = (types.ModuleType(n) for n in ("ray", "ray.util", "ray.util.scheduling_strategies"))

    class Pinned:
        def __init__(self, node_id: str, soft: bool) -> None:
            self.node_id, self.soft = node_id, soft

    class Ref:
        def __init__(self, node_id: str, ccs) -> None:
            self.node_id, self.ccs = node_id, ccs

    asked: list[tuple] = []
    cancelled: list[str] = []
    late: set[str] = set()

    class Remote:
        def __init__(self, fn, opts: dict) -> None:
            self.fn, self.opts = fn, opts

        def options(self, scheduling_strategy: Pinned) -> "Remote":
            return Remote(self.fn, {**self.opts, "pinned": scheduling_strategy})

        def remote(self, ccs) -> Ref:
            p = self.opts["pinned"]
            asked.append((self.fn.__name__, p.node_id, p.soft, self.opts["num_cpus"], ccs))
            return Ref(p.node_id, ccs)

    def get(ref: Ref) -> dict:
        return {"name": f"h/{ref.node_id[:8]}", "capacity_bps": 5e9 if ref.node_id != "n3" * 8 else 2e9,
                "cc_refused": tuple((cc, f"'{cc}' cannot be set") for cc in ref.ccs if cc == "bbr" and ref.node_id == "n3" * 8)}

    strategies.NodeAffinitySchedulingStrategy = Pinned
    ray.util = util
    util.scheduling_strategies = strategies
    ray.is_initialized, ray.init = (lambda: True), (lambda **kw: None)
    ray.cluster_resources = lambda: {NODE_RESOURCE: 3}
    ray.nodes = lambda: [{"NodeID": "n1" * 8, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {NODE_RESOURCE: 2}},
                         {"NodeID": "n2" * 8, "Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {NODE_RESOURCE: 1}},
                         {"NodeID": "n3" * 8, "Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {NODE_RESOURCE: 1}},
                         {"NodeID": "n4" * 8, "Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 8}}]
    ray.remote = lambda **opts: (lambda fn: Remote(fn, opts))
    ray.wait = lambda refs, num_returns, timeout: ([r for r in refs if r.node_id not in late], [r for r in refs if r.node_id in late])
    ray.get = get
    ray.cancel = lambda ref: cancelled.append(ref.node_id)
    for name, mod in (("ray", ray), ("ray.util", util), ("ray.util.scheduling_strategies", strategies)):
        monkeypatch.setitem(sys.modules, name, mod)

    ex = RayExecutor("auto", progress=False)
    hosts = ex.run_hosts(("cubic", "bbr"))
    assert hosts == [RunHost("h/n1n1n1n1", 5e9, ()), RunHost("h/n3n3n3n3", 2e9, (("bbr", "'bbr' cannot be set"),))]
    assert asked == [("host_facts", "n1" * 8, False, 0, ("cubic", "bbr")), ("host_facts", "n3" * 8, False, 0, ("cubic", "bbr"))]
    assert ex.run_hosts(("cubic", "bbr")) == hosts and len(asked) == 2  # asked once
    assert ex.run_hosts(("cubic",))[1].cc_refused == () and len(asked) == 4  # other congestion controls: asked again
    late.add("n3" * 8)
    with pytest.raises(UserError, match=r"^--executor ray: node\(s\) 10\.0\.0\.3/n3n3n3n3 did not answer within 60 s what a run "
                                        r"there would resolve `scale: auto` at"):
        ex.run_hosts(("reno",))
    assert cancelled == ["n3" * 8]
    monkeypatch.setattr(ray, "nodes", lambda: [])
    with pytest.raises(UserError, match="no live node of the cluster offers the resource 'prfaas_node'"):
        RayExecutor("auto", progress=False).run_hosts(())
    assert ray_executor.HOST_FACTS_TIMEOUT_S == 60
