"""Mooncake trace reading, validation and writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.errors import UserError
from traffic.request import Request, RequestBatch
from traffic.trace import SKIP_BAD_OPTION, read_trace, write_trace

GOOD = '{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}'


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_bundled_trace_read_write_read_is_identical_to_the_byte(mooncake_trace: Path, tmp_path: Path) -> None:
    first = read_trace(mooncake_trace)
    assert len(first.requests) == 3993 and first.skipped == 0
    out = tmp_path / "copy.jsonl"
    assert write_trace(out, first.requests) == 3993
    again = read_trace(out)
    assert again.requests == first.requests
    assert out.read_bytes() == mooncake_trace.read_bytes()  # same layout as Mooncake's own files
    out2 = tmp_path / "batch.jsonl"
    write_trace(out2, first.batch())  # the columnar path writes the same bytes
    assert out2.read_bytes() == out.read_bytes()


def test_request_fields_and_units(tmp_path: Path) -> None:
    (r,) = read_trace(write_lines(tmp_path, [GOOD])).requests
    assert r == Request("r0", 0.005, 600, 7, (1, 2))


def test_sub_millisecond_times_survive_when_asked(tmp_path: Path) -> None:
    reqs = [Request("a", 1.2345678, 10, 1, (3,))]
    write_trace(tmp_path / "x.jsonl", reqs, integer_ms=False)
    assert read_trace(tmp_path / "x.jsonl").requests[0].arrival_s == pytest.approx(1.2345678, abs=1e-9)
    write_trace(tmp_path / "y.jsonl", reqs)
    assert json.loads((tmp_path / "y.jsonl").read_text())["timestamp"] == 1235


BAD = [
    ('{"timestamp": 5, "input_length": 600', "line 2: not valid JSON"),
    ('[1, 2, 3]', "line 2: expected a JSON object"),
    ('{"timestamp": 5, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'input_length': is missing"),
    ('{"timestamp": 5, "input_length": -600, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'input_length': -600 is negative"),
    ('{"timestamp": 5, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]}', "line 2, field 'output_length': -1 is negative"),
    ('{"timestamp": -5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'timestamp'"),
    ('{"timestamp": 5, "input_length": 1600, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'hash_ids': has 2 ids, too short for input_length 1600"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, "x"]}', "line 2, field 'hash_ids': must be a list of whole numbers"),
    ('{"timestamp": 5, "input_length": 60.5, "output_length": 7, "hash_ids": [1]}', "line 2, field 'input_length': 60.5 is not a whole number"),
    # past what a trace can mean: tracebacks (OverflowError, a 7-TiB histogram) or silent nonsense before 2026-12-07
    ('{"timestamp": 1e400, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'timestamp': inf is not a time"),
    ('{"timestamp": 1' + '0' * 400 + ', "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
     "line 2, field 'timestamp': a 401-digit number is out of range; use a time in milliseconds from 0 to 604800000"),
    ('{"timestamp": 1e15, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
     "line 2, field 'timestamp': 1000000000000000.0 is not a time in milliseconds from 0 to 604800000 (a week)"),
    ('{"timestamp": NaN, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}', "line 2, field 'timestamp': nan is not a time"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 1000000000000, "hash_ids": [1, 2]}',
     "line 2, field 'output_length': 1000000000000 is more than 16777216 tokens"),
    ('{"timestamp": 5, "input_length": 1' + '0' * 30 + ', "output_length": 7, "hash_ids": [1, 2]}', "field 'input_length': 1000000000000000000000000000000 is more than"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 18446744073709551621]}',
     "line 2, field 'hash_ids': an id is outside the signed 64-bit range"),
    ("[" * 100000 + "]" * 100000, "line 2: not a trace line (JSON nested too deeply)"),
    # fuzzing pass 4: a ValueError traceback (--skip-bad or not), the last key kept silently, more ids than blocks kept
    # (the router refused each such request with HTTP 400 in a run)
    ('{"timestamp": 1' + '0' * 5000 + ', "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
     "line 2: not a trace line (a number of more than 4300 digits)"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2], "timestamp": 900000}',
     "line 2, field 'timestamp': is given twice in one line; keep one"),
    ('{"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2, 3]}',
     "line 2, field 'hash_ids': has 3 ids, too long for input_length 600: 2 blocks of 512 tokens need exactly 2 ids"),
]


@pytest.mark.parametrize("line, message", BAD)
def test_malformed_line_is_an_error_naming_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    p = write_lines(tmp_path, [GOOD, line, GOOD])
    with pytest.raises(UserError) as e:
        read_trace(p)
    assert message in str(e.value) and "skip" not in str(e.value)  # no hint where the caller has no way to skip
    with pytest.raises(UserError) as e:
        read_trace(p, skip_hint=SKIP_BAD_OPTION)  # `prfaas traffic stats`
    assert str(e.value).endswith("(use --skip-bad to skip and count bad lines)")


def test_limits_keep_the_whole_trace_usable(tmp_path: Path) -> None:
    """The largest values a line may hold read, and the statistics of such a trace are computed."""
    from traffic.stats import trace_stats

    ids = list(range(32767)) + [2**63 - 1]  # exactly one per block
    p = write_lines(tmp_path, [GOOD, json.dumps({"timestamp": 604800000, "input_length": 16 * 1024 * 1024,
                                                 "output_length": 16 * 1024 * 1024, "hash_ids": ids})])
    st = trace_stats(read_trace(p).requests)
    assert st.requests == 2 and st.arrivals.duration_s == pytest.approx(604800 - 0.005)


def test_skip_bad_skips_and_counts(tmp_path: Path) -> None:
    p = write_lines(tmp_path, [GOOD] + [b for b, _ in BAD] + ["", GOOD])
    data = read_trace(p, skip_bad=True)
    assert len(data.requests) == 2
    assert data.skipped == len(BAD)
    assert data.problems[0].startswith("line 2: not valid JSON")


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot open"):
        read_trace(tmp_path / "nope.jsonl")


def test_a_trace_that_is_not_utf8_is_one_user_error_even_with_skip_bad(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes((GOOD + "\n").encode() + b"\xff\xfe\n")
    for skip in (False, True):  # the line is named exactly ("after line 0" before 2026-12-07)
        with pytest.raises(UserError, match=r"bin.jsonl: not UTF-8 text \(line 2\)"):
            read_trace(p, skip_bad=skip)


def test_a_line_past_the_longest_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300-MB line of ids took 3.7 GB and 33 s and was read (2026-12-07); now any line past `MAX_LINE_CHARS` is one
    bad line, skipped in pieces with --skip-bad (the lines after it still read)."""
    import traffic.trace

    monkeypatch.setattr(traffic.trace, "MAX_LINE_CHARS", len(GOOD) + 2)
    p = write_lines(tmp_path, [GOOD, GOOD + "  ", GOOD + " " * 500, GOOD])
    with pytest.raises(UserError, match=rf"line 3: longer than {len(GOOD) + 2} characters, past any trace line"):
        read_trace(p)
    data = read_trace(p, skip_bad=True)
    assert len(data.requests) == 3 and data.skipped == 1


def test_a_byte_order_mark_is_skipped_and_a_gzipped_trace_named(tmp_path: Path) -> None:
    import gzip

    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\r\n" + GOOD + "\r\n").encode())  # a Windows editor's file
    assert len(read_trace(p).requests) == 2
    z = tmp_path / "t.jsonl.gz"
    z.write_bytes(gzip.compress((GOOD + "\n").encode()))  # was "not UTF-8 text after line 0"
    with pytest.raises(UserError, match=r"t.jsonl.gz: gzip-compressed; decompress it first"):
        read_trace(z, skip_bad=True)


def test_batch_round_trip_and_take() -> None:
    reqs = [Request("r0", 0.0, 600, 3, (1, 2), 4), Request("r1", 1.0, 100, 2, (9,)), Request("r2", 2.0, 1100, 1, (1, 2, 3))]
    b = RequestBatch.from_requests(reqs)
    assert b.to_requests() == reqs
    sub = b.take([2, 0])
    assert [r.block_hashes for r in sub] == [(1, 2, 3), (1, 2)]
    assert [r.session_id for r in sub] == [None, 4]
