"""experiments.ray_local: a node that gives up while starting is started again, and a probe that hangs or a
GCS that does not listen yet is waited out (unit: the ``ray start`` processes are stand-ins, and the readiness
probe counts the stand-ins still running instead of asking Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments import ray_local
from experiments.ray_local import LocalRayCluster, NodeStartFailed


class StandInCluster(LocalRayCluster):
    """Node processes are `python -c ...`; the starts numbered in `fail` (1 = the head) exit at once."""

    def __init__(self, workers: int, fail: set[int]) -> None:
        super().__init__(workers=workers)
        self.fail, self.started = fail, 0

    def _node_argv(self, head: bool) -> list[str]:
        self.started += 1
        code = "import sys; sys.exit(3)" if self.started in self.fail else "import time; time.sleep(60)"
        return [sys.executable, "-c", code]


def stand_in(monkeypatch: pytest.MonkeyPatch, c: StandInCluster) -> StandInCluster:
    real_popen = ray_local.subprocess.Popen

    def popen(argv: list[str], **kw: object) -> subprocess.Popen:
        p = real_popen(argv, **kw)
        if "sys.exit(3)" in argv[-1]:
            p.wait(10)  # its exit is visible before the first readiness check
        return p

    def probe(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(argv, 0, stdout=f"{sum(p.poll() is None for p in c.nodes)}\n", stderr="")

    monkeypatch.setattr(ray_local.subprocess, "Popen", popen)
    monkeypatch.setattr(ray_local.subprocess, "run", probe)
    monkeypatch.setattr(ray_local, "tcp_accepts", lambda host, port: True)  # the stand-in head's GCS listens
    return c


def test_a_node_that_exits_while_starting_is_started_again(monkeypatch: pytest.MonkeyPatch):
    c = stand_in(monkeypatch, StandInCluster(workers=2, fail={1, 3}))  # the head's and worker 1's first tries
    try:
        c.start()
        assert c.started == 5  # head twice, worker 1 twice, worker 2 once
        assert len(c.nodes) == 3 and all(p.poll() is None for p in c.nodes)
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.nodes)
    assert not Path(c.temp_dir).exists()


def test_a_node_that_fails_every_attempt_is_one_clear_error(monkeypatch: pytest.MonkeyPatch):
    c = stand_in(monkeypatch, StandInCluster(workers=1, fail={2, 3, 4}))
    try:
        with pytest.raises(NodeStartFailed, match=r"ray node 1 exited \(3\)"):
            c.start()
        assert c.started == 1 + ray_local.START_ATTEMPTS
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.nodes)


def test_a_node_that_was_up_and_then_exits_is_not_restarted(monkeypatch: pytest.MonkeyPatch):
    c = stand_in(monkeypatch, StandInCluster(workers=1, fail=set()))
    try:
        c.start()
        c.nodes[0].kill()
        c.nodes[0].wait(10)
        with pytest.raises(RuntimeError, match="ray node 0 exited") as e:
            c._wait_for_nodes(2)
        assert not isinstance(e.value, NodeStartFailed)
    finally:
        c.stop()


def test_a_hung_probe_is_not_yet_and_the_next_one_is_asked(monkeypatch: pytest.MonkeyPatch):
    """CI, 2026-12-07: one ``ray.init`` probe hung its whole 60 s timeout and its TimeoutExpired ended the
    start. A hung probe is now killed and counted as "not yet"."""
    c = stand_in(monkeypatch, StandInCluster(workers=1, fail=set()))
    counted = ray_local.subprocess.run
    calls: list[float] = []

    def hangs_once(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
        calls.append(float(kw["timeout"]))  # type: ignore[arg-type]
        if len(calls) == 1:
            raise subprocess.TimeoutExpired(argv, kw["timeout"])  # type: ignore[arg-type]
        return counted(argv, **kw)

    monkeypatch.setattr(ray_local.subprocess, "run", hangs_once)
    try:
        c.start()
        assert len(calls) == 3 and c.started == 2  # the head's hung probe, its good one, the worker's: nothing restarted
        assert all(0 < t <= ray_local.PROBE_TIMEOUT_S for t in calls)
    finally:
        c.stop()


def test_a_gcs_that_never_listens_restarts_the_head_then_names_its_log(monkeypatch: pytest.MonkeyPatch):
    c = stand_in(monkeypatch, StandInCluster(workers=1, fail=set()))
    probes: list[list[str]] = []
    monkeypatch.setattr(ray_local, "tcp_accepts", lambda host, port: False)
    monkeypatch.setattr(ray_local.subprocess, "run", lambda argv, **kw: probes.append(argv))
    monkeypatch.setattr(ray_local, "START_TIMEOUT_S", 1.2)
    try:
        with pytest.raises(NodeStartFailed, match=r"did not reach 1 nodes within 1.2 s \(the head's GCS at "
                           r"127\.0\.0\.1:\d+ did not accept a connection\); node 0's log"):
            c.start()
        assert probes == []  # no ray.init driver is started against a GCS that is not listening
        assert c.started == ray_local.START_ATTEMPTS  # each try with fresh ports
    finally:
        c.stop()
    assert all(p.poll() is not None for p in c.nodes)

