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
