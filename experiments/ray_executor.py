"""``--executor ray`` / ``ray:ADDRESS``: each run is a Ray task on a node of a Ray cluster.

Nodes that can run the testbed (root, the project installed at the same path, `prfaas doctor` ready)
are marked by the custom resource `NODE_RESOURCE` (``ray start ... --resources '{"prfaas_node": 1}'``);
its amount is how many runs the node takes at once (`prfaas doctor`'s suggestion). Each task asks for
one unit and no CPU, so Ray never packs more runs on a node than it was declared to hold.

A task runs `experiments.runs.execute` into a directory on its node, then sends the whole run
directory back to the driver as files (a gzip tar through Ray's object store), where it is unpacked
into the task's ``out_dir``; the node's copy is deleted. A scenario *file* travels with the task as
text (a ready scenario's name is resolved on the node). A node that dies loses only the runs it was
running: Ray resubmits them (``max_retries``) to another node with the resource, where they run from
the start; the driver gets exactly one outcome per task. What the dead node's runs left on it
(namespaces, processes) is removed by `prfaas clean` there.

Progress is shown per node (runs done and failed on each) as outcomes come in; every outcome's
``node`` is ``HOSTNAME/NODE_ID`` (node ids tell apart two nodes on one host), and each run's
``fidelity.json`` and summary carry the same name with that node's calibration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from experiments.executor import Executor, OnDone, RunHost, RunOutcome, RunTask
from experiments.parallel import CANCELLED, failed, outcome_from_dict, outcome_to_dict, task_from_dict, task_to_dict
from testbed.errors import UserError
from testbed.fidelity import NODE_ENV

NODE_RESOURCE = "prfaas_node"
SCRATCH_ENV = "PRFAAS_RAY_SCRATCH"  # where a node keeps a run until it is sent back (default: the system's temp dir)
MAX_RETRIES = 3  # resubmissions of a run whose node (or worker process) died
HOST_FACTS_TIMEOUT_S = 60.0  # for every node to answer `RayExecutor.run_hosts` (a fresh worker process each: seconds)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError("--executor ray needs Ray: pip install -e \".[ray]\" (on the driver and on every node)") from None
    return ray


def pack_dir(path: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(path, arcname=".")
    return buf.getvalue()


def unpack_dir(blob: bytes, dest: Path) -> None:
    """Replace `dest` with the directory packed in `blob` (members must stay inside `dest`)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    root = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:  # what tarfile's "data" filter refuses (Python < 3.11.4 has no filter)
            target = (root / m.name).resolve()
            if not (m.isfile() or m.isdir()) or (target != root and root not in target.parents):
                raise tarfile.TarError(f"refusing archive member {m.name!r}: not a plain file or directory inside {dest}")
        tar.extractall(dest, members=members)


def _node_name() -> str:
    """This Ray node's name in outcomes and run records: HOSTNAME/NODE_ID (8 hex digits)."""
    import ray

    return f"{socket.gethostname()}/{ray.get_runtime_context().get_node_id()[:8]}"


def host_facts(ccs: tuple[str, ...]) -> dict[str, Any]:
    """The body of a Ray task pinned to one node: what `check_run` checks a run against there (`RunHost`), its
    kernel asked for each congestion control in `ccs`."""
    from testbed.net.emulation import host_capacity_bps

    return dataclasses.asdict(RunHost.here(_node_name(), host_capacity_bps()[0], ccs))


def run_on_node(task_d: dict[str, Any], scenario_text: str | None) -> tuple[dict[str, Any], bytes | None]:
    """The body of a Ray task: run one task on this node; return its outcome and its packed run directory."""
    from experiments.runs import execute

    node = _node_name()
    os.environ[NODE_ENV] = node
    tmp = Path(tempfile.mkdtemp(prefix="prfaas-ray-", dir=os.environ.get(SCRATCH_ENV) or None))
    try:  # (a node killed mid-run leaves it behind: `LocalRayCluster` points it into its own temp dir)
        task = task_from_dict(task_d)
        scenario = task.scenario
        if scenario_text is not None:
            scenario = str(tmp / Path(task.scenario).name)
            Path(scenario).write_text(scenario_text)
        local = RunTask(key=task.key, scenario=scenario, overrides=task.overrides, out_dir=tmp / "run" / task.key)
        o = execute(local, progress=False)
        blob = pack_dir(local.out_dir) if local.out_dir.is_dir() else None
        return outcome_to_dict(RunOutcome(task=task, status=o.status, error=o.error, wall_s=o.wall_s, node=node)), blob
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cancel_refs(refs: Sequence[Any]) -> None:
    """Cancel Ray tasks, not by force: each gets KeyboardInterrupt and tears its network down. A ref that
    has finished, or a lost connection, does not stop the others from being cancelled."""
    if not refs:
        return
    ray = _import_ray()
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref)


CONNECT_TIMEOUT_S = 3.0


def tcp_accepts(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``HOST:PORT`` cluster address, None for anything else (``auto``, ``ray://...``: Ray reads those)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "://" in address or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


class RayExecutor(Executor):
    """Runs on the Ray cluster at `address` (``auto``: the one `ray start` made on this host, or RAY_ADDRESS)."""

    name = "ray"

    def __init__(self, address: str | None = None, *, max_retries: int = MAX_RETRIES, progress: bool = True) -> None:
        self.address = address or os.environ.get("RAY_ADDRESS") or "auto"
        self.max_retries = max_retries
        self.progress = progress
        self.per_node: dict[str, Counter] = {}
        self._lock = threading.RLock()  # `run` may be called from several threads (the executor contract)
        self._pending: set[Any] = set()  # every caller's refs not yet returned, for `cancel`
        self._cancelled = False
        self._slots: int | None = None
        self._hosts: dict[tuple[str, ...], list[RunHost]] = {}  # `run_hosts` per congestion controls asked

    @property
    def slots(self) -> int:  # type: ignore[override]
        """Runs the cluster takes at once: the sum of its nodes' `NODE_RESOURCE` (read when first asked)."""
        with self._lock:
            if self._slots is None:
                ray = self._connect()
                self._slots = max(1, int(ray.cluster_resources().get(NODE_RESOURCE, 1)))
            return self._slots

    def run_hosts(self, ccs: tuple[str, ...]) -> list[RunHost]:
        """Each node that takes runs, asked by a task pinned to it (once per tuple of congestion controls; no CPU or
        run slot asked, so it is answered while the node runs): its ``PRFAAS_CAPACITY_BPS`` (or the default) and its
        kernel."""
        ccs = tuple(ccs)
        with self._lock:
            if ccs in self._hosts:
                return self._hosts[ccs]
        ray = self._connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE, 0) >= 1]
        if not nodes:
            raise UserError(f"--executor ray: no live node of the cluster offers the resource {NODE_RESOURCE!r} (docs/scale-out.md)")
        ask = ray.remote(num_cpus=0, max_retries=0)(host_facts)
        refs = {ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(ccs):
                n for n in nodes}
        _, late = ray.wait(list(refs), num_returns=len(refs), timeout=HOST_FACTS_TIMEOUT_S)
        if late:
            _cancel_refs(late)
            names = ", ".join(f"{refs[r].get('NodeManagerAddress', '?')}/{refs[r]['NodeID'][:8]}" for r in late)
            raise UserError(f"--executor ray: node(s) {names} did not answer within {HOST_FACTS_TIMEOUT_S:g} s what a run "
                            "there would resolve `scale: auto` at and whether its kernel sets the scenario's congestion controls; "
                            "is `ray status` healthy? (docs/scale-out.md)")
        hosts = sorted((RunHost(**ray.get(r)) for r in refs), key=lambda h: h.name)
        with self._lock:
            self._hosts[ccs] = hosts
        return hosts

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            pending = list(self._pending)
        _cancel_refs(pending)

    def _connect(self) -> Any:
        ray = _import_ray()
        with self._lock:
            if not ray.is_initialized():
                gcs = _host_port(self.address)
                if gcs is not None and not tcp_accepts(*gcs, timeout_s=CONNECT_TIMEOUT_S):
                    # ray.init would wait minutes on an address where nothing listens (it retries in 30 s rounds)
                    raise UserError(f"--executor ray: no Ray cluster at {self.address!r} (nothing accepted a TCP connection "
                                    f"there within {CONNECT_TIMEOUT_S:g} s); start one with `ray start --head --resources "
                                    "'{\"prfaas_node\": 1}'` (docs/scale-out.md)")
                try:
                    ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
                except Exception as exc:  # ConnectionError; a malformed address is a ValueError, and Ray raises others
                    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise UserError(f"--executor ray: no Ray cluster at {self.address!r} ({why}); start one with "
                                    "`ray start --head --resources '{\"prfaas_node\": 1}'` (docs/scale-out.md)") from None
        if ray.cluster_resources().get(NODE_RESOURCE, 0) < 1:
            raise UserError(f"--executor ray: no node of the cluster offers the resource {NODE_RESOURCE!r}; start nodes with "
                            f"`ray start ... --resources '{{\"{NODE_RESOURCE}\": 1}}'` (docs/scale-out.md)")
        return ray

    def _show(self, outcome: RunOutcome, done: int, total: int) -> None:
        with self._lock:
            c = self.per_node.setdefault(outcome.node, Counter())
            c[outcome.status] += 1
            nodes = "; ".join(f"{n}: {v['ok']} ok, {v['failed']} failed" for n, v in sorted(self.per_node.items()))
        if self.progress:
            print(f"ray: {outcome.task.key} {outcome.status} on {outcome.node} ({done}/{total})   per node: {nodes}", file=sys.stderr)

    def run(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        ray = self._connect()
        remote = ray.remote(num_cpus=0, resources={NODE_RESOURCE: 1}, max_retries=self.max_retries,
                            retry_exceptions=False)(run_on_node)
        refs, refused = {}, []
        with self._lock:
            for t in tasks:
                if self._cancelled:
                    refused.append(t)
                    continue
                text = Path(t.scenario).read_text() if Path(t.scenario).is_file() else None
                refs[remote.remote(task_to_dict(t), text)] = t
            self._pending.update(refs)
        for t in refused:
            on_done(failed(t, CANCELLED))
        try:
            self._collect(ray, refs, list(refs), len(refused), len(tasks), on_done)
        except BaseException:  # an interrupt while waiting: this call's runs get KeyboardInterrupt and tear down
            _cancel_refs(list(refs))
            raise

    def _collect(self, ray: Any, refs: dict[Any, RunTask], pending: list[Any], done: int, total: int, on_done: OnDone) -> None:
        """Hand each task's outcome to `on_done` as its Ray task returns."""
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            with self._lock:
                self._pending.difference_update(ready)
            for ref in ready:
                task, t0 = refs[ref], time.monotonic()
                try:
                    outcome_d, blob = ray.get(ref)
                    outcome = outcome_from_dict(outcome_d)
                    outcome = RunOutcome(task=task, status=outcome.status, error=outcome.error, wall_s=outcome.wall_s, node=outcome.node)
                    if blob is not None:
                        unpack_dir(blob, Path(task.out_dir))
                    elif outcome.status == "ok":
                        outcome = failed(task, "the node sent no run directory back", outcome.wall_s, outcome.node)
                except Exception as exc:  # lost after every retry, or the directory could not be unpacked
                    outcome = failed(task, f"{type(exc).__name__}: {exc}".splitlines()[0], time.monotonic() - t0, "?")
                done += 1
                self._show(outcome, done, total)
                on_done(outcome)
