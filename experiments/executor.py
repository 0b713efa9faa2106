"""The executor interface: how an experiment's runs get run.

An experiment (or sweep) turns its specification into `RunTask`s, plain picklable data: a key, a
scenario reference (name in topologies/ or an absolute path), ``--set`` overrides and the run directory.
An `Executor` runs them and hands each `RunOutcome` to a callback as it finishes, in any order. The
engine never looks at how: results are read back from the run directories.

The contract, for every implementation:

- ``run(tasks, on_done)`` returns once every task has an outcome; ``on_done`` is called once per task,
  from the calling thread or another (the engine's callback is thread-safe);
- a failed run is an outcome with ``status == "failed"`` and the reason, never an exception;
- after ``on_done(outcome)`` the task's ``out_dir`` holds the complete run directory on the driver's
  file system (an executor that runs elsewhere copies it back before calling);
- `experiments.runs.execute(task)` is the one function that runs a task on a host; executors call it in
  the process (or node) they choose;
- ``run`` may be called from several threads at once (`experiments.reproduce` runs a search per
  configuration side by side): together they never run more than ``slots`` runs at once;
- ``run_hosts(ccs)`` names every host a run may land on, with the capacity ``scale: auto`` resolves at there
  and which of the congestion controls `ccs` its kernel refuses (`testbed.serving.config.congestion_controls`:
  the KV's and the TCP cross-traffic flows'): `experiments.engine.check_run` checks each run on each of them
  before the first run starts;
- ``cancel()`` stops every run in progress (each tears its network down) and makes every later run a
  failed outcome at once, for the rest of the executor's life; it is for a caller that gives up (an
  interrupt, a failed search beside), not a pause.

Implementations are registered by name in `EXECUTORS` and chosen with ``--executor NAME[:ARG]``:
``local`` (one run after another, in this process), ``local:N`` (`experiments.parallel`) and ``ray`` /
``ray:ADDRESS`` (`experiments.ray_executor`); docs/scale-out.md.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from testbed.errors import UserError


@dataclass(frozen=True)
class RunTask:
    key: str  # unique within an experiment; names the run directory
    scenario: str  # a scenario file (absolute path) or the name of a ready one in topologies/
    overrides: tuple[str, ...]  # "key=value", applied in order
    out_dir: Path


@dataclass(frozen=True)
class RunOutcome:
    task: RunTask
    status: str  # "ok" | "failed"
    error: str | None
    wall_s: float
    node: str  # host name of the machine that ran it


OnDone = Callable[[RunOutcome], None]


@dataclass(frozen=True)
class RunHost:
    """A host an executor's runs go to, with what `experiments.engine.check_run` checks a run against there."""

    name: str  # "this host", or a Ray node's HOSTNAME/NODE_ID (the name its runs' outcomes carry)
    capacity_bps: float  # the WAN capacity a run there resolves ``scale: auto`` at (`Scenario.resolve_scale`)
    # (congestion control, why that host's kernel refuses it) for each one asked that it refuses; (): it sets them all.
    # Pairs, not a dict: the host stays hashable, and `ray_executor.host_facts` sends it as plain data.
    cc_refused: tuple[tuple[str, str], ...]

    @classmethod
    def here(cls, name: str, capacity_bps: float, ccs: tuple[str, ...]) -> "RunHost":
        """This host as `name`, its kernel asked for each congestion control in `ccs` (none: nothing to ask)."""
        from testbed.kv.transport import congestion_control_refused

        refused = ((cc, congestion_control_refused(cc)) for cc in ccs)
        return cls(name, capacity_bps, tuple((cc, why) for cc, why in refused if why is not None))


class Executor(abc.ABC):
    """Runs `RunTask`s; see the module docstring for the contract."""

    name: str = ""
    slots: int = 1  # runs it makes at once: a capacity search hands it that many of a rate's repetitions together

    @abc.abstractmethod
    def run(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        ...

    def run_capacity_bps(self) -> float:
        """The WAN capacity each of its runs resolves ``scale: auto`` at (`Scenario.resolve_scale`), which
        `experiments.engine.check_run` checks before the first run: this host's whole (`host_capacity_bps`) for a run
        alone on it; `local:N`'s N runs share it (`experiments.parallel`). Ray's runs resolve at their node's
        (`run_hosts`)."""
        from testbed.net.emulation import host_capacity_bps

        return host_capacity_bps()[0]

    def run_hosts(self, ccs: tuple[str, ...]) -> list[RunHost]:
        """Every host a run may land on, each with the capacity ``scale: auto`` resolves at there and which of the
        congestion controls `ccs` its kernel refuses (none asked: the hosts' defaults, nothing to ask): `check_run`
        checks a run on each. Here: this host alone."""
        return [RunHost.here("this host", self.run_capacity_bps(), ccs)]

    def cancel(self) -> None:
        """Stop the runs in progress and start none; a no-op where ``run`` is never called from several
        threads (one slot: an interrupt reaches the one run in this process)."""


class SequentialExecutor(Executor):
    """One run after another in this process (``--executor local``)."""

    name = "local"

    def __init__(self, progress: bool = False) -> None:
        self.progress = progress

    def run(self, tasks: Sequence[RunTask], on_done: OnDone) -> None:
        from experiments.runs import execute

        for task in tasks:
            on_done(execute(task, progress=self.progress))


def _spec(spec: str) -> str:
    """`spec` as a refusal quotes it: at most 40 characters (a 5000-digit N was echoed whole)."""
    return repr(spec) if len(spec) <= 40 else repr(spec[:40]) + f"... ({len(spec)} characters)"


def _local(arg: str | None) -> Executor:
    """``local`` (one after another) or ``local:N`` (N isolated runs at once, `experiments.parallel`): N in ASCII digits,
    1 to this host's cores (`testbed.fidelity.check_parallelism` refuses more)."""
    if arg is None:
        return SequentialExecutor()
    if arg == "":
        raise UserError("--executor 'local:': N is missing; use local (one run after another) or local:N (N runs at once on "
                        "this host)")
    # ASCII digits only: str.isdigit() alone takes '²' and '٣', which int() refuses or reads. 19 digits and more are
    # past any host's cores (and int() of 4301 digits raises), so the length is read before the number
    cpus = os.cpu_count() or 1
    digits = arg.isascii() and arg.isdigit()
    if digits and len(arg) >= 19:
        raise UserError(f"--executor {_spec('local:' + arg)}: N is a {len(arg)}-digit number, more runs at once than this "
                        f"host's {cpus} cores")
    if not digits or int(arg) < 1:
        raise UserError(f"--executor {_spec('local:' + arg)}: N must be a whole number >= 1 (runs at once on this host, "
                        f"at most its {cpus} cores)")
    if int(arg) == 1:
        return SequentialExecutor()
    from experiments.parallel import ParallelExecutor

    return ParallelExecutor(int(arg))


def _ray(arg: str | None) -> Executor:
    """``ray`` (the cluster at RAY_ADDRESS, or the one `ray start` made on this host) or ``ray:ADDRESS``. The cluster is
    reached now (`RayExecutor.slots`): no Ray, no cluster or no node for runs is refused before a command makes its
    output folder, not at its first run."""
    from experiments.ray_executor import RayExecutor

    if arg == "":
        raise UserError("--executor 'ray:': ADDRESS is missing; use ray (the cluster at RAY_ADDRESS, or the one `ray start` "
                        "made on this host) or ray:HOST:PORT")
    ex = RayExecutor(arg)
    ex.slots  # noqa: B018 (connects, and checks the cluster's nodes)
    return ex


EXECUTORS: dict[str, Callable[[str | None], Executor]] = {"local": _local, "ray": _ray}


def make_executor(spec: str | None) -> Executor:
    """The one reader of ``--executor NAME[:ARG]`` (every command that takes it calls this before it makes its output
    folder): ``local`` -> `SequentialExecutor`; ``NAME:ARG`` passes ARG to the registered factory (an empty ARG, as
    ``local:``, is refused there); None is ``local``. Every refusal is one `UserError` quoting the value."""
    if spec is None:
        spec = "local"
    name, colon, arg = spec.partition(":")
    if name not in EXECUTORS:
        raise UserError(f"--executor {_spec(spec)}: " + ("empty" if not spec else "unknown executor")
                        + "; allowed: local, local:N, ray, ray:ADDRESS (docs/scale-out.md)")
    return EXECUTORS[name](arg if colon else None)
