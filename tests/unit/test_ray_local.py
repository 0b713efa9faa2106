"""experiments.ray_local: a node that gives up while starting is started again (unit: the ``ray start``
processes are stand-ins, and the readiness probe counts the stand-ins still running instead of asking Ray)."""

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
