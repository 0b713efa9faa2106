"""A real Ray cluster of several nodes on this one host, for tests, benchmarks and trying `--executor ray`
without a lab: a head node and worker nodes, each a ``ray start --block`` process in its own session
(so one node can be killed alone, as a machine dies), each offering `NODE_RESOURCE`. On real machines
use ``ray start`` itself (docs/scale-out.md).

Every node gets its own ports (Ray's per-node agents default to fixed ports, which two nodes on one
host would fight over) and all of them share a private ``--temp-dir``, so nothing touches a Ray
session the user may have in /tmp/ray. `LocalRayCluster.stop()` always ends every node it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.ray_executor import NODE_RESOURCE, tcp_accepts

START_TIMEOUT_S = 120.0
# A node being started may give up on its own: on a loaded 2-core host a worker node's raylet once
# "timed out during startup" because the head's GCS answered late (CI, 2026-12-02; the same test passed
# at once when run again). The node just started is then started again, with fresh ports, up to this
# many times in all; a node that was already up and then exits is an error at once.
START_ATTEMPTS = 3
PROBE_TIMEOUT_S = 30.0


class NodeStartFailed(RuntimeError):
    """The node being started exited before it joined the cluster."""


def free_port() -> int:
    """A TCP port free on every address: Ray's GCS and raylets bind all of them, so a port free only on
    127.0.0.1 (another process may hold it on the host's own address) can fail the node that takes it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class LocalRayCluster:
    """``with LocalRayCluster(workers=1) as c: RayExecutor(c.address)...; c.kill_node(1)``."""

    def __init__(self, workers: int = 1, runs_per_node: int = 1, object_store_bytes: int = 100 * 2**20) -> None:
        self.workers, self.runs_per_node, self.object_store_bytes = workers, runs_per_node, object_store_bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="prfaas-ray-"))
        self.nodes: list[subprocess.Popen] = []
        self.gcs_port = 0
        self.address = ""  # the head's 127.0.0.1:`gcs_port`, once started

    def __enter__(self) -> "LocalRayCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _ray(self) -> str:
        return str(Path(sys.executable).with_name("ray"))

    def _node_argv(self, head: bool) -> list[str]:
        argv = [self._ray(), "start", "--block", "--disable-usage-stats", "--num-cpus", "1",
                "--resources", f'{{"{NODE_RESOURCE}": {self.runs_per_node}}}',
                "--object-store-memory", str(self.object_store_bytes),
                "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                "--node-ip-address", "127.0.0.1"]
        if head:
            return argv + ["--head", "--port", str(self.gcs_port), "--include-dashboard", "false",
                           "--temp-dir", str(self.temp_dir)]
        return argv + ["--address", self.address]

    def _env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[1])
        from experiments.ray_executor import SCRATCH_ENV

        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
                "RAY_USAGE_STATS_ENABLED": "0", SCRATCH_ENV: str(self.temp_dir)}  # a killed node's runs are removed with it

    def start(self) -> "LocalRayCluster":
        for i in range(1 + self.workers):
            for attempt in range(1, START_ATTEMPTS + 1):
                if i == 0:
                    self.gcs_port = free_port()
                    self.address = f"127.0.0.1:{self.gcs_port}"
                log = open(self.temp_dir / f"node{i}.log", "w")
                node = subprocess.Popen(self._node_argv(head=i == 0), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True, env=self._env())
                log.close()
                self.nodes.append(node)
                try:
                    self._wait_for_nodes(i + 1)
                    break
                except NodeStartFailed:
                    if attempt == START_ATTEMPTS:
                        raise
                    self.kill_node(i)  # and start it again, with fresh ports
                    self.nodes.pop()
        return self

    def _wait_for_nodes(self, n: int) -> None:
        """Until `n` nodes are alive in the cluster. A probe is a fresh ``ray.init`` driver, which waits
        minutes on a GCS that is not listening (it retries in 30 s rounds), so the GCS port must accept a TCP
        connection first, and a probe that still hangs is killed after `PROBE_TIMEOUT_S` and counted as "not
        yet"; the nodes are checked between probes, so a node that gave up is seen within seconds
        (CI, 2026-12-07: one 60 s probe that hung ended the whole start, with no node named)."""
        probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
                 "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + START_TIMEOUT_S
        last = "no probe finished"
        while time.monotonic() < deadline:
            for i, p in enumerate(self.nodes):
                if p.poll() is not None:
                    err = NodeStartFailed if i == n - 1 else RuntimeError
                    raise err(f"ray node {i} exited ({p.returncode}): {self.node_log(i)}")
            if not tcp_accepts("127.0.0.1", self.gcs_port):
                last = f"the head's GCS at {self.address} did not accept a connection"
                time.sleep(0.5)
                continue
            timeout_s = max(1.0, min(PROBE_TIMEOUT_S, deadline - time.monotonic()))
            try:
                r = subprocess.run([sys.executable, "-c", probe, self.address], capture_output=True, text=True,
                                   env=self._env(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                last = f"a probe of {self.address} hung for {timeout_s:.0f} s"
                continue
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            last = f"probe: {(r.stdout.strip().splitlines() or ['?'])[-1]} node(s) alive" if r.returncode == 0 else \
                f"probe exited {r.returncode}: {' | '.join(r.stderr.strip().splitlines()[-2:])}"
            time.sleep(1.0)
        raise NodeStartFailed(f"the local Ray cluster did not reach {n} nodes within {START_TIMEOUT_S:g} s "
                              f"({last}); node {n - 1}'s log: {self.node_log(n - 1)}")

    def node_log(self, i: int) -> str:
        try:
            return " | ".join((self.temp_dir / f"node{i}.log").read_text().strip().splitlines()[-3:])
        except OSError:
            return ""

    def kill_node(self, i: int) -> None:
        """SIGKILL node `i` and every process of its session (raylet, its workers): as if the machine died."""
        p = self.nodes[i]
        for pid in _session_pids(p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(30)

    def stop(self) -> None:
        """End every node (worker nodes first) and remove the temp dir; safe to call twice."""
        for i in reversed(range(len(self.nodes))):
            if self.nodes[i].poll() is None:
                self.nodes[i].send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes
                try:
                    self.nodes[i].wait(30)
                except subprocess.TimeoutExpired:
                    pass
            self.kill_node(i)  # whatever is left in its session
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (field 6 of /proc/PID/stat)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields: Any = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def kill_node_when_running(cluster: LocalRayCluster, node: int, timeout_s: float = 150.0) -> dict[str, Any] | None:
    """Wait until a run's network owned by a process of node `node` is up, then kill that node; returns
    the network's state record (None if no run started there in time: nothing is killed)."""
    from testbed.net import state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = set(_session_pids(cluster.nodes[node].pid))
        for _, d in state.live_states():
            if d.get("ready") and int(d["owner_pid"]) in pids:
                cluster.kill_node(node)
                return d
        time.sleep(0.2)
    return None
