"""The workload section and the generator: targets, reproducibility, trace replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from testbed.errors import FieldError
from testbed.sections import parse_scenario
from testbed.validation import Fields
from traffic.arrivals import ClosedLoop, Poisson
from traffic.lengths import PAPER_INPUT, Fixed
from traffic.stats import per_second_counts
from traffic.trace import read_trace
from traffic.workload import WorkloadSpec, generate, generate_batch, parse_workload_section


def parse(data: dict, source: str | None = None) -> WorkloadSpec:
    return parse_workload_section(Fields(data, "workload", source))


def test_defaults_are_the_papers_workload_and_hit_the_targets() -> None:
    spec = parse({"arrivals": {"rate": "500/s"}})
    assert spec.input == PAPER_INPUT and spec.output == Fixed(1024)
    b = generate_batch(spec, 42, 400.0)
    assert len(b) == pytest.approx(200_000, rel=0.01)
    assert abs(b.input_len.mean() - 27_500) / 27_500 < 0.01
    assert abs((b.input_len > 19_400).mean() - 0.496) < 0.005
    assert (b.output_len == 1024).all()
    assert np.all(np.diff(b.arrival_s) >= 0)


def test_same_seed_same_requests_and_independent_streams() -> None:
    spec = parse({"arrivals": {"rate": 5}, "sessions": {"turns": 3}, "system_prompts": {"count": 2, "tokens": "1K"}})
    a, b = generate(spec, 3, 60.0), generate(spec, 3, 60.0)
    assert a == b
    assert generate(spec, 4, 60.0) != a
    other = parse({"arrivals": {"rate": 5}, "output": 77, "sessions": {"turns": 3}, "system_prompts": {"count": 2, "tokens": "1K"}})
    c = generate_batch(other, 3, 60.0)
    assert np.array_equal(c.arrival_s, generate_batch(spec, 3, 60.0).arrival_s)  # output length has its own stream


def test_workload_seed_overrides_the_scenario_seed() -> None:
    spec = parse({"seed": 9, "arrivals": {"rate": 5}})
    assert generate(spec, 1, 10.0) == generate(spec, 2, 10.0)


def test_max_requests_caps_the_count() -> None:
    assert len(generate_batch(parse({"arrivals": {"rate": 100}, "max_requests": 50}), 1, 10.0)) == 50


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_requests_is_at_least_one(bad) -> None:
    """`max_requests: 0` passed prfaas check, and a run sent no request (2026-12-07)."""
    with pytest.raises(FieldError, match=r"workload\.max_requests: .* is not a whole number >= 1"):
        parse({"arrivals": {"rate": 100}, "max_requests": bad})


def test_a_workload_of_more_than_a_million_requests_is_refused_before_it_is_drawn() -> None:
    """`traffic generate --duration 1e9s` drew arrivals until it was killed (2026-12-06): the count is checked first."""
    from testbed.errors import UserError

    with pytest.raises(UserError, match=r"about 1,500,000,000 requests \(1.5 req/s for 1e\+09 s\); at most 1,000,000"):
        generate_batch(parse({"arrivals": {"rate": 1.5}}), 1, 1e9)


def test_trace_replay_keeps_per_second_arrival_counts(mooncake_trace: Path) -> None:
    spec = parse({"trace": {"path": str(mooncake_trace)}})
    b = generate_batch(spec, 1, None)
    original = np.array([r.arrival_s for r in read_trace(mooncake_trace).requests])
    assert len(b) == 3993
    assert np.array_equal(per_second_counts(b.arrival_s), per_second_counts(original))
    fast = generate_batch(parse({"trace": {"path": str(mooncake_trace), "time_scale": 0.5}}), 1, 100.0)
    assert np.array_equal(per_second_counts(fast.arrival_s), per_second_counts(original[original < 200.0] / 2))


def test_trace_with_a_new_arrival_process_keeps_trace_lengths(mooncake_trace: Path) -> None:
    spec = parse({"trace": {"path": str(mooncake_trace)}, "arrivals": {"rate": 10}})
    b = generate_batch(spec, 1, 30.0)
    orig = read_trace(mooncake_trace).requests
    assert b.input_len.tolist() == [r.input_len for r in orig[: len(b)]]
    assert len(b) / 30 == pytest.approx(10, rel=0.2)


def test_closed_loop_is_flagged_for_the_load_generator() -> None:
    spec = parse({"arrivals": {"process": "closed", "users": 4, "think": "2s"}})
    assert spec.closed_loop == ClosedLoop(4, 2.0)
    assert parse({}).closed_loop is None and parse({}).arrivals == Poisson(1.0)


@pytest.mark.parametrize("data, field", [
    ({"trace": {"path": "/nonexistent.jsonl"}}, "workload.trace.path"),
    ({"arrivals": {"process": "trace"}}, "workload.arrivals"),
    ({"rate": 5}, "workload.rate"),
    ({"sessions": {"turns": 2, "think": "0s"}}, "workload.sessions.think"),
    ({"input": {"dist": "uniform", "min": 5}}, "workload.input.max"),
])
def test_bad_sections_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(FieldError) as e:
        parse(data)
    assert e.value.field == field


def test_trace_cannot_be_combined_with_lengths(mooncake_trace: Path) -> None:
    with pytest.raises(FieldError, match="workload.input: cannot be combined with trace"):
        parse({"trace": {"path": str(mooncake_trace)}, "input": 100})


def test_scenario_file_with_workload_and_cross_traffic_sections(tmp_path: Path, mooncake_trace: Path) -> None:
    (tmp_path / "t.jsonl").write_bytes(mooncake_trace.read_bytes())
    data = yaml.safe_load("""
name: wl
wan: {rate: 10Gbps}
workload:
  trace: {path: t.jsonl, time_scale: 2}
cross_traffic:
  flows:
    - {protocol: udp, rate: 1Gbps}
""")
    sc = parse_scenario(data, str(tmp_path / "wl.yaml"))
    assert sc.section("workload").trace.path == str(tmp_path / "t.jsonl")  # relative to the scenario file
    assert sc.section("cross_traffic").flows[0].rate_bps == 1e9


def test_no_workload_section_means_the_defaults() -> None:
    assert generate(None, 5, 30.0) == generate(WorkloadSpec(), 5, 30.0)


@pytest.mark.parametrize("arrivals", [{"process": "poisson", "rate": 1e30},
                                      {"process": "closed", "users": 10**12, "think": "1s"}])
def test_a_workload_past_the_batch_limit_is_refused_when_the_scenario_loads(arrivals):
    """`prfaas check` passed it; the run refused it only once its network was up (generate_batch)."""
    from testbed.errors import FieldError
    from testbed.sections import parse_scenario

    with pytest.raises(FieldError, match="at most 1,000,000 in one batch") as exc:
        parse_scenario({"wan": {"rate": "10Gbps"}, "duration": "30s", "workload": {"arrivals": arrivals}})
    assert exc.value.field == "workload.arrivals"


def test_an_input_that_can_draw_an_empty_prompt_is_refused_at_load() -> None:
    """`workload.input: 0` (or a range, list or mixture that reaches 0) passed `prfaas check`; the run refused it only
    once it drew a 0. Output lengths may be 0."""
    import pytest

    from testbed.errors import FieldError
    from testbed.validation import Fields
    from traffic.workload import parse_workload_section

    for bad in (0, {"dist": "uniform", "min": 0, "max": 10}, {"dist": "empirical", "values": [5, 0, 7]},
                {"dist": "mixture", "components": [{"weight": 0.5, "dist": "fixed", "tokens": 0},
                                                   {"weight": 0.5, "dist": "fixed", "tokens": 9}]}):
        with pytest.raises(FieldError, match="can draw a prompt of 0 tokens") as exc:
            parse_workload_section(Fields({"input": bad}, "workload"))
        assert exc.value.field == "workload.input"
    assert parse_workload_section(Fields({"input": 1, "output": 0}, "workload")).input.least() == 1


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_an_empty_trace_is_refused_when_the_workload_is_read(tmp_path: Path, content: str) -> None:
    """`prfaas check` passed a workload.trace.path that was empty, and a run replayed no request (2026-12-07)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    with pytest.raises(FieldError) as exc:
        parse({"trace": {"path": str(trace)}}, str(tmp_path / "sc.yaml"))
    assert str(exc.value) == (f"{tmp_path / 'sc.yaml'}: workload.trace.path: {trace} is empty; a Mooncake JSONL trace, "
                              "one request a line, is expected")


def test_a_trace_whose_every_line_is_skipped_is_refused_when_drawn(tmp_path: Path) -> None:
    from testbed.errors import UserError

    trace = tmp_path / "t.jsonl"
    trace.write_text("not json\n[]\n")
    spec = parse({"trace": {"path": str(trace), "skip_bad": True}})
    with pytest.raises(UserError) as exc:
        generate_batch(spec, 1, 10.0)
    assert str(exc.value) == (f"trace {trace}: no requests (2 bad lines skipped, the first: line 1: not valid JSON (Expecting "
                              "value at column 1)); a workload's trace needs at least one")


def _timed_trace(path: Path, *timestamps_ms: int) -> Path:
    path.write_text("".join(f'{{"timestamp": {t}, "input_length": 600, "output_length": 8, "hash_ids": [{2 * i}, {2 * i + 1}]}}\n'
                            for i, t in enumerate(timestamps_ms)))
    return path


def test_a_trace_whose_every_request_arrives_after_the_run_is_refused_when_the_scenario_loads(tmp_path: Path) -> None:
    """Its first request at 40 s of a 30-s run: `prfaas check` of a scenario without a model passed it, and the run
    replayed nothing (2026-12-07). Only some after the end: cut to the duration, as before."""
    trace = _timed_trace(tmp_path / "late.jsonl", 40_000, 41_000, 50_000)
    data = {"wan": {"rate": "10Gbps"}, "duration": "30s", "workload": {"trace": {"path": str(trace)}}}
    with pytest.raises(FieldError) as exc:
        parse_scenario(data)
    assert str(exc.value) == (f"workload.trace: {trace}: its first request arrives at 40 s, not before the end of the run "
                              "(duration 30 s): the run would replay none of its 3 requests; lengthen the duration or lower time_scale")
    with pytest.raises(FieldError, match=r"arrives at 30 s \(40 s x time_scale 0.75\), not before the end of the run \(duration 30 s\)"):
        parse_scenario({**data, "workload": {"trace": {"path": str(trace), "time_scale": 0.75}}})
    assert len(parse_scenario({**data, "workload": {"trace": {"path": str(trace), "time_scale": 0.5}}}).section("workload").trace.path)
    some = _timed_trace(tmp_path / "some.jsonl", 1_000, 41_000, 50_000)
    sc = parse_scenario({**data, "workload": {"trace": {"path": str(some)}}})
    assert list(generate_batch(sc.section("workload"), 1, sc.duration_s).arrival_s) == [1.0]  # the normal cut
    # new arrival times: the trace's own are not used
    assert parse_scenario({**data, "workload": {"trace": {"path": str(trace)}, "arrivals": {"process": "poisson", "rate": 1}}})


def test_a_workload_trace_is_parsed_once_per_file_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prfaas check` read a scenario's trace four times (the workload check, the arrival rate, the throughput model,
    the skip_bad warning), seconds each for a large one, until 2026-12-07: `trace_data` keeps the result per file
    version, and reads a file again once edited (its size or modification time changed)."""
    import os

    from traffic import trace as trace_mod
    from traffic.workload import trace_data

    parsed: list[int] = []
    parse_line = trace_mod.parse_line
    monkeypatch.setattr(trace_mod, "parse_line", lambda text, lineno, rid: parsed.append(lineno) or parse_line(text, lineno, rid))
    path = _timed_trace(tmp_path / "t.jsonl", 1_000, 2_000)
    spec = parse({"trace": {"path": str(path)}})
    first = trace_data(spec.trace)
    assert parsed == [1, 2] and isinstance(first.requests, tuple)  # kept, so it cannot be changed under another caller
    assert trace_data(spec.trace) is first and len(generate_batch(spec, 1, 10.0).arrival_s) == 2 and parsed == [1, 2]
    assert trace_data(parse({"trace": {"path": str(path), "skip_bad": True}}).trace) == first and len(parsed) == 4
    # edited in place to the same size: only the modification time tells (set apart here, as a clock tick may not)
    mtime_ns = path.stat().st_mtime_ns
    _timed_trace(path, 5_000, 6_000)
    os.utime(path, ns=(mtime_ns, mtime_ns + 1_000_000))
    assert [r.arrival_s for r in trace_data(spec.trace).requests] == [5.0, 6.0] and len(parsed) == 6
    _timed_trace(path, 1_000, 2_000, 3_000)  # edited: longer
    os.utime(path, ns=(mtime_ns, mtime_ns))  # its size alone tells
    assert len(trace_data(spec.trace).requests) == 3 and parsed[6:] == [1, 2, 3]
