"""Fuzzing the multi-run commands where they had not been: every ``--executor`` value on every command that takes
one (sweep, experiment, capacity, reproduce), and ``prfaas reproduce case-study --out DIR`` resumed from a damaged
DIR. Each bad case must end with exit status 2 (or 1) and one line naming the value, file or field and what is
allowed -- no traceback, no hang -- before the output folder is made (a bad executor) or any run starts (a damaged
DIR), and a finished run directory is never deleted or rewritten.

Nothing real runs: `experiments.runs.execute` (the one function that runs a task) is replaced by a stand-in that
copies a synthetic run directory written by the project's writer (tests/unit/rundir_factory) and sets its verdict
from the rate, and `local:N`'s child processes call it in-process. Ray is replaced by a stand-in module, or made
impossible to import."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from experiments.executor import RunOutcome, SequentialExecutor, make_executor  # noqa: E402
from testbed import rundir  # noqa: E402
from testbed.cli import main  # noqa: E402
from testbed.errors import UserError  # noqa: E402

EDGE = {"prfaas": 3.0, "homogeneous-pd": 2.0, "naive-heterogeneous": 1.5}  # the stand-in's Lambda_max per policy


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rundir_factory import write_run_dir

    return write_run_dir(tmp_path_factory.mktemp("template") / "run", duration_s=5, rate_rps=5)


@pytest.fixture
def runs(template: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The runs started, by key (`stand_in_runs`)."""
    return stand_in_runs(template, monkeypatch)


def stand_in_runs(template: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Runs replaced: each is a copy of `template` that passes below its policy's `EDGE` and fails above; returns the
    keys of the runs started."""
    import experiments.runs
    from experiments.parallel import ParallelExecutor

    started: list[str] = []

    def execute(task: Any, *, progress: bool = False) -> RunOutcome:
        started.append(task.key)
        out = Path(task.out_dir)
        if out.exists():
            shutil.rmtree(out)  # as the real one: a run interrupted before its summary
        shutil.copytree(template, out)
        ov = dict(o.split("=", 1) for o in task.overrides)
        ok = float(ov.get("workload.arrivals.rate", "1/s").removesuffix("/s")) <= EDGE.get(ov.get("policy.name", ""), 3.0)
        s = rundir.read_summary(out)
        s.update(requests_total=300, requests_ok=300, requests_failed=0, good_fraction=1.0 if ok else 0.0,
                 queue={"growing": not ok, "p_value": None, "growth": None})
        rundir.RunDirWriter(out).summary(s)
        return RunOutcome(task, "ok", None, 0.01, "stand-in")

    monkeypatch.setattr(experiments.runs, "execute", execute)
    monkeypatch.setattr(ParallelExecutor, "_run_one", lambda self, task, env, mine: execute(task))
    return started


def fake_ray(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """`mode`: absent (not installed), noconnect / badaddress / other (ray.init raises ConnectionError / ValueError /
    RuntimeError over two lines), noresource (a cluster with no node for runs), ok (a cluster of 2 slots)."""
    if mode == "absent":
        monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
        return
    ray = types.ModuleType("ray")
    up = {"init": False}

    def init(address: str | None = None, **kw: Any) -> None:
        if mode == "noconnect":
            raise ConnectionError(f"Could not find any running Ray instance at {address}")
        if mode == "badaddress":
            raise ValueError(f"Invalid address {address!r}")
        if mode == "other":
            raise RuntimeError("Maybe you called ray.init twice by accident?\nsecond line")
        up["init"] = True

    ray.init = init  # type: ignore[attr-defined]
    ray.is_initialized = lambda: up["init"]  # type: ignore[attr-defined]
    ray.cluster_resources = lambda: {} if mode == "noresource" else {"prfaas_node": 2}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    # the stand-in cluster "listens" at any HOST:PORT (no packet leaves for 10.0.0.1)
    monkeypatch.setattr("experiments.ray_executor.tcp_accepts", lambda host, port, timeout_s=1.0: True)


def one_error_line(err: str, command: str) -> str:
    """The one line a command's user mistake prints, less its prefix, which names the command (`prfaas capacity: error: `)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    prefix = f"prfaas {command}: error: "
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0].removeprefix(prefix)


# ------------------------------------------------------------------------------------------- --executor

NOT_N = "N must be a whole number >= 1 (runs at once on this host, at most its 8 cores)"
UNKNOWN = "unknown executor; allowed: local, local:N, ray, ray:ADDRESS (docs/scale-out.md)"
NO_CLUSTER = "start one with `ray start --head --resources '{\"prfaas_node\": 1}'` (docs/scale-out.md)"
BAD_EXECUTORS = [  # (value, ray stand-in, the refusal after "--executor ")
    ("local:0", None, f"'local:0': {NOT_N}"),
    ("local:-1", None, f"'local:-1': {NOT_N}"),
    ("local:00", None, f"'local:00': {NOT_N}"),
    ("local:abc", None, f"'local:abc': {NOT_N}"),
    ("local:1.5", None, f"'local:1.5': {NOT_N}"),
    ("local:+2", None, f"'local:+2': {NOT_N}"),
    ("local: 2", None, f"'local: 2': {NOT_N}"),
    ("local:2:3", None, f"'local:2:3': {NOT_N}"),
    ("local:\u00b2", None, f"'local:\u00b2': {NOT_N}"),  # isdigit(), but int() refuses it: a ValueError traceback
    ("local:\u0663", None, f"'local:\u0663': {NOT_N}"),  # isdigit(), and int() read it as 3
    ("local:9", None, "local:9: 9 runs at once on 8 cores cannot keep time"),
    ("local:99999999999999999999", None, "'local:99999999999999999999': N is a 20-digit number, more runs at once than "
                                         "this host's 8 cores"),
    ("local:" + "9" * 5000, None, "'local:9999999999999999999999999999999999'... (5006 characters): N is a 5000-digit "
                                  "number"),  # int() of it raised ValueError (4300 digits at most)
    ("local:", None, "'local:': N is missing; use local (one run after another) or local:N"),
    ("ray", "absent", "ray needs Ray: pip install -e \".[ray]\""),
    ("ray:10.0.0.1:6379", "absent", "ray needs Ray: pip install -e \".[ray]\""),
    ("ray:", "ok", "'ray:': ADDRESS is missing; use ray (the cluster at RAY_ADDRESS"),
    ("ray", "noconnect", f"ray: no Ray cluster at 'auto' (Could not find any running Ray instance at auto); {NO_CLUSTER}"),
    ("ray:foo", "badaddress", f"ray: no Ray cluster at 'foo' (Invalid address 'foo'); {NO_CLUSTER}"),
    ("ray", "other", f"ray: no Ray cluster at 'auto' (Maybe you called ray.init twice by accident?); {NO_CLUSTER}"),
    ("ray", "noresource", "ray: no node of the cluster offers the resource 'prfaas_node'"),
    ("foo", None, f"'foo': {UNKNOWN}"),
    ("LOCAL", None, f"'LOCAL': {UNKNOWN}"),
    ("slurm:4", None, f"'slurm:4': {UNKNOWN}"),
    (":", None, f"':': {UNKNOWN}"),
    ("", None, "'': empty; allowed: local, local:N, ray, ray:ADDRESS"),
]
COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "sweep": lambda d: ["sweep", "quick", "--grid", "seed=1,2", "--out", str(d / "out")],
    "experiment": lambda d: ["experiment", str(d / "spec.yaml"), "--out", str(d / "out")],
    "capacity": lambda d: ["capacity", "quick", "--out", str(d / "out"), "--max-probes", "2", "--repetitions", "1"],
    "reproduce": lambda d: ["reproduce", "case-study", "--quick", "--out", str(d / "out")],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("value, ray, said", BAD_EXECUTORS, ids=[f"{v[:20]!r}-{r}" for v, r, _ in BAD_EXECUTORS])
def test_a_bad_executor_is_one_line_before_any_folder_or_run(command: str, value: str, ray: str | None, said: str,
                                                             runs: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    if ray:
        fake_ray(monkeypatch, ray)
    (tmp_path / "spec.yaml").write_text("scenario: quick\narms: {a: {policy.name: prfaas}, b: {policy.name: fixed-threshold}}\n"
                                        "seeds: 1\n")
    assert main(COMMANDS[command](tmp_path) + ["--executor", value]) == 2
    assert one_error_line(capsys.readouterr().err, command).startswith(f"--executor {said}")
    assert not (tmp_path / "out").exists() and runs == []


def test_good_executors_are_what_they_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from experiments.parallel import ParallelExecutor
    from experiments.ray_executor import RayExecutor

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    for spec in (None, "local", "local:1", "local:01"):
        assert isinstance(make_executor(spec), SequentialExecutor)
    ex = make_executor("local:4")
    assert isinstance(ex, ParallelExecutor) and ex.slots == 4
    fake_ray(monkeypatch, "ok")
    ray = make_executor("ray:10.0.0.1:6379")
    assert isinstance(ray, RayExecutor) and ray.address == "10.0.0.1:6379" and ray.slots == 2  # the cluster is asked now
    with pytest.raises(UserError, match="N must be a whole number >= 1"):
        make_executor("local:0")


def test_a_ray_address_where_nothing_listens_is_refused_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]):
    """ray.init waits minutes on an address where nothing listens (measured: over 3 min with Ray 2.60); a
    HOST:PORT that accepts no TCP connection is one line at once, and ray.init is never called."""
    import socket
    import time

    from experiments import ray_executor

    real_check = ray_executor.tcp_accepts
    fake_ray(monkeypatch, "ok")
    monkeypatch.setattr(ray_executor, "tcp_accepts", real_check)  # the real check, on loopback only
    calls: list[str | None] = []
    monkeypatch.setattr(sys.modules["ray"], "init", lambda address=None, **kw: calls.append(address))
    with socket.socket() as s:  # a loopback port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(UserError, match=rf"^--executor ray: no Ray cluster at '127\.0\.0\.1:{port}' \(nothing accepted a TCP "
                       r"connection there within 3 s\); start one with `ray start --head"):
        make_executor(f"ray:127.0.0.1:{port}").slots
    assert time.monotonic() - t0 < 10 and calls == []
    with socket.socket() as s:  # and where something listens, Ray is asked
        s.bind(("127.0.0.1", 0))
        s.listen()
        listening = s.getsockname()[1]
        assert make_executor(f"ray:127.0.0.1:{listening}").slots == 2
    assert calls == [f"127.0.0.1:{listening}"]
    for address in ("auto", "ray://10.0.0.1:10001", "foo", "host:notaport", "host:0", "host:70000"):
        assert ray_executor._host_port(address) is None  # Ray reads these itself
    assert ray_executor._host_port("[::1]:6379") == ("::1", 6379) and ray_executor._host_port("h:6379") == ("h", 6379)


@pytest.mark.timeout(120)
def test_an_executor_that_is_taken_runs_the_command(runs: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]):
    """The accepted values reach the runs: local:2 runs a sweep's two points (in-process here)."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert main(COMMANDS["sweep"](tmp_path) + ["--executor", "local:2"]) == 0
    assert sorted(runs) == ["seed=1", "seed=2"] and "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------ reproduce, resumed from a damaged DIR

RUN = "prfaas_pd/probes/rate=2.42/seed1"  # a finished run of the first search
PAIRED = {"higher": "prfaas_pd", "lower": "homogeneous_pd", "seeds": [3, 4, 5, 6, 7, 8], "p_value": 0.5}


@pytest.fixture(scope="module")
def finished(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quick reproduction of the three configurations, finished with the stand-in runs."""
    mp = pytest.MonkeyPatch()
    out = tmp_path_factory.mktemp("finished") / "out"
    try:
        started = stand_in_runs(template, mp)
        assert main(["reproduce", "case-study", "--quick", "--out", str(out), "--json"]) == 0
        assert len(started) == 13 and rundir.read_summary(out / RUN)["good_fraction"] == 1.0
    finally:
        mp.undo()
    return out


def write(rel: str, data: str | bytes) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        p = d / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return f


def cut(rel: str) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        b = (d / rel).read_bytes()
        (d / rel).write_bytes(b[: len(b) // 2])
    return f


def remove(rel: str) -> Callable[[Path], None]:
    return lambda d: shutil.rmtree(d / rel) if (d / rel).is_dir() and not (d / rel).is_symlink() else (d / rel).unlink()


def folder(rel: str) -> Callable[[Path], None]:
    return lambda d: (remove(rel)(d), (d / rel).mkdir())  # type: ignore[func-returns-value]


def link(rel: str, target: str) -> Callable[[Path], None]:
    return lambda d: (remove(rel)(d), (d / rel).symlink_to(target))  # type: ignore[func-returns-value]


def edit(rel: str, **changes: Any) -> Callable[[Path], None]:
    def f(d: Path) -> None:
        data = json.loads((d / rel).read_text())
        for k, v in changes.items():
            if "." in k:
                outer, inner = k.split(".")
                data[outer] = {**data[outer], inner: v}
            else:
                data[k] = v
        (d / rel).write_text(json.dumps(data, allow_nan=True))
    return f


def as_run(rel: str) -> Callable[[Path], None]:
    """The run at `rel` without its task.json, its scenario.yaml the one a real run of its task writes (as a run from
    before task.json, or one stopped between its summary and its task.json)."""
    def f(d: Path) -> None:
        from rundir_factory import write_scenario_as_run

        task = rundir.read_task(d / rel)
        write_scenario_as_run(d / rel, task["scenario"], task["overrides"])
        (d / rel / rundir.TASK_FILE).unlink()
    return f


def both(*fs: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda d: [f(d) for f in fs] and None  # type: ignore[func-returns-value]


FINISHED_RUN = "a finished run (it has its summary.json) that no longer loads: "
DOCUMENT = "reproduce.json"
# (case, damage, --paired?, exit status, what the one line says (in order); runs started (None: any))
RESUMES: list[tuple[str, Callable[[Path], None], bool, int, list[str], int | None]] = [
    # reproduce.json and the kept reproduce-<time>.json: kept aside, or (for a paired test) refused
    ("document-empty", write(DOCUMENT, ""), False, 0, [], 0),
    ("document-cut", cut(DOCUMENT), False, 0, [], 0),
    ("document-list", write(DOCUMENT, "[1]"), False, 0, [], 0),
    ("document-not-utf8", write(DOCUMENT, b"\xff\xfe"), False, 0, [], 0),
    ("document-too-deep", write(DOCUMENT, "[" * 100_000), False, 0, [], 0),  # a RecursionError traceback before
    ("document-folder", folder(DOCUMENT), False, 0, [], 0),
    ("document-dangling-link", link(DOCUMENT, "/nonexistent/reproduce.json"), False, 0, [], 0),
    ("document-wall-text", edit(DOCUMENT, wall_s="long"), False, 0, [], 0),
    ("document-scenario-list", edit(DOCUMENT, scenario=[1]), False, 0, [], 0),
    ("paired-document-cut", cut(DOCUMENT), True, 2, ["reproduce.json: not valid JSON", "a reproduction's document"], 0),
    ("paired-document-too-deep", write(DOCUMENT, "[" * 100_000), True, 2, ["reproduce.json: not a reproduction's document",
                                                                          "(JSON nested too deeply)"], 0),
    ("paired-document-folder", folder(DOCUMENT), True, 2, ["reproduce.json: cannot read (Is a directory)"], 0),
    ("paired-int", write(DOCUMENT, json.dumps({"paired": 5})), True, 2, ["reproduce.json: paired: must be a list, got int"], 0),
    ("paired-entry-int", write(DOCUMENT, json.dumps({"paired": [5]})), True, 2,
     ["reproduce.json: paired[0]: must be a mapping of keys to values, got int"], 0),
    ("paired-higher-list", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "higher": [1]}]})), True, 2,
     ["reproduce.json: paired[0].higher: [1] is not allowed; use one of: prfaas_pd, homogeneous_pd, naive_heterogeneous"], 0),
    ("paired-seeds-int", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "seeds": 5}]})), True, 2,
     ["reproduce.json: paired[0].seeds: must be a non-empty list of seeds, got 5"], 0),
    ("paired-seeds-empty", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "seeds": []}]})), True, 2,
     ["paired[0].seeds: must be a non-empty list of seeds, got []"], 0),
    ("paired-seeds-bool", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "seeds": [True, 3]}]})), True, 2,
     ["paired[0].seeds: True is not a seed"], 0),  # read as seed 1 before
    ("paired-seeds-huge", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "seeds": [10**30]}]})), True, 2,
     ["paired[0].seeds: a 31-digit number is not a seed"], 0),
    ("paired-p-text", write(DOCUMENT, json.dumps({"paired": [{**PAIRED, "p_value": "x"}]})), True, 2,
     ["paired[0].p_value: 'x' is not a number"], 0),
    ("paired-kept-cut", write("reproduce-20260101T000000Z.json", "{"), True, 2, ["reproduce-20260101T000000Z.json: not valid JSON"], 0),
    ("paired-kept-no-lower", write("reproduce-20260101T000000Z.json", json.dumps({"paired": [{"higher": "prfaas_pd", "seeds": [9]}]})),
     True, 2, ["reproduce-20260101T000000Z.json: paired[0].lower: is required"], 0),
    # a finished run's files: refused, and left as they are
    ("summary-empty", write(f"{RUN}/summary.json", ""), False, 2, [FINISHED_RUN, "summary.json: empty"], 0),
    ("summary-cut", cut(f"{RUN}/summary.json"), False, 2, [FINISHED_RUN, "summary.json: not valid JSON"], 0),
    ("summary-list", write(f"{RUN}/summary.json", "[]"), False, 2, [FINISHED_RUN, "summary.json: must be a JSON object"], 0),
    ("summary-folder", folder(f"{RUN}/summary.json"), False, 2, [FINISHED_RUN, "missing summary.json"], 0),
    ("summary-dangling-link", link(f"{RUN}/summary.json", "/nonexistent"), False, 2, [FINISHED_RUN], 0),
    ("summary-total-text", edit(f"{RUN}/summary.json", requests_total="x"), False, 2,
     [FINISHED_RUN, "requests_total: 'x' is not a whole number >= 0"], 0),
    ("summary-total-huge", edit(f"{RUN}/summary.json", requests_total=10**30), False, 2,  # a ValueError traceback before
     [FINISHED_RUN, "requests_total: a 31-digit number is more requests than a run holds (at most 2**53)"], 0),
    ("summary-good-text", edit(f"{RUN}/summary.json", good_fraction="0.95"), False, 2, ["good_fraction: '0.95' is not a number"], 0),
    ("summary-good-5", edit(f"{RUN}/summary.json", good_fraction=5.0), False, 2,  # a ValueError traceback before
     [FINISHED_RUN, "good_fraction: 5.0 is not a fraction (a number from 0 to 1)"], 0),
    ("summary-good-negative", edit(f"{RUN}/summary.json", good_fraction=-1.0), False, 2, ["good_fraction: -1.0 is not a fraction"], 0),
    ("summary-queue-list", edit(f"{RUN}/summary.json", queue=[1]), False, 2, ["queue: must be an object, got list"], 0),
    ("summary-growing-text", edit(f"{RUN}/summary.json", **{"queue.growing": "no"}), False, 2,  # read as growing before
     ["queue.growing: 'no' is not true or false"], 0),
    ("summary-p-text", edit(f"{RUN}/summary.json", **{"queue.p_value": "x"}), False, 2,  # a TypeError traceback before
     ["queue.p_value: 'x' is not a number"], 0),
    ("summary-early-stop-list", edit(f"{RUN}/summary.json", early_stop=[1]), False, 2,  # read as a reason to fail before
     ["early_stop: [1] is not a string"], 0),
    ("requests-cut", cut(f"{RUN}/requests.parquet"), False, 2, [FINISHED_RUN, "requests.parquet: not a readable parquet file"], 0),
    ("requests-missing", remove(f"{RUN}/requests.parquet"), False, 2, [FINISHED_RUN, "missing requests.parquet"], 0),
    ("environment-cut", write(f"{RUN}/environment.json", "{"), False, 2, [FINISHED_RUN, "environment.json: not valid JSON"], 0),
    ("scenario-not-yaml", write(f"{RUN}/scenario.yaml", "a: [\n"), False, 2, [FINISHED_RUN, "scenario.yaml: not valid YAML"], 0),
    ("task-empty", write(f"{RUN}/task.json", ""), False, 2, ["task.json: empty; a run directory's task.json is expected"], 0),
    ("task-cut", cut(f"{RUN}/task.json"), False, 2, ["task.json: not valid JSON"], 0),
    ("task-list", write(f"{RUN}/task.json", "[]"), False, 2, ["task.json: must be a JSON object"], 0),
    ("task-settings-int", write(f"{RUN}/task.json", json.dumps({"settings": 5})), False, 2, ["task.json: no settings mapping"], 0),
    ("task-folder", folder(f"{RUN}/task.json"), False, 2, ["task.json: cannot read (Is a directory)"], 0),
    ("task-not-utf8", write(f"{RUN}/task.json", b"\x80"), False, 2, ["task.json: not UTF-8 text"], 0),
    ("task-other-settings", edit(f"{RUN}/task.json", **{"settings.duration": "99s"}), False, 2,
     ["holds a finished run of other settings than this one asks for (duration: '99s' there, '45s' now)"], 0),
    # folders: a file or a link to nowhere where one goes is refused; what is missing is run again
    ("run-folder-a-file", write(RUN, "x"), False, 2, ["seed1: not a folder, where this run's directory goes"], 0),
    ("run-folder-dangling-link", link(RUN, "/nonexistent/run"), False, 2,  # failed each run there before (a failed rate)
     ["seed1: a link to nowhere, where this run's directory goes"], 0),
    ("rate-folder-a-file", write("prfaas_pd/probes/rate=2.42", "x"), False, 2, ["rate=2.42: not a folder, where the runs of a rate go"], 0),
    ("rate-folder-a-loop", link("prfaas_pd/probes/rate=2.42", "rate=2.42"), False, 2, ["rate=2.42: not a folder"], 0),
    ("probes-a-file", write("prfaas_pd/probes", "x"), False, 2, ["probes: not a folder, where a capacity search's runs go"], 0),
    ("configuration-a-file", write("prfaas_pd", "x"), False, 2, ["prfaas_pd: not a folder, where a capacity search's runs go"], 0),
    ("out-a-file", lambda d: (shutil.rmtree(d), d.write_text("x")), False, 2, ["out: cannot create this folder (File exists)"], 0),
    ("late-damage", both(remove("prfaas_pd"), write("naive_heterogeneous/probes/rate=1.439/seed1/summary.json", "{")), False, 2,
     [FINISHED_RUN, "summary.json: not valid JSON"], 0),  # refused after the first search's 5 new runs before
    ("run-interrupted", both(folder(RUN), write(f"{RUN}/work/log.txt", "x")), False, 0, [], 1),  # no summary: run again
    ("run-empty", folder(RUN), False, 0, [], 1),
    ("summary-missing", remove(f"{RUN}/summary.json"), False, 0, [], 1),
    # a run without the record is compared by its scenario.yaml (the stand-in's is another scenario's); it was taken as it was
    ("task-missing", remove(f"{RUN}/task.json"), False, 2, ["seed1: holds a finished run of other settings than this one asks for (",
                                                            "; read from its scenario.yaml, as it has no task.json); use another --out"], 0),
    ("task-missing-scenario-as-run", as_run(RUN), False, 0, [], 0),
    ("configuration-missing", remove("prfaas_pd"), False, 0, [], 5),
    ("junk-beside", both(write("prfaas_pd/probes/notes.txt", "x"), write("prfaas_pd/probes/rate=2.42/seed9/summary.json", "{")),
     False, 2, ["seed9: " + FINISHED_RUN], 0),
    ("fidelity-cut", write(f"{RUN}/fidelity.json", "{"), False, 0, [], 0),  # not read again: its figures are in the summary
]


def finished_runs(d: Path) -> dict[str, str]:
    """Every finished run directory under `d` (its summary.json is there) -> a hash of its files."""
    out = {}
    for s in d.rglob("summary.json") if d.is_dir() else []:
        run = s.parent
        h = hashlib.sha256()
        for f in sorted(run.rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(run)).encode() + f.read_bytes())
        out[str(run.relative_to(d))] = h.hexdigest()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, damage, paired, status, said, started", RESUMES, ids=[c[0] for c in RESUMES])
def test_a_reproduction_resumed_from_a_damaged_folder(case: str, damage: Callable[[Path], None], paired: bool, status: int,
                                                      said: list[str], started: int | None, finished: Path, runs: list[str],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    d = tmp_path / "out"
    shutil.copytree(finished, d, symlinks=True)
    damage(d)
    before = finished_runs(d)
    only = "prfaas_pd,homogeneous_pd" if paired else ("prfaas_pd,homogeneous_pd,naive_heterogeneous" if case == "late-damage"
                                                      else "prfaas_pd")
    argv = ["reproduce", "case-study", "--quick", "--out", str(d), "--only", only, "--json"] + (["--paired", "6"] if paired else [])
    assert main(argv) == status
    err = capsys.readouterr().err
    if status:
        line = one_error_line(err, "reproduce")
        at = -1
        for part in said:  # each in order, in the one line
            at = line.find(part, at + 1)
            assert at >= 0, (part, line)
    else:
        assert "Traceback" not in err
        assert all(ln.startswith(("kept the earlier", "prfaas: warning:")) for ln in err.splitlines() if ln.strip()), err
    if started is not None:
        assert len(runs) == started, runs
    after = finished_runs(d) if d.is_dir() else {}
    assert {k: v for k, v in before.items() if after.get(k) != v} == {}  # no finished run deleted or rewritten
    if case.startswith("document-"):  # the damaged document is kept beside the new one, as it was, and the line says why
        assert len(list(d.glob("reproduce-*.json"))) == 1 and "kept the earlier" in err
        assert ("(unreadable, so its time is in no sum: " in err) == (case not in ("document-wall-text", "document-scenario-list"))


# ------------------------------------------------------------------ resumed with other settings: refused before any run

CAPACITY = ["capacity", "quick", "--max-probes", "3", "--repetitions", "1", "--json"]


def every_path(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.mark.timeout(120)
def test_a_capacity_search_resumed_with_other_settings_is_refused_before_any_run(runs: list[str], tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]):
    """A finished run whose task.json records other settings was refused only when the search reached its rate, after
    new runs into the same folder; every run in --out is now checked against the task its folder's name rebuilds
    (`capacity.check_resume`) before the first run, and before any folder is made."""
    out = tmp_path / "out"
    assert main(CAPACITY + ["--out", str(out)]) == 0 and len(runs) >= 2
    made, paths, before = list(runs), every_path(out), finished_runs(out)
    runs.clear()
    capsys.readouterr()
    assert not any(k.startswith("rate=0.7/") for k in made)  # a new start: the old check ran its runs first
    assert main(CAPACITY + ["--out", str(out), "--set", "serving.slo.ttft=20s", "--start", "0.7"]) == 2
    line = one_error_line(capsys.readouterr().err, "capacity")
    assert runs == [] and every_path(out) == paths and finished_runs(out) == before  # nothing ran, made or deleted
    first = out / "probes" / f"{sorted(made)[0].split('/')[0]}" / "seed1"
    assert line.startswith(f"{first}: holds a finished run of other settings than this one asks for (serving.slo.ttft: "), line
    assert line.endswith("there, '20s' now); use another --out, or move that run aside to run it again"), line

    shutil.rmtree(out / "probes" / made[-1])  # the same settings: only what is missing runs
    assert main(CAPACITY + ["--out", str(out)]) == 0
    assert runs == [made[-1]] and "Traceback" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_measure_capacity_called_directly_checks_the_runs_in_out_before_any_run(runs: list[str], tmp_path: Path,
                                                                                capsys: pytest.CaptureFixture[str]):
    """Code that calls `measure_capacity` itself (not through the CLI or `reproduce`, which check before they make the
    folder) gets the same check of the runs already in `out` before its first run."""
    from experiments.capacity import measure_capacity

    out = tmp_path / "out"
    assert main(CAPACITY + ["--out", str(out)]) == 0 and len(runs) >= 2
    paths, before = every_path(out), finished_runs(out)
    runs.clear()
    with pytest.raises(UserError, match=r"holds a finished run of other settings than this one asks for \(serving\.slo\.ttft: "):
        measure_capacity("quick", ["serving.slo.ttft=20s"], out, repetitions=1, max_probes=2, start_rps=0.7, progress=False)
    assert runs == [] and every_path(out) == paths and finished_runs(out) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", [[], ["--no-early-stop"]], ids=["full", "no-early-stop"])
def test_a_reproduction_resumed_as_another_variant_is_refused_before_any_run(variant: list[str], finished: Path, runs: list[str],
                                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """The full variant (or --no-early-stop) into a quick reproduction's folder: refused at its first configuration's
    first run, not when each search reached its rates (the full variant's model puts its rates elsewhere, so most of
    them would have been new runs beside the quick ones first)."""
    d = tmp_path / "out"
    shutil.copytree(finished, d, symlinks=True)
    paths, before = every_path(d), finished_runs(d)
    quick = ["--quick"] if variant else []  # full: the same folder without --quick
    assert main(["reproduce", "case-study", "--out", str(d), "--json"] + quick + variant) == 2
    line = one_error_line(capsys.readouterr().err, "reproduce")
    assert runs == [] and every_path(d) == paths and finished_runs(d) == before
    first = sorted((d / "prfaas_pd" / "probes").iterdir())[0] / "seed1"
    said = "(duration: '45s' there, '150s' now; " if not variant else "(serving.slo.stop_below: 0.9 there, nothing now)"
    assert line.startswith(f"{first}: holds a finished run of other settings than this one asks for {said}"), line


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv, searches", [(["capacity", "quick", "--max-probes", "2"], 1),
                                            (["reproduce", "case-study", "--quick"], 3)])
def test_each_search_checks_its_scenario_once(argv: list[str], searches: int, runs: list[str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch):
    """The command checks every search's scenario before it makes the output folder, and the search is handed what
    was checked: `capacity.check_scenario` (~0.5 s: a whole `check_run`) runs once per search, not twice."""
    from experiments import capacity

    calls: list[tuple[str, tuple[str, ...]]] = []
    real = capacity.check_scenario

    def counted(scenario: str, overrides: Any, executor: Any = None) -> Any:
        calls.append((scenario, tuple(overrides)))
        return real(scenario, overrides, executor)

    monkeypatch.setattr(capacity, "check_scenario", counted)
    assert main(argv + ["--out", str(tmp_path / "out"), "--json"]) == 0
    assert runs and len(calls) == searches and len(set(calls)) == searches
