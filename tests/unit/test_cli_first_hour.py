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
