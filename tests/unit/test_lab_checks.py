"""The lab checkers on run directories written by the project's run-directory writer (tests/unit/rundir_factory):
answers computed here independently of the checker hold; a wrong one is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from labs.catalog import list_labs
from labs.checks import CHECKERS, paired_ci95

sys.path.insert(0, str(Path(__file__).parent))
from rundir_factory import write_run_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _verdicts(lab: int, answers: dict, runs: dict[str, Path]) -> dict[str, bool]:
    return {v.question: v.holds for v in CHECKERS[lab](answers, runs)}


def _requests(d: Path) -> pd.DataFrame:
    return pd.read_parquet(d / "requests.parquet")


def test_five_labs_each_with_handout_scenarios_questions_and_answers_template() -> None:
    labs = list_labs()
    assert [lab.number for lab in labs] == [1, 2, 3, 4, 5]
    for lab in labs:
        assert lab.minutes <= 15
        assert lab.answers in lab.handout.read_text() or "answers.yaml" in lab.handout.read_text()
        for f in lab.files:
            assert (lab.folder / f).is_file(), f
        assert any(f.endswith(".yaml") and f != lab.answers for f in lab.files)
        assert yaml.safe_load((lab.folder / lab.answers).read_text())  # the template parses
        assert set(CHECKERS) >= {lab.number}


def test_every_lab_scenario_passes_prfaas_check() -> None:
    from analysis.scenario_check import check_scenario
    from testbed.sections import load_scenario

    for lab in list_labs():
        for f in lab.files:
            if f.endswith(".yaml") and f not in (lab.answers, "experiment.yaml"):  # experiment.yaml: a spec (test below)
                check_scenario(load_scenario(str(lab.folder / f)))


def test_lab_start_and_show_work_from_any_directory(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH="")
    r = subprocess.run([sys.executable, "-m", "testbed.cli", "lab", "start", "3"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "lab3" / "answers.yaml").is_file() and (tmp_path / "lab3" / "scenario.yaml").is_file()
    assert (tmp_path / "lab3" / "runs").is_dir()
    again = subprocess.run([sys.executable, "-m", "testbed.cli", "lab", "start", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.count("\n") == 1  # never overwrites a student's answers
    show = subprocess.run([sys.executable, "-m", "testbed.cli", "lab", "show", "9"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert show.returncode == 2 and "no such lab" in show.stderr


def test_lab_start_writes_no_file_through_a_link_into_a_folder_or_over_an_edited_scenario(tmp_path: Path) -> None:
    """A link where a lab file goes was written through (to a file outside the folder), a folder took the file inside
    it, an edited scenario was overwritten without --force, and a file named runs was a FileExistsError traceback."""
    from labs.catalog import get_lab, start_lab
    from testbed.errors import UserError

    lab = get_lab(1)
    scenario = next(f for f in lab.files if f.endswith(".yaml") and f != lab.answers)
    precious = tmp_path / "precious"
    precious.write_text("mine")
    cases = {"link": lambda d: (d / scenario).symlink_to(precious), "folder": lambda d: (d / scenario).mkdir(),
             "edited": lambda d: (d / scenario).write_text("edited"), "runs": lambda d: (d / "runs").write_text("x")}
    for case, make in cases.items():
        d = tmp_path / case
        d.mkdir()
        make(d)
        for force in ((False,) if case == "edited" else (False, True)):
            with pytest.raises(UserError):
                start_lab(lab, d, force=force)
        assert not (d / lab.answers).exists()  # nothing copied: every check comes first
    assert precious.read_text() == "mine" and (tmp_path / "edited" / scenario).read_text() == "edited"
    start_lab(lab, tmp_path / "edited", force=True)  # --force overwrites the lab's own files
    assert (tmp_path / "edited" / scenario).read_text() == (lab.folder / scenario).read_text()
    assert os.access(tmp_path / "edited" / "measure.sh", os.X_OK) if "measure.sh" in lab.files else True


def test_lab_start_refuses_anything_but_a_folder_where_runs_goes_before_it_copies(tmp_path: Path) -> None:
    """runs/ is made (testbed.atomic.make_output_dir) before any file is copied: a file, a link to a file, a link to
    nowhere and a link to a folder (the runs would land outside the lab's folder) are refused, with --force too, and
    a runs folder already there is kept with what it holds."""
    from labs.catalog import get_lab, start_lab
    from testbed.errors import UserError

    lab = get_lab(1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cases = {"file": lambda r: r.write_text("x"), "link to a file": lambda r: r.symlink_to(tmp_path / "precious"),
             "link to nowhere": lambda r: r.symlink_to(tmp_path / "gone"), "link to a folder": lambda r: r.symlink_to(elsewhere)}
    (tmp_path / "precious").write_text("mine")
    for case, make in cases.items():
        d = tmp_path / case.replace(" ", "-")
        d.mkdir()
        make(d / "runs")
        for force in (False, True):
            with pytest.raises(UserError, match=f"{d / 'runs'}: .*(where a folder goes|a link where the lab's runs folder goes)"):
                start_lab(lab, d, force=force)
        assert sorted(p.name for p in d.iterdir()) == ["runs"], case  # nothing copied
    assert not list(elsewhere.iterdir()) and (tmp_path / "precious").read_text() == "mine"
    kept = tmp_path / "kept"
    (kept / "runs" / "r1").mkdir(parents=True)
    start_lab(lab, kept)
    assert (kept / lab.answers).is_file() and (kept / "runs" / "r1").is_dir()


def _ttft(df: pd.DataFrame) -> pd.Series:
    return df["first_token_s"] - df["arrival_s"]


def test_lab3_checker_recomputes_ttft_throughput_and_the_best_threshold(tmp_path: Path) -> None:
    runs = {f"t{t}": write_run_dir(tmp_path / f"t{t}", policy="fixed-threshold", threshold=t, seed=3) for t in (4096, 16384, 65536)}
    answers: dict = {"runs": {}}
    for name, d in runs.items():
        df = _requests(d)
        ok = df[df["status"] == "ok"]
        span = df["finish_s"].max() - df["arrival_s"].min()
        answers["runs"][name] = {"threshold_tokens": int(df["threshold"].iloc[0]), "ttft_p90_s": float(np.percentile(_ttft(ok), 90)),
                                 "throughput_rps": len(ok) / span}
    rows = answers["runs"]
    top = max(r["throughput_rps"] for r in rows.values())
    best = min((r for r in rows.values() if r["throughput_rps"] >= 0.95 * top), key=lambda r: r["ttft_p90_s"])
    answers["best_threshold_tokens"] = best["threshold_tokens"]
    answers["model_t_star_tokens"] = 1  # deliberately wrong
    v = _verdicts(3, answers, runs)
    assert v.pop("model_t_star_tokens") is False
    assert all(v.values()), v
    answers["runs"]["t16384"]["ttft_p90_s"] *= 1.5
    v = _verdicts(3, answers, runs)
    assert [k for k, ok in v.items() if not ok] == ["runs.t16384.ttft_p90_s", "model_t_star_tokens"]


def _p90_in_dip(d: Path, lo: float = 10.0, hi: float = 20.0) -> float:
    df = _requests(d)
    dip = df[(df["arrival_s"] >= lo) & (df["arrival_s"] < hi)]
    return float(np.percentile(_ttft(dip).where(dip["status"] == "ok", np.inf), 90, method="higher"))


def test_lab4_checker_recomputes_the_paired_confidence_interval(tmp_path: Path) -> None:
    runs = {}
    for seed in (1, 2, 3):
        # the synthetic prfaas run keeps more requests local (higher t): less KV in the dip
        runs[f"p{seed}"] = write_run_dir(tmp_path / f"p{seed}", policy="prfaas", threshold=40000, seed=seed)
        runs[f"f{seed}"] = write_run_dir(tmp_path / f"f{seed}", policy="fixed-threshold", threshold=8000, seed=seed)
    p = [_p90_in_dip(runs[f"p{s}"]) for s in (1, 2, 3)]
    f = [_p90_in_dip(runs[f"f{s}"]) for s in (1, 2, 3)]
    d = np.subtract(f, p)
    half = 4.302652729911275 * d.std(ddof=1) / np.sqrt(3)  # t(0.975, 2)
    lo, hi = d.mean() - half, d.mean() + half
    answers = {"ttft_p90_dip_s": {"prfaas": float(np.mean(p)), "fixed-threshold": float(np.mean(f))},
               "difference_ci95_s": [float(lo), float(hi)], "prfaas_better": "yes" if lo > 0 else ("no" if hi < 0 else "unclear")}
    assert all(_verdicts(4, answers, runs).values())
    answers["prfaas_better"] = {"yes": "no", "no": "yes", "unclear": "yes"}[answers["prfaas_better"]]
    assert [k for k, ok in _verdicts(4, answers, runs).items() if not ok] == ["prfaas_better"]


def test_answers_are_found_under_run_names_that_hold_dots() -> None:
    from labs.answers import lookup

    answers = {"runs": {"q0.25": {"goodput_mbps": 80}, "q0": {"25": {"goodput_mbps": 1}}, 2048: {"x": 3}}}
    assert lookup(answers, "runs.q0.25.goodput_mbps") == 80
    assert lookup(answers, "runs.2048.x") == 3
    assert lookup(answers, "runs.q4.goodput_mbps") is None


def test_paired_ci95_matches_student_t() -> None:
    mean, lo, hi = paired_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302652729911275 * 1.0 / np.sqrt(3))


def test_lab5_checker_counts_failures_reasons_and_recovery(tmp_path: Path) -> None:
    runs = {name: write_run_dir(tmp_path / name, seed=seed, rate_rps=4.0) for name, seed in (("loss", 1), ("outage", 2), ("kill", 3))}
    answers: dict = {"runs": {}}
    for name, d in runs.items():
        df = _requests(d)
        ok = df[df["status"] == "ok"]
        after = df[df["arrival_s"] >= 20.0 + 5.0]  # the factory's dip ends at 20 s
        answers["runs"][name] = {"requests_ok": len(ok), "requests_failed": len(df) - len(ok),
                                 "ttft_p99_s": float(np.percentile(_ttft(ok), 99)),
                                 "main_failure_reason": "unknown" if len(ok) < len(df) else "none",  # the factory writes no reason
                                 "recovered": "yes" if (after["status"] == "ok").mean() >= 0.9 else "no"}
    assert all(_verdicts(5, answers, runs).values())
    answers["runs"]["outage"]["requests_failed"] += 1
    assert [k for k, ok in _verdicts(5, answers, runs).items() if not ok] == ["runs.outage.requests_failed"]


def test_lab_check_command_exit_status_and_one_line_errors(tmp_path: Path) -> None:
    from testbed import cli

    runs = tmp_path / "runs"
    for name, seed in (("loss", 1), ("outage", 2), ("kill", 3)):
        write_run_dir(runs / name, seed=seed)
    (tmp_path / "answers.yaml").write_text(yaml.safe_dump({"runs": {"loss": {}, "outage": {}, "kill": {}}}))
    assert cli.main(["lab", "check", "5", "--answers", str(tmp_path / "answers.yaml")]) == 1  # blanks are wrong answers
    (tmp_path / "bad.yaml").write_text("runs: [")
    assert cli.main(["lab", "check", "5", "--answers", str(tmp_path / "bad.yaml")]) == 2
    (tmp_path / "few.yaml").write_text(json.dumps({"runs": {"loss": {}}}))
    assert cli.main(["lab", "check", "5", "--answers", str(tmp_path / "few.yaml")]) == 2


def test_lab_check_finds_the_answers_file_from_inside_the_lab_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed import cli

    lab = tmp_path / "lab5"
    for name, seed in (("loss", 1), ("outage", 2), ("kill", 3)):
        write_run_dir(lab / "runs" / name, seed=seed)
    (lab / "answers.yaml").write_text(yaml.safe_dump({"runs": {"loss": {}, "outage": {}, "kill": {}}}))
    monkeypatch.chdir(lab)
    assert cli.main(["lab", "check", "5"]) == 1  # found and read (blank answers are wrong), not exit 2
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lab", "check", "5"]) == 1  # from the parent: lab5/answers.yaml


def test_lab4_reads_the_experiment_engines_layout_and_its_spec_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.spec import load_spec
    from labs.catalog import get_lab
    from labs.commands import resolve_runs

    spec = load_spec(get_lab(4).folder / "experiment.yaml")
    assert {a.name for a in spec.arms} == {"prfaas", "fixed-threshold"} and spec.seeds == (1, 2, 3)
    for seed in (1, 2, 3):  # prfaas experiment writes runs/<arm>/seed<s>-rep1
        write_run_dir(tmp_path / "runs" / "prfaas" / f"seed{seed}-rep1", policy="prfaas", threshold=40000, seed=seed)
        write_run_dir(tmp_path / "runs" / "fixed-threshold" / f"seed{seed}-rep1", policy="fixed-threshold", threshold=8000, seed=seed)
    found = resolve_runs({}, tmp_path / "answers.yaml", [])
    assert len(found) == 6 and "prfaas/seed1-rep1" in found
    given = resolve_runs({}, tmp_path / "answers.yaml", sorted((tmp_path / "runs").glob("*/*")))
    assert len(given) == 6  # folders sharing a name are told apart by their path
    verdicts = CHECKERS[4]({}, found)
    assert [v.question for v in verdicts] == ["ttft_p90_dip_s.prfaas", "ttft_p90_dip_s.fixed-threshold", "difference_ci95_s", "prfaas_better"]


def test_an_unquoted_yes_or_no_answer_is_judged_as_the_word_the_student_wrote(tmp_path: Path) -> None:
    from labs.answers import choice, load_answers

    path = tmp_path / "answers.yaml"
    path.write_text("prfaas_better: yes\nother: no\n")  # YAML 1.1 reads both as bools
    answers = load_answers(path)
    right = choice(answers, "prfaas_better", "yes")
    assert right.holds and "you wrote 'yes'" in right.why
    assert not choice(answers, "other", ("yes", "unclear")).holds
    assert choice(answers, "other", "no").holds


def _lab1_folder(d: Path) -> Path:
    check = {"directions": [{"direction": "prfaas_to_pd", "wire_rate_bps": 1e8, "rtt_s": 0.04, "queue_wire_bytes": 500000},
                            {"direction": "pd_to_prfaas", "wire_rate_bps": 1e8, "rtt_s": 0.04, "queue_wire_bytes": 500000}]}
    d.mkdir(parents=True)
    (d / "check.json").write_text(json.dumps(check))
    (d / "iperf3.json").write_text(json.dumps({"end": {"sum_received": {"bits_per_second": 9.5e7}}}))
    ping = "".join(f"64 bytes from 10.0.0.2: icmp_seq={i} ttl=64 time={40 + i:.1f} ms\n" for i in range(5))
    (d / "ping-idle.txt").write_text(ping)
    (d / "ping-loaded.txt").write_text(ping)
    return d


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / "ping-idle.txt").write_bytes(b"time=40.0 ms caf\xe9\n"), r"q1/ping-idle.txt: not UTF-8 text \(at byte offset 16\); the output of ping"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "prfaas_to_pd", "rtt_s": 0.04, "queue_wire_bytes": 5}]}'),
     r"q1/check.json: directions\[0\].wire_rate_bps: is required"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "prfaas_to_pd", "wire_rate_bps": 0, "rtt_s": 0.04, "queue_wire_bytes": 5}]}'),
     r"q1/check.json: directions\[0\].wire_rate_bps: 0 must be > 0"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "prfaas_to_pd", "wire_rate_bps": 1e8, "rtt_s": 0.04, "queue_wire_bytes": null}]}'),
     r"directions\[0\].queue_wire_bytes: is required"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "pd_to_prfaas"}]}'), r"check.json: directions: no entry with direction prfaas_to_pd"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "prfaas_to_pd", "wire_rate_bps": 1e8, "rtt_s": 0.04, '
                                             '"queue_wire_bytes": 1' + "0" * 400 + '}]}'),
     r"directions\[0\].queue_wire_bytes: a 401-digit number is out of range"),
    (lambda d: (d / "check.json").write_text('{"directions": [{"direction": "prfaas_to_pd", "wire_rate_bps": 1e8, "rtt_s": 0.04, '
                                             '"queue_wire_bytes": 1e308}]}'),  # an OverflowError in the drain time before
     r"directions\[0\].queue_wire_bytes: 1e\+308 is not a queue `prfaas check` reports \(at most 2\*\*53 bytes\)"),
    (lambda d: (d / "check.json").write_text('{"directions": {"a": 1}}'), r"check.json: directions: must be a list, got dict"),
    (lambda d: (d / "iperf3.json").write_text('{"end": {"sum_received": {"bits_per_second": "fast"}}}'),
     r"iperf3.json: end.sum_received.bits_per_second: 'fast' is not a number"),
    (lambda d: (d / "ping-loaded.txt").write_text("time=1.2.3 ms\n"), r"q1/ping-loaded.txt: no ping replies in it"),
])
def test_a_damaged_lab1_folder_is_one_line_naming_the_file_and_field(tmp_path: Path, damage, match) -> None:
    """Hand-edited or damaged measurement files were KeyError, TypeError, ZeroDivisionError (a rate of 0),
    UnicodeDecodeError or float() tracebacks before 2026-12-07."""
    from labs.checks import read_queue_measurement
    from testbed.errors import UserError

    d = _lab1_folder(tmp_path / "q1")
    assert read_queue_measurement(d).queue_bytes == 500000
    damage(d)
    with pytest.raises(UserError, match=match):
        read_queue_measurement(d)


def test_an_answer_too_large_for_a_float_is_not_a_number(tmp_path: Path) -> None:
    from labs.answers import number

    v = number({"x": 10**400}, "x", 1.0, rel=0.1)
    assert not v.holds and v.why.startswith("1000") and "is not a number" in v.why


def test_run_directories_may_follow_the_answers_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`prfaas lab check 5 --answers a.yaml runs/x ...` was "unrecognized arguments: runs/x ..." (argparse gives a list of
    positionals only what comes before the first option), so run folders could be given only before --answers."""
    from testbed import cli

    for name, seed in (("loss", 1), ("outage", 2), ("kill", 3)):
        write_run_dir(tmp_path / "runs" / name, seed=seed)
    (tmp_path / "answers.yaml").write_text("{}\n")
    runs = [str(tmp_path / "runs" / n) for n in ("loss", "outage", "kill")]
    assert cli.main(["lab", "check", "5", "--answers", str(tmp_path / "answers.yaml"), *runs]) == 1  # read; blanks are wrong
    assert "unrecognized" not in capsys.readouterr().err
    assert cli.main(["lab", "check", "5", runs[0], "--answers", str(tmp_path / "answers.yaml"), *runs[1:]]) == 1


def test_a_name_no_file_can_have_is_no_answers_file_or_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 5000-character --answers or run folder was an OSError traceback (File name too long) from `Path.is_file` and
    `Path.is_dir` (fuzzing pass 5, 2026-12-08)."""
    from testbed import cli

    long = "x" * 5000
    assert cli.main(["lab", "check", "5", "--answers", long]) == 2
    assert capsys.readouterr().err == f"prfaas lab check: error: {long}: no answers file (`prfaas lab start N` writes the template; fill it in)\n"
    (tmp_path / "answers.yaml").write_text("{}\n")
    assert cli.main(["lab", "check", "5", "--answers", str(tmp_path / "answers.yaml"), long]) == 2
    assert capsys.readouterr().err == f"prfaas lab check: error: lab 5: run directory not found: {long}\n"


@pytest.mark.parametrize("change,match", [
    ({"seed": "one"}, r"p1/scenario.yaml: seed: 'one' is not a seed"),
    ({"policy": "prfaas"}, r"p1/scenario.yaml: policy: must be a mapping of keys to values, got str"),
])
def test_a_runs_scenario_the_checker_cannot_read_is_one_line_naming_it(tmp_path: Path, change, match) -> None:
    """Lab 4 read the run's scenario.yaml as a plain mapping: `seed: one` was a ValueError, `policy: prfaas` an
    AttributeError traceback (2026-12-07); the scenario reader names the file and the field."""
    from testbed.errors import UserError

    runs = {f"{k}{s}": write_run_dir(tmp_path / f"{k}{s}", policy=pol, seed=s)
            for s in (1, 2) for k, pol in (("p", "prfaas"), ("f", "fixed-threshold"))}
    sc = yaml.safe_load((runs["p1"] / "scenario.yaml").read_text())
    (runs["p1"] / "scenario.yaml").write_text(yaml.safe_dump({**sc, **change}))
    with pytest.raises(UserError, match=match):
        CHECKERS[4]({}, runs)


@pytest.mark.parametrize("name", ["../../outside", "/etc", "", ".", "a/../../outside", "a//b", "b/", "a\\b", "x" * 201])
def test_a_run_name_in_the_answers_names_a_folder_under_runs_and_nothing_else(tmp_path: Path, name: str,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The answers' `runs:` keys were joined to runs/ as they stood: `../../outside` read the folder beside the lab's,
    `/etc` read /etc and `''` read runs/ itself as a run (2026-12-07). Each is one line naming the file and `runs`."""
    from testbed import cli

    lab = tmp_path / "lab"
    write_run_dir(tmp_path / "outside", seed=1)
    write_run_dir(lab / "runs" / "b", seed=2)
    write_run_dir(lab / "runs" / "c", seed=3)
    (lab / "answers.yaml").write_text(yaml.safe_dump({"runs": {name: {}, "b": {}, "c": {}}}))
    assert cli.main(["lab", "check", "5", "--answers", str(lab / "answers.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "answers.yaml: runs: " in err and "is not a run name" in err, err


def test_run_names_may_be_nested_as_the_checker_names_the_runs_it_finds(tmp_path: Path) -> None:
    from labs.commands import resolve_runs

    found = resolve_runs({"runs": {"prfaas/seed1-rep1": {}, "q0.25": {}, 2048: {}}}, tmp_path / "answers.yaml", [])
    assert found == {n: tmp_path / "runs" / n for n in ("prfaas/seed1-rep1", "q0.25", "2048")}


@pytest.mark.parametrize("runs", [["q1", "q4"], "q1", 5])
def test_runs_that_is_not_a_mapping_is_refused_not_passed_over(tmp_path: Path, runs: object) -> None:
    """`runs: [q1, q4]` was passed over, and the check read every run folder below runs/ instead (2026-12-07)."""
    from labs.commands import resolve_runs
    from testbed.errors import UserError

    with pytest.raises(UserError, match=r"answers.yaml: runs: must be a mapping of run folders to their answers"):
        resolve_runs({"runs": runs}, tmp_path / "answers.yaml", [])
    assert resolve_runs({"runs": None}, tmp_path / "answers.yaml", []) == {}  # blank: every run folder (none here)


def _lab4_runs(tmp_path: Path, fixed_seeds: tuple[int, ...] = (1, 2, 3)) -> dict[str, Path]:
    runs = {f"p{s}": write_run_dir(tmp_path / f"p{s}", policy="prfaas", threshold=40000, seed=s) for s in (1, 2, 3)}
    return runs | {f"f{s}": write_run_dir(tmp_path / f"f{s}", policy="fixed-threshold", threshold=8000, seed=s) for s in fixed_seeds}


def test_lab4_refuses_two_runs_of_one_policy_and_seed(tmp_path: Path) -> None:
    """Two runs of one policy and seed (an experiment with repetitions: 2) kept one of them, unsaid (2026-12-07)."""
    from testbed.errors import UserError

    runs = _lab4_runs(tmp_path) | {"p1-rep2": write_run_dir(tmp_path / "p1-rep2", policy="prfaas", threshold=40000, seed=1)}
    with pytest.raises(UserError, match=r"runs p1 and p1-rep2 are both prfaas with seed 1"):
        CHECKERS[4]({}, runs)


def _fail_in_dip(d: Path) -> None:
    df = _requests(d)
    df.loc[(df["arrival_s"] >= 10.0) & (df["arrival_s"] < 20.0), "status"] = "failed"
    df.to_parquet(d / "requests.parquet")


@pytest.mark.parametrize("case,match", [
    ("no seed in common", r"^lab 4: a confidence interval needs at least two seeds run under both policies; got prfaas seeds "
                          r"\[1, 2, 3\]; fixed-threshold seeds \[4, 5, 6\] \(0 in common\)$"),
    ("one seed in common", r"fixed-threshold seeds \[1, 5, 6\] \(1 in common\)$"),
    ("one run failed in the dip", r"^lab 4: more than 10% of the requests in the dip failed in run f1, so its p90 TTFT is infinite"),
    ("two runs failed in the dip", r"failed in runs p2, f2, so their p90"),
])
def test_lab4_refuses_unpaired_seeds_and_failed_dips_without_numpy_warnings(tmp_path: Path, case: str, match: str) -> None:
    """Seeds run under one policy only were a mean of no seeds ("Mean of empty slice", "invalid value encountered in
    scalar divide"), a run whose dip failed an inf - inf in the interval ("invalid value encountered in subtract"):
    numpy's RuntimeWarnings printed above the refusal (2026-12-07). Refused first, in one line, with no warning."""
    import warnings

    from testbed.errors import UserError

    runs = _lab4_runs(tmp_path, {"no seed in common": (4, 5, 6), "one seed in common": (1, 5, 6)}.get(case, (1, 2, 3)))
    for name in {"one run failed in the dip": ["f1"], "two runs failed in the dip": ["p2", "f2"]}.get(case, []):
        _fail_in_dip(runs[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserError, match=match):
            CHECKERS[4]({}, runs)


def test_lab4_with_a_failed_dip_in_an_unpaired_run_checks_the_pairs(tmp_path: Path) -> None:
    import warnings

    runs = _lab4_runs(tmp_path, (1, 2, 3, 4))
    _fail_in_dip(runs["f4"])  # seed 4 has no prfaas run: not in the interval
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [v.question for v in CHECKERS[4]({}, runs)][-1] == "prfaas_better"


def test_an_ok_request_without_a_first_token_in_the_dip_is_named(tmp_path: Path) -> None:
    from testbed.errors import UserError

    runs = _lab4_runs(tmp_path)
    df = _requests(runs["p1"])
    df.loc[(df["arrival_s"] >= 10.0) & (df["arrival_s"] < 20.0) & (df["status"] == "ok"), "first_token_s"] = np.nan
    df.to_parquet(runs["p1"] / "requests.parquet")
    with pytest.raises(UserError, match=r"p1: \d+ ok request\(s\) in the dip have no first_token_s"):
        CHECKERS[4]({}, runs)


def test_paired_ci95_refuses_fewer_than_two_or_infinite_differences() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for diffs in ([], [1.0], [np.inf, 1.0], [np.nan, 1.0, 2.0]):
            with pytest.raises(ValueError, match="at least two finite differences"):
                paired_ci95(diffs)
