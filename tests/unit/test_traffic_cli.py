"""`prfaas traffic stats` and `prfaas traffic generate` end to end through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.cli import main
from traffic.trace import read_trace


def test_stats_json_of_the_bundled_trace(mooncake_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traffic", "stats", str(mooncake_trace), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["requests"] == 3993 and d["skipped_lines"] == 0
    assert d["input_len"]["mean"] == pytest.approx(15325.48, abs=0.01)
    assert d["hit_ratio"] == pytest.approx(39_802_880 / 61_194_628)
    assert d["arrivals"]["mean_rps"] == pytest.approx(3992 / 1022.025)


def test_stats_table_mentions_the_hit_ratio(mooncake_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traffic", "stats", str(mooncake_trace)]) == 0
    assert "hit_ratio 0.6504" in capsys.readouterr().out


def test_bad_trace_is_one_line_error_and_skip_bad_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n')
    assert main(["traffic", "stats", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prfaas traffic stats: error: ") and "line 2: not valid JSON" in err and err.count("\n") == 1
    assert "(use --skip-bad to skip and count bad lines)" in err
    assert main(["traffic", "stats", str(p), "--json", "--skip-bad"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["requests"] == 1 and d["skipped_lines"] == 1


def test_stats_of_an_empty_trace_says_so_instead_of_a_table_of_nan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert main(["traffic", "stats", str(p)]) == 0
    assert capsys.readouterr().out.strip() == f"{p}: no requests: nothing to summarise"
    assert main(["traffic", "stats", str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 0


def test_generate_from_a_workload_spec_file(tmp_path: Path) -> None:
    spec = tmp_path / "wl.yaml"
    spec.write_text("arrivals: {rate: 10/s}\noutput: 64\nsessions: {turns: 2}\n")
    out = tmp_path / "wl.jsonl"
    assert main(["traffic", "generate", str(spec), "--out", str(out), "--duration", "30s", "--seed", "5"]) == 0
    reqs = read_trace(out).requests
    assert len(reqs) == pytest.approx(300, rel=0.25)
    assert all(r.output_len == 64 for r in reqs) and max(r.arrival_s for r in reqs) < 30
    again = tmp_path / "again.jsonl"
    main(["traffic", "generate", str(spec), "--out", str(again), "--duration", "30s", "--seed", "5"])
    assert again.read_bytes() == out.read_bytes()


def test_generate_from_a_scenario_uses_its_seed_and_duration(tmp_path: Path) -> None:
    sc = tmp_path / "sc.yaml"
    sc.write_text("name: x\nseed: 3\nduration: 20s\nwan: {rate: 10Gbps}\nworkload:\n  arrivals: {rate: 4}\n")
    out = tmp_path / "o.jsonl"
    assert main(["traffic", "generate", str(sc), "--out", str(out), "--set", "workload.arrivals.rate=8"]) == 0
    reqs = read_trace(out).requests
    assert len(reqs) == pytest.approx(160, rel=0.3) and max(r.arrival_s for r in reqs) < 20


def test_generate_errors_name_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "wl.yaml"
    spec.write_text("arrivals: {rate: 1}\n")
    assert main(["traffic", "generate", str(spec), "--out", str(tmp_path / "o"), "--duration", "ten"]) == 2
    assert "--duration" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused by output_file_option before the trace is drawn
        main(["traffic", "generate", str(spec), "--out", str(tmp_path / "no" / "o")])
    assert exit_.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # was numpy's traceback
        main(["traffic", "generate", str(spec), "--out", str(tmp_path / "o"), "--seed", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == ("prfaas traffic generate: error: argument --seed: -1 is not a seed; use a whole number "
                                               "from 0 to 4294967295 (2**32 - 1)")


def test_stats_of_an_empty_trace_is_valid_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    assert main(["traffic", "stats", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert d["requests"] == 0 and d["input_len"]["mean"] is None and d["hit_ratio"] == 0.0


def test_generate_into_a_folder_is_one_line_and_an_earlier_trace_stays_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out` naming a folder was an IsADirectoryError traceback (2026-12-07), then refused once the trace was drawn;
    now before (`validation.output_file_option`). The trace is written atomically, so a failed write leaves the file it
    replaces as it was."""
    from testbed.errors import UserError
    from traffic.trace import write_trace

    spec = tmp_path / "wl.yaml"
    spec.write_text("arrivals: {rate: 1}\n")
    (tmp_path / "d").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["traffic", "generate", str(spec), "--out", str(tmp_path / "d"), "--duration", "5s"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (f"prfaas traffic generate: error: argument --out: {str(tmp_path / 'd')!r} is a "
                                               "folder; name a file")
    with pytest.raises(UserError, match=r"cannot write this file \(Is a directory\)"):
        write_trace(tmp_path / "d", [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "wl.yaml"]


@pytest.mark.parametrize("content, what", [("", "empty"), ("  \n# arrivals: {rate: 2}\n\n", "no data (only comments, or null)"),
                                           ("null\n", "no data (only comments, or null)")])
def test_generate_from_an_empty_workload_file_is_one_line_not_the_default_workload(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, what: str) -> None:
    """An empty workload file drew the default workload (Poisson 1/s, the paper's lengths) and exited 0 (2026-12-07)."""
    spec = tmp_path / "wl.yaml"
    spec.write_text(content)
    out = tmp_path / "o.jsonl"
    assert main(["traffic", "generate", str(spec), "--out", str(out), "--duration", "5s"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"prfaas traffic generate: error: {spec}: {what}; a workload (a YAML mapping of arrivals, input, output, ...: docs/scenario-workload.md) "
        "or a scenario with a workload: section is expected"]
    assert not out.exists()


def test_generate_from_a_scenario_without_a_workload_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scenario with no workload: section (net-default) was read as a workload mapping: "workload.duration: unknown key"
    (2026-12-07). It is a scenario by its keys; the refusal says what is missing, and the override it names draws one."""
    from testbed.scenario import find_scenario

    out = tmp_path / "o.jsonl"
    assert main(["traffic", "generate", "net-default", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"prfaas traffic generate: error: {find_scenario('net-default')}: scenario net-default has no workload: section to draw; add one "
        "(docs/scenario-workload.md), e.g. --set 'workload={arrivals: {rate: 2}}'"]
    assert not out.exists()
    assert main(["traffic", "generate", "net-default", "--out", str(out), "--set", "workload={arrivals: {rate: 2}}"]) == 0
    reqs = read_trace(out).requests  # net-default's seed and its 60 s
    assert len(reqs) == pytest.approx(120, rel=0.3) and max(r.arrival_s for r in reqs) < 60
