"""Comma-list options (`validation.comma_list`): every one refuses an empty value -- two commas in a row, or one at an
end -- and no value at all, in one line naming the option (exit 2), before any work. Until 2026-12-07 only `sweep
--grid` did: `quickstart --policies`, `reproduce --only` and `wall --lengths` dropped an empty value without a word, and
a benchmark's `--seeds 1,,2` or `--connections 1,,4` was a ValueError traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main
from testbed.errors import UserError
from testbed.validation import comma_list

REPO = Path(__file__).resolve().parents[2]
GAP = "(two commas in a row, or one at an end); give each value"


def test_a_comma_list_is_its_values_without_spaces() -> None:
    assert comma_list("prfaas, fixed-threshold ", "--policies") == ["prfaas", "fixed-threshold"]
    assert comma_list("8", "--lengths") == ["8"]


@pytest.mark.parametrize("text", ["1,,2", "1,2,", ",1", " , ", "1, ,2"])
def test_an_empty_value_is_refused_naming_the_option_and_the_text(text: str) -> None:
    with pytest.raises(UserError) as exc:
        comma_list(text, "--seeds", "1,2,3")
    assert str(exc.value) == f"--seeds: {text!r} has an empty value {GAP}, e.g. 1,2,3"


@pytest.mark.parametrize("text", ["", "  "])
def test_no_value_at_all_is_refused(text: str) -> None:
    with pytest.raises(UserError) as exc:
        comma_list(text, "--seeds")
    assert str(exc.value) == "--seeds: give at least one value (separated by commas)"


@pytest.mark.parametrize("argv, said", [
    (["quickstart", "--policies", "prfaas,,fixed-threshold"],
     f"--policies: 'prfaas,,fixed-threshold' has an empty value {GAP}, e.g. prfaas,fixed-threshold"),
    (["quickstart", "--policies", ","], "--policies: ',' has an empty value"),
    (["quickstart", "--policies", ""], "--policies: give at least one value (separated by commas, e.g. prfaas,fixed-threshold)"),
    (["reproduce", "case-study", "--only", "prfaas_pd,"], f"--only: 'prfaas_pd,' has an empty value {GAP}"),
    (["wall", "--measure", "minimax-m2.5", "--lengths", "128,,512"], f"--lengths: '128,,512' has an empty value {GAP}"),
    (["profile", "--model", "kimi-linear-48b", "--variant", "tiny", "--device", "cpu", "--out", "p.yaml", "--lengths", "256,,512"],
     f"--lengths: '256,,512' has an empty value {GAP}, e.g. 256,512,1K"),  # 256 and 512 were profiled
    (["profile", "--model", "kimi-linear-48b", "--variant", "tiny", "--device", "cpu", "--out", "p.yaml", "--batches", ""],
     "--batches: give at least one value (separated by commas, e.g. 1,2,4,8)"),  # batch 1 was profiled
    (["profile", "--model", "kimi-linear-48b", "--variant", "tiny", "--device", "cpu", "--out", "p.yaml", "--contexts", "0,"],
     f"--contexts: '0,' has an empty value {GAP}"),
    (["sweep", "quick", "--out", "out", "--grid", "seed=1,,2"], f"--grid seed: '1,,2' has an empty value {GAP}"),
    (["sweep", "quick", "--out", "out", "--grid", "seed="], "--grid seed: give at least one value (separated by commas)"),
])
def test_the_commands_refuse_an_empty_value_in_one_line_before_any_work(argv: list[str], said: str, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prfaas {argv[0]}: error: {said}") and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())  # no output folder made


@pytest.mark.parametrize("argv, said", [
    (["signals_bench.py", "--seeds", "1,,2"], f"--seeds: '1,,2' has an empty value {GAP}"),  # was int('') 's traceback
    (["transport_bench.py", "--loopback", "--connections", "1,,4"], f"--connections: '1,,4' has an empty value {GAP}"),
    (["case_study.py", "--only", ","], f"--only: ',' has an empty value {GAP}"),
    (["probe_bench.py", "--stop", "size,"], f"--stop: 'size,' has an empty value {GAP}"),
    (["netem_guest_bench.py", "--points", "20x50,,200x50"], f"--points: '20x50,,200x50' has an empty value {GAP}"),
    # a value that is no number was a ValueError traceback too (int('x')), and --connections 0 KVSender's (2026-12-07)
    (["signals_bench.py", "--seeds", "1,x"], "--seeds '1,x': give seeds separated by commas, whole numbers from 0 to 4294967295, e.g. 1,2,3"),
    (["signals_bench.py", "--seeds", "-1"], "--seeds '-1': give seeds separated by commas, whole numbers from 0 to 4294967295"),
    (["transport_bench.py", "--loopback", "--connections", "1,x"],
     "--connections '1,x': give stream counts separated by commas, whole numbers >= 1, e.g. 1,2,4,8"),
    (["transport_bench.py", "--loopback", "--connections", "0"], "--connections '0': give stream counts separated by commas"),
])
def test_the_benchmarks_refuse_an_empty_value_in_one_line(argv: list[str], said: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and f"{argv[0]}: error: {said}" in r.stderr and "Traceback" not in r.stderr, r.stderr
