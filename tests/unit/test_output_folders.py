"""Every command that makes an output folder makes it after every check of its input (`testbed.atomic.make_output_dir`):
a refused invocation leaves no folder behind, and exits 2 with one line naming what was refused.

`prfaas capacity quick --set seed=-1` left an empty runs/capacity-quick-<time>, and `prfaas reproduce` made its folder
before its executor and its configurations were checked (2026-12-07). Nothing here may run: whatever would start real
work is replaced first by a stand-in that fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.cli import main

SEED = "seed: -1 is not a seed; use a whole number from 0 to 4294967295 (2**32 - 1)"


@pytest.fixture
def nothing_runs(monkeypatch, tmp_path):
    """cwd = tmp_path (the default runs/<name>-<time> lands there); every long job fails the test if reached."""
    from analysis import bandwidth_wall
    from experiments import capacity, engine, experiment, reproduce, runs, sweep
    from testbed.models import profiling
    from testbed.net import emulation

    def must_not_run(*a, **kw):
        raise AssertionError("a refused invocation must not start anything")

    # experiment and sweep import run_tasks by name: imported first, they keep the real one (imported while it is
    # replaced, they kept the stand-in for the rest of the session, and a later test's sweep "started" it)
    assert experiment.run_tasks is sweep.run_tasks is engine.run_tasks
    for owner, name in ((capacity, "measure_capacity"), (reproduce, "reproduce_case_study"), (engine, "run_tasks"),
                        (runs, "run_once"), (profiling, "measure"), (emulation, "Network"), (bandwidth_wall, "measure")):
        monkeypatch.setattr(owner, name, must_not_run)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def refused(argv: list[str], capsys) -> str:
    """The one line a refused command prints (exit status 2: ours or argparse's)."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 or err[-1].startswith("prfaas"), err
    return err[-1]


def test_a_refused_capacity_search_leaves_no_folder(nothing_runs, capsys):
    for out in ([], ["--out", "named"]):
        assert refused(["capacity", "quick", "--set", "seed=-1", *out], capsys).endswith(SEED)
        assert refused(["capacity", "quick", "--executor", "nosuch", *out], capsys) == (
            "prfaas capacity: error: --executor 'nosuch': unknown executor; allowed: local, local:N, ray, ray:ADDRESS (docs/scale-out.md)")
    assert list(nothing_runs.iterdir()) == []  # was runs/capacity-quick-<time>, and named/


def test_an_empty_out_is_refused_not_read_as_no_out(nothing_runs, capsys):
    """`--out ""` was "no --out": `capacity` started its search in runs/capacity-quick-<time>, `experiment` wrote into
    the current folder."""
    spec = nothing_runs / "spec.yaml"
    spec.write_text("scenario: quick\narms: {a: {policy.name: prfaas}}\n")
    for argv in (["capacity", "quick"], ["experiment", str(spec)], ["run", "quick"], ["sweep", "quick", "--grid", "seed=1,2"],
                 ["reproduce", "case-study"], ["report", str(nothing_runs)]):
        for empty in ("", " "):
            assert refused([*argv, "--out", empty], capsys).endswith(f"argument --out: {empty!r} is no path; name a file or folder")
    assert sorted(p.name for p in nothing_runs.iterdir()) == ["spec.yaml"]


def test_a_refused_reproduction_leaves_no_folder(nothing_runs, capsys, monkeypatch):
    from experiments import capacity
    from testbed.errors import FieldError

    for out in ([], ["--out", "named"]):
        assert refused(["reproduce", "case-study", "--quick", "--executor", "nosuch", *out], capsys) == (
            "prfaas reproduce: error: --executor 'nosuch': unknown executor; allowed: local, local:N, ray, ray:ADDRESS (docs/scale-out.md)")
    why = "'bbr' cannot be set on this host"

    def host_refuses(scenario, overrides, executor=None):  # as plan_run refuses a KV congestion control this host's kernel lacks
        raise FieldError("serving.kv_congestion_control", why)

    monkeypatch.setattr(capacity, "check_scenario", host_refuses)
    assert refused(["reproduce", "case-study", "--quick"], capsys) == f"prfaas reproduce: error: serving.kv_congestion_control: {why}"
    assert list(nothing_runs.iterdir()) == []  # was runs/reproduce-case-study-<time>, and named/


def test_a_refused_run_quickstart_sweep_or_experiment_leaves_no_folder(nothing_runs, capsys):
    assert refused(["run", "quick", "--set", "seed=-1"], capsys).endswith(SEED)
    assert refused(["run", "quick", "--set", "seed=-1", "--out", "named"], capsys).endswith(SEED)
    assert refused(["quickstart", "--policies", "prfaas,nosuch"], capsys).startswith("prfaas quickstart: error: ")
    assert refused(["quickstart", "--policies", "prfaas,prfaas", "--out", "named"], capsys) == (
        "prfaas quickstart: error: --policies 'prfaas,prfaas': 'prfaas' is given twice; name each policy once")
    assert refused(["sweep", "quick", "--grid", "seed=1,-1", "--out", "named"], capsys).endswith(SEED)
    spec = nothing_runs / "spec.yaml"
    spec.write_text("scenario: quick\narms: {a: {workload.seed: -1}}\n")
    assert refused(["experiment", str(spec), "--out", "named"], capsys).endswith("workload." + SEED)
    assert sorted(p.name for p in nothing_runs.iterdir()) == ["spec.yaml"]


def test_a_refused_profile_calibration_or_wall_leaves_no_folder(nothing_runs, capsys):
    profile = ["profile", "--model", "kimi-linear-48b", "--variant", "tiny", "--device", "cpu", "--out", "p.yaml"]
    assert refused(profile + ["--lengths", "1"], capsys) == ("prfaas profile: error: --lengths: give comma-separated whole numbers >= 2, "
                                                             "e.g. 256,512,1K")
    assert refused(profile + ["--depth", "999"], capsys).startswith("prfaas profile: error: --depth: 999 is not within 1..")
    assert refused(["profile", "--model", "nosuch", "--out", "p.yaml"], capsys).startswith("prfaas profile: error: ")
    (nothing_runs / "pdir").mkdir()  # an IsADirectoryError traceback after the whole timing, until 2026-12-07
    assert refused(profile[:-1] + ["pdir"], capsys) == "prfaas profile: error: argument --out: 'pdir' is a folder; name a file"
    (nothing_runs / "pdir").rmdir()
    assert refused(["calibrate", "quick", "--set", "seed=-1", "--json", "c.json"], capsys).endswith(SEED)
    # iperf3 refused it mid-calibration; it runs -t ceil(1 s omit + duration), so 86400 (or 86399.5) made -t 86401
    for duration in ("1e9", "86400", "86399.5"):
        assert refused(["calibrate", "quick", "--duration", duration], capsys).endswith(
            f"argument --duration: {duration} is more than 86399 s, iperf3's longest run (86400 s) less the 1 s omit")
    assert refused(["wall", "--plots", "d", "--measured", "nosuch.yaml"], capsys).startswith("prfaas wall: error: ")
    assert refused(["wall", "--measure", "nosuch", "--save", "d"], capsys).startswith("prfaas wall: error: ")
    assert refused(["wall", "--save", "d"], capsys) == "prfaas wall: error: --save d: it writes the points --measure times; add --measure [MODEL ...]"  # ignored before
    assert list(nothing_runs.iterdir()) == []


def test_a_refused_lab_start_or_trace_leaves_no_folder(nothing_runs, capsys):
    assert refused(["lab", "start", "99", "--dir", "d"], capsys).startswith("prfaas lab start: error: lab 99: no such lab")
    assert refused(["traffic", "generate", "quick", "--set", "seed=-1", "--out", "t.jsonl"], capsys).endswith(SEED)
    assert list(nothing_runs.iterdir()) == []


def test_the_folder_is_made_once_the_checks_pass(tmp_path):
    from testbed.atomic import make_output_dir

    assert make_output_dir(tmp_path / "a" / "b", lambda: "plan") == "plan" and (tmp_path / "a" / "b").is_dir()
    with pytest.raises(ValueError):
        make_output_dir(tmp_path / "c", lambda: int("x"))
    assert not (tmp_path / "c").exists()


def test_calibrate_runs_at_most_iperf3s_128_streams(nothing_runs, capsys):
    """`--streams 200` passed and iperf3 refused it ("number of parallel streams too large (maximum = 128)") once the
    network was up: the same reader as a cross-traffic flow's `streams` (traffic.cross.IPERF3_MAX_STREAMS)."""
    assert refused(["calibrate", "quick", "--streams", "129"], capsys) == (
        "prfaas calibrate: error: argument --streams: 129 is more than 128, the most parallel streams iperf3 runs (-P)")
    assert list(nothing_runs.iterdir()) == []


def test_a_multi_run_command_resolves_scale_auto_before_its_first_run(nothing_runs, capsys, monkeypatch):
    """`experiments.engine.check_run` resolves `scale: auto` at this host's capacity, as a run would: a LAN of 100 Kbps at
    the scale a 100 Gbps WAN takes on a 5 Gbps host (20) is 5 Kbps on the wire, refused before the sweep's first run (it
    failed each run instead)."""
    monkeypatch.setenv("PRFAAS_CAPACITY_BPS", "5e9")
    line = refused(["sweep", "quick", "--grid", "scale=auto", "--grid", "wan.rate=100Gbps", "--grid", "topology.lan_rate=100Kbps",
                    "--out", "named"], capsys)
    assert "scale: auto (here 20, for a host capacity of 5 Gbps) puts topology.lan_rate, 100 Kbps, at 5000 bps" in line
    assert list(nothing_runs.iterdir()) == []


def _quick_as(path: Path, named: bool) -> Path:
    """topologies/quick.yaml copied to `path`, with its `name: quick` or without a name."""
    text = (Path(__file__).resolve().parents[2] / "topologies" / "quick.yaml").read_text()
    lines = [line for line in text.splitlines() if named or not line.startswith("name:")]
    path.write_bytes("\n".join(lines).encode() + b"\n")
    return path


def test_capacity_names_its_default_folder_by_the_scenarios_name_as_run_does(nothing_runs, capsys, monkeypatch):
    """`prfaas capacity SCENARIO` named runs/capacity-<stem>-<time> by the file's stem unchecked: a 245-byte file name
    with a `name:` in it was "cannot create this folder (File name too long)" once every check had passed, and a file
    name that is not UTF-8 named the folder with it. The folder is named by the scenario's name now, as `prfaas run`
    names its run directory (`validation.name_or_stem`); a file without `name:` whose name cannot be one is refused
    in one line naming `name`, by `run` and `capacity` alike."""
    import os

    from experiments import capacity

    made: list[Path] = []

    class Started(Exception):
        pass

    def started(scenario, overrides, out, **kw):
        made.append(Path(out))
        raise Started

    monkeypatch.setattr(capacity, "measure_capacity", started)
    for stem in ("a" * 245, os.fsdecode(b"x\xff")):
        made.clear()
        with pytest.raises(Started):
            main(["capacity", str(_quick_as(nothing_runs / f"{stem}.yaml", named=True))])
        assert len(made) == 1 and made[0].parent == Path("runs") and made[0].name.startswith("capacity-quick-")
        assert made[0].is_dir() and len(made[0].name) == len("capacity-quick-") + 15
    long = _quick_as(nothing_runs / ("b" * 245 + ".yaml"), named=False)
    for command in (["run"], ["capacity"]):
        line = refused(command + [str(long)], capsys)
        assert "name: not given, and the file's name cannot stand for it: 'bbbbbbbbbbbbbbbbbbbbbbbb'... is 245 bytes long" in line
    assert all(p.name.startswith("capacity-quick-") for p in (nothing_runs / "runs").iterdir())  # the refusals made none


def test_a_sweep_labels_its_rows_by_the_scenarios_name_not_the_files(nothing_runs, monkeypatch):
    """A sweep's rows in results.parquet were labelled ``sweep <the file's stem>`` unchecked: a file name that is not
    UTF-8 text (a lone surrogate once decoded) failed the parquet write after every run. Now ``sweep <name>``, the
    scenario's name as `prfaas run` reads it."""
    import os
    from types import SimpleNamespace

    from experiments import experiment, sweep

    labels: list[str] = []

    class Written(Exception):
        pass

    def row(outcome, out, *, experiment, **kw):
        labels.append(experiment)
        raise Written

    monkeypatch.setattr(sweep, "run_tasks", lambda tasks, executor, label: {t.key: SimpleNamespace(status="ok", error=None)
                                                                           for t in tasks})
    monkeypatch.setattr(experiment, "run_row", row)
    path = _quick_as(nothing_runs / os.fsdecode(b"x\xff.yaml"), named=True)  # x\udcff.yaml
    with pytest.raises(Written):
        sweep.run_sweep(str(path), ["seed=1,2"], nothing_runs / "out")
    assert labels == ["sweep quick"]


def test_scale_auto_is_checked_at_a_runs_share_of_the_host_under_local_n(nothing_runs, capsys, monkeypatch):
    """`check_run` resolved `scale: auto` at this host's whole capacity, but under `--executor local:N` each of the N
    runs is given capacity / N (`experiments.parallel`) and resolves a larger scale: a 200 Kbps LAN beside a 100 Gbps WAN
    passed at 5 Gbps (scale 20: 10 Kbps on the wire) and each run of local:2 (2.5 Gbps: scale 40, 5 Kbps) was refused an
    hour in. The check resolves at what the executor's runs resolve at (`Executor.run_capacity_bps`)."""
    from experiments.engine import check_run
    from experiments.executor import make_executor
    from testbed.errors import FieldError
    from testbed.scale import Scale

    monkeypatch.setattr("testbed.net.emulation.host_capacity_bps", lambda: (5e9, "a stub"))
    monkeypatch.setattr("testbed.fidelity.check_parallelism", lambda n, cores: None)  # whatever this host's cores
    overrides = ["scale=auto", "wan.rate=100Gbps", "topology.lan_rate=200Kbps"]
    says = "scale: auto (here 40, for a host capacity of 2.5 Gbps) puts topology.lan_rate, 200 Kbps, at 5000 bps"
    grid = [a for o in overrides for a in ("--grid", o)]
    assert says in refused(["sweep", "quick", *grid, "--out", "named", "--executor", "local:2"], capsys)
    assert says in refused(["capacity", "quick", *(a for o in overrides for a in ("--set", o)), "--executor", "local:2"], capsys)
    spec = nothing_runs / "spec.yaml"
    spec.write_text("scenario: quick\nset: {scale: auto, wan.rate: 100Gbps, topology.lan_rate: 200Kbps}\narms: {a: {}}\n")
    assert says in refused(["experiment", str(spec), "--out", "named", "--executor", "local:2"], capsys)
    assert sorted(p.name for p in nothing_runs.iterdir()) == ["spec.yaml"]
    local, two = make_executor("local"), make_executor("local:2")
    assert (local.run_capacity_bps(), two.run_capacity_bps()) == (5e9, 2.5e9)
    assert float(two._child_env()["PRFAAS_CAPACITY_BPS"]) == two.run_capacity_bps()  # what each run is given, checked
    assert check_run("quick", overrides, executor=local).resolve_scale(5e9) == Scale(20)  # the whole host: 10 Kbps, taken
    assert check_run("quick", overrides).resolve_scale(5e9) == Scale(20)  # (no executor: one run alone, the same)
    with pytest.raises(FieldError) as exc:
        check_run("quick", overrides, executor=two)
    assert says in str(exc.value)


def test_an_output_file_option_refuses_a_path_no_file_can_be_written_at(tmp_path, monkeypatch):
    """`validation.output_file_option`, the argparse type of every option naming a file a command writes: one line
    before any work, for what would fail (or do harm) only when the file is written, after the work."""
    import argparse
    import os

    from testbed.validation import output_file_option

    def why(text: str) -> str:
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            output_file_option(text)
        return str(exc.value)

    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "to-file").symlink_to(tmp_path / "file.txt")
    assert why("") == "'' is no path; name a file" and why(" ") == "' ' is no path; name a file"
    assert why(str(tmp_path)) == f"{str(tmp_path)!r} is a folder; name a file"
    assert why(".") == "'.' is a folder; name a file"
    assert why(f"{tmp_path}/new/") == f"'{tmp_path}/new/' ends in '/', as a folder's name does; name a file"
    assert why(str(tmp_path / "dangling")) == f"{str(tmp_path / 'dangling')!r} is a link to nowhere; name a file"
    assert why("/dev/null") == "'/dev/null' is no plain file (a device, pipe or socket); name a file"  # it would be replaced
    assert why(str(tmp_path / "file.txt" / "c.json")) == f"{str(tmp_path / 'file.txt' / 'c.json')!r}: {tmp_path / 'file.txt'} is a file where a folder goes"
    assert why(str(tmp_path / "dangling" / "c.json")).endswith(f"{tmp_path / 'dangling'} is a link to nowhere where a folder goes")
    assert why(str(tmp_path / "no" / "such" / "c.json")) == (f"{str(tmp_path / 'no' / 'such' / 'c.json')!r}: the folder "
                                                              f"{tmp_path / 'no' / 'such'} does not exist; make it first (or name a "
                                                              "file in another folder)")
    assert not (tmp_path / "no").exists()
    long = str(tmp_path / ("x" * 250 + ".json"))  # 243-255 bytes: no room for the temporary name it is written under first
    assert why(long) == f"{long[:60]!r}...: the file's name is 255 bytes; at most 200 (the testbed writes it under a longer temporary name first)"
    assert output_file_option(str(tmp_path / ("x" * 195 + ".json"))) == tmp_path / ("x" * 195 + ".json")
    for ok in ("c.json", tmp_path / "c.json", tmp_path / "file.txt", tmp_path / "to-file"):  # new, or replaced (a link: by a file)
        assert output_file_option(str(ok)) == Path(ok)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only file system, or no permission
    assert why(str(tmp_path / "c.json")) == (f"{str(tmp_path / 'c.json')!r}: no file can be made in the folder {tmp_path} "
                                             "(no permission, or a read-only file system)")


@pytest.mark.parametrize("argv", [["calibrate", "quick", "--json"], ["net", "up", "quick", "--telemetry"],
                                  ["profile", "--model", "kimi-linear-48b", "--out"], ["traffic", "generate", "quick", "--out"]])
def test_every_command_refuses_a_folder_as_its_output_file_before_it_starts(nothing_runs, capsys, argv):
    """`calibrate --json DIR` and `net up --telemetry DIR` ran the network and then failed to write; `traffic generate
    --out DIR` generated the whole trace first (2026-12-07)."""
    (nothing_runs / "adir").mkdir()
    cmd = " ".join(argv[:2] if argv[0] in ("net", "traffic") else argv[:1])
    assert refused([*argv, "adir"], capsys) == f"prfaas {cmd}: error: argument {argv[-1]}: 'adir' is a folder; name a file"
    assert refused([*argv, "new/t"], capsys) == (f"prfaas {cmd}: error: argument {argv[-1]}: 'new/t': the folder new does not "
                                                 "exist; make it first (or name a file in another folder)")
    assert [p.name for p in nothing_runs.iterdir()] == ["adir"] and list((nothing_runs / "adir").iterdir()) == []


def test_an_empty_wall_save_or_plots_is_refused_not_read_as_none(nothing_runs, capsys):
    """`wall --save ""` printed the table and exited 0, as if no --save was given."""
    for opt in ("--save", "--plots"):
        assert refused(["wall", opt, ""], capsys) == f"prfaas wall: error: argument {opt}: '' is no path; name a file or folder"


def test_the_probe_receiver_refuses_a_folder_before_it_listens(tmp_path, capsys):
    """`python -m traffic.probes recv --out DIR` waited for its probes, then was an IsADirectoryError traceback."""
    from traffic import probes

    with pytest.raises(SystemExit) as exc:
        probes.main(["recv", "--count", "1", "--timeout", "0.1", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"argument --out: {str(tmp_path)!r} is a folder; name a file")


@pytest.mark.parametrize("script, options", [("experiments_bench.py", ("--out", "--reuse")), ("signals_bench.py", ("--out", "--measure")),
                                             ("case_study.py", ("--out", "--measure")), ("scale_out_bench.py", ("--out",)),
                                             ("transport_bench.py", ("--trace",))])
def test_a_benchmarks_empty_folder_option_is_refused_not_read_as_none(nothing_runs, capsys, monkeypatch, script, options):
    """The benchmarks' folders had no argparse type: `--out ""` ran in the current folder, `--measure ""` (`--reuse ""`)
    started new runs instead of reading DIR's (2026-12-07). They are `validation.path_option`, as the commands' are."""
    import runpy
    import sys

    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / script), run_name="bench")
    for option in options:
        monkeypatch.setattr(sys, "argv", [script, option, ""])
        with pytest.raises(SystemExit) as exc:
            bench["main"]()
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"{script}: error: argument {option}: '' is no path; name a file or folder"
    assert list(nothing_runs.iterdir()) == []


def test_a_schedule_step_whose_queue_tc_cannot_hold_is_refused_before_any_run_as_prfaas_check_refuses_it(nothing_runs, capsys,
                                                                                                       monkeypatch):
    """`experiments.engine.check_run` checked the base WAN only: a 2-s delay step under a 100bdp queue (23 GiB on the
    wire, past tc's 32-bit byte limit) passed every multi-run command and failed each run when the run applied it. It
    is refused now before the first run and before any folder is made, in `prfaas check`'s words
    (`analysis.scenario_check.check_schedule_queues`), at every scale the runs may resolve."""
    bad = ["wan.queue=100bdp", "wan.schedule=[{at: 5s, delay: 2s, for: 5s}]"]
    says = ("wan.queue: 23.28 GiB on the wire (100 bdp at 0.5 Gbps on the wire and a 4000 ms round trip), more than 4294967295 "
            "bytes (4 GiB - 1), the most a queue's byte limit holds (tc's is 32-bit); use a smaller queue, or a larger scale "
            "(at 5s of wan.schedule: change prfaas_to_pd+pd_to_prfaas delay 2 s, prfaas_to_pd)")
    sets = [a for o in bad for a in ("--set", o)]
    assert refused(["check", "quick", *sets], capsys) == f"prfaas check: error: {says}"
    assert refused(["capacity", "quick", *sets], capsys) == f"prfaas capacity: error: {says}"
    assert refused(["capacity", "quick", *sets, "--out", "named"], capsys) == f"prfaas capacity: error: {says}"
    spec = nothing_runs / "spec.yaml"
    spec.write_text("scenario: quick\nset: {wan.queue: 100bdp}\narms: {a: {}, b: {'wan.schedule': [{at: 5s, delay: 2s, for: 5s}]}}\n")
    # the run that sets it is named: arm b (its schedule) of seed 1, the first run checked
    assert refused(["experiment", str(spec), "--out", "named"], capsys) == f"prfaas experiment: error: arm b, seed 1: {says}"
    base = ("wan.queue: 11.64 GiB on the wire (100 bdp at 0.5 Gbps on the wire and a 2000 ms round trip), more "
            "than 4294967295 bytes (4 GiB - 1)")  # no schedule: the start, as prfaas check plans it (the run's network refused it)
    assert refused(["check", "quick", "--set", "wan.schedule=[]", "--set", "wan.queue=100bdp", "--set", "wan.delay=1s"],
                   capsys).startswith("prfaas check: error: " + base)
    assert refused(["sweep", "quick", "--grid", "wan.schedule=[]", "--grid", "wan.queue=100bdp", "--grid", "wan.delay=5ms,1s",
                    "--out", "named"], capsys).startswith(
        "prfaas sweep: error: grid point wan.schedule=[],wan.queue=100bdp,wan.delay=1s: " + base)
    assert sorted(p.name for p in nothing_runs.iterdir()) == ["spec.yaml"]  # no run, no folder
    # scale: auto is checked at the scale each host resolves: a 200-ms step fits at scale 10, not at 1 (a 5 Gbps host)
    monkeypatch.setattr("testbed.net.emulation.host_capacity_bps", lambda: (5e9, "a stub"))
    from experiments.engine import check_run
    from testbed.errors import UserError

    step = ["wan.queue=100bdp", "wan.schedule=[{at: 5s, delay: 200ms, for: 5s}]"]
    assert check_run("quick", step).scale == 10
    with pytest.raises(UserError, match=r"^wan.queue: 23.28 GiB on the wire \(100 bdp at 5 Gbps on the wire and a 400 ms round "
                                        r"trip\), .* \(at 5s of wan.schedule: change prfaas_to_pd\+pd_to_prfaas delay 200 ms, "
                                        r"prfaas_to_pd\)$"):
        check_run("quick", ["scale=auto", *step])


@pytest.mark.parametrize("argv", [["lab", "start", "1", "--dir"], ["traffic", "generate", "quick", "--out"],
                                  ["sweep", "quick", "--grid", "seed=1", "--out"]])
def test_a_path_with_a_nul_byte_or_a_name_past_255_bytes_is_refused_before_it_is_used(nothing_runs, capsys, argv):
    """`lab start --dir` made its folders with a ValueError (a NUL byte) or an OSError (File name too long) traceback;
    `traffic generate --out 'a<NUL>b'` drew the whole trace, then was a ValueError traceback (fuzzing pass 5, 2026-12-08)."""
    cmd = " ".join(argv[:2] if argv[0] in ("lab", "traffic") else argv[:1])
    assert refused([*argv, "a\0b"], capsys) == (f"prfaas {cmd}: error: argument {argv[-1]}: 'a\\x00b' holds a NUL byte, which "
                                                f"no path can; name a file{'' if argv[0] == 'traffic' else ' or folder'}")
    long = "new/" + "y" * 256
    assert refused([*argv, long], capsys) == (f"prfaas {cmd}: error: argument {argv[-1]}: {'y' * 60!r}... (256 characters) is "
                                              f"256 bytes, and a file or folder name is at most 255; name a file"
                                              f"{'' if argv[0] == 'traffic' else ' or folder'}")
    assert list(nothing_runs.iterdir()) == []
