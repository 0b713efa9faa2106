"""The first hour: a closed pipe ends any command quietly; doctor names the next command; the README's
two commands need no sudo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.net.doctor import next_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [["--help"], ["kv-size", "--model", "kimi-linear-48b", "--tokens", "32K", "--json"],
                                  ["check", "quick"]])
def test_a_closed_pipe_ends_the_command_quietly(argv: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) is gone before the first write
    try:
        r = subprocess.run([sys.executable, "-m", "testbed.cli", *argv], stdout=write_end, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, timeout=120)
    finally:
        os.close(write_end)
    assert r.stderr == ""  # no traceback, no "Exception ignored"
    assert r.returncode == 141  # as a shell tool killed by SIGPIPE


def test_head_reads_the_first_line_and_nothing_complains() -> None:
    r = subprocess.run(f"'{sys.executable}' -m testbed.cli model --paper-case-study --json | head -n 1", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout == "{\n" and r.stderr == ""


def test_doctor_names_the_next_command() -> None:
    assert next_command([]).startswith("prfaas quickstart")
    assert next_command(["root"]).startswith("run as root")
    assert "bootstrap.sh setup" in next_command(["iperf3", "veth"])


def test_readme_commands_run_as_root_without_sudo_and_match_ci() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["bash scripts/bootstrap.sh run", "bash scripts/bootstrap.sh test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/bootstrap.sh test" in ci


STOPPABLE = """
import argparse, sys, time
from testbed import cli

def wait(args):
    print("ready", flush=True)
    try:
        time.sleep(60)
    finally:
        print("stopping my runs", flush=True)  # what a multi-run command's executor does in its finally

def parser():
    p = argparse.ArgumentParser(prog="prfaas")
    p.set_defaults(func=wait)
    return p

cli.build_parser = parser
sys.exit(cli.main([]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_command_stopped_from_outside_runs_its_cleanup_as_on_ctrl_c(sig: str) -> None:
    """`kill` of a `prfaas` command (a job scheduler, a closed terminal) ends it as Ctrl-C does: before,
    SIGTERM killed a `reproduce --executor local:2` outright and left its two runs going, orphaned."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        time.sleep(0.2)
        p.send_signal(getattr(signal, sig))
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert out == "stopping my runs\n"
    assert err == "prfaas: interrupted; cleaned up\n" and p.returncode == 130


def test_every_benchmark_ends_as_a_command_does_one_line_for_a_user_error_or_ctrl_c(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C on a long benchmark (session 45: signals_bench) printed a 30-line traceback; a `prfaas`
    command prints one line. Each benchmark's entry point now runs through the same `cli.guarded`."""
    from testbed import cli
    from testbed.errors import UserError

    def stopped() -> int:
        raise KeyboardInterrupt

    def wrong() -> int:
        raise UserError("--shapes: 'val-nope' is not one of val-dip, ...")

    assert cli.guarded("signals_bench.py", stopped) == 130
    assert cli.guarded("signals_bench.py", wrong) == 2
    assert cli.guarded("signals_bench.py", lambda: None) == 0
    assert capsys.readouterr().err == ("signals_bench.py: interrupted; cleaned up\n"
                                       "signals_bench.py: error: --shapes: 'val-nope' is not one of val-dip, ...\n")
    unguarded = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))
                 if "sys.exit(guarded(Path(__file__).name, main))" not in p.read_text()]
    assert unguarded == []


def test_doctor_names_the_default_congestion_control_that_kv_runs_and_whether_bbr_can_be_set() -> None:
    from pathlib import Path

    from testbed.net.doctor import congestion_control_check

    from testbed.kv.transport import congestion_control_refused

    c = congestion_control_check()
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    assert c.ok and not c.required and c.detail.startswith(f"default {default} ")
    assert "serving.kv_congestion_control" in c.detail
    why = congestion_control_refused("bbr")  # what this host says, either way
    assert c.detail.endswith("bbr can be set" if why is None else f"bbr: {why}")


def _leaf_parsers(parser: "argparse.ArgumentParser") -> list:
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [leaf for s in subs for p in s.choices.values() for leaf in _leaf_parsers(p)] if subs else [parser]


def test_every_command_parses_its_arguments_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """Options go anywhere among a command's positionals (`prfaas report RUN --out DIR RUN2`), except where argparse
    cannot intermix: `prfaas net exec HOST -- CMD...` (a REMAINDER) and a positional in an exclusive group. Intermixing
    those raised TypeError, a traceback for `prfaas net exec` (2026-12-07)."""
    from testbed import cli

    parser = cli.build_parser()
    leaves = _leaf_parsers(parser)
    assert len(leaves) >= 25
    for leaf in leaves:  # no argument: a usage error (exit 2) or a parse, never a TypeError
        try:
            leaf.parse_args([])
        except SystemExit as exc:
            assert exc.code == 2, leaf.prog
    capsys.readouterr()
    ex = parser.parse_args(["net", "exec", "pd-d0", "--", "ping", "-c", "1", "10.1.0.10"])
    assert (ex.host, ex.cmd) == ("pd-d0", ["ping", "-c", "1", "10.1.0.10"])
    assert parser.parse_args(["net", "exec", "pd-d0", "ping", "-c", "1"]).cmd == ["ping", "-c", "1"]
    rep = parser.parse_args(["report", "a", "--out", "d", "b"])
    assert (rep.run_dirs, rep.out) == (["a", "b"], "d")
    assert parser.parse_args(["model", "--paper-case-study", "--json"]).paper_case_study


def test_help_says_what_the_commands_do(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new user read in `--help` and found otherwise (2026-12-07): `prfaas --help` cut reproduce's line at "naive
    heterogeneous", `lab start --force` spoke of the answers file alone (it overwrites every lab file already there,
    docs/labs.md), and calibrate's SCENARIO did not say it defaults to net-default."""
    from testbed import cli

    monkeypatch.setenv("COLUMNS", "400")  # one line per option: argparse wraps at a hyphen too

    def help_of(*argv: str) -> str:
        with pytest.raises(SystemExit):
            cli.main([*argv, "--help"])
        return " ".join(capsys.readouterr().out.split())

    assert "Lambda_max of PrfaaS-PD, homogeneous PD and naive heterogeneous PD" in help_of()
    assert "--force overwrite the lab's files already there (the answers, an edited scenario)" in help_of("lab", "start")
    assert "scenario file or ready scenario name (default net-default)" in help_of("calibrate")


def test_every_option_and_argument_of_every_command_says_what_it_is_for():
    """`prfaas X --help` explains each of its options and arguments (a new user found 19 without a word, 2026-12-07)."""
    import argparse

    from testbed.cli import build_parser

    def silent(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
        out = []
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    out += silent(sub, path + (name,))
            elif not isinstance(a, argparse._HelpAction) and not a.help:
                out.append(f"prfaas {' '.join(path)} {'/'.join(a.option_strings) or a.dest}")
        return out

    assert silent(build_parser(), ()) == []


def test_an_interrupted_run_names_the_folder_it_left_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C of `prfaas run` said "interrupted; cleaned up" and not that its run folder was left without a summary
    (session 68's kill campaign); the folder is named in a second line, and only while it is incomplete."""
    import testbed.runner.run as runner
    from experiments.runs import run_once
    from testbed.cli import guarded

    def interrupted(scenario, out_dir, **kw):
        out_dir.mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_scenario", interrupted)
    out = tmp_path / "r"
    assert guarded("prfaas run", lambda: run_once(None, out)) == 130  # type: ignore[arg-type]
    assert capsys.readouterr().err.splitlines() == [
        "prfaas run: interrupted; cleaned up",
        f"prfaas run: {out} is incomplete (no summary.json); `prfaas report` refuses it, and the same command with --out "
        "runs it again"]
    monkeypatch.setattr(runner, "run_scenario", lambda scenario, out_dir, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    assert guarded("prfaas run", lambda: run_once(None, tmp_path / "never")) == 130  # type: ignore[arg-type]
    assert capsys.readouterr().err == "prfaas run: interrupted; cleaned up\n"  # no folder made: nothing to name
