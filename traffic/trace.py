"""Mooncake-format traces (JSON Lines): read with validation, write in the same format.

One request a line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``
with one hash id per 512-token block (the last block may be partial): exactly ceil(input_length / 512) ids, as the
router takes them. Any other keys are ignored; a key given twice in one line is refused.
Limits (docs/traffic.md): a timestamp is at most a week (`units.MAX_DURATION_S`), a length at most
`units.MAX_TOKENS`, a hash id a signed 64-bit integer (the column it is kept in), a line at most `MAX_LINE_CHARS`.
The file is UTF-8 text (a leading byte-order mark is skipped); a gzip'd file is refused as such.
A malformed line is an error naming its line number and field, or, with ``skip_bad``, skipped and counted
(the first few reasons are kept). Timestamps are milliseconds in the file and seconds (`arrival_s`) here.
"""

from __future__ import annotations

import codecs
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from testbed import units
from testbed.errors import UserError
from testbed.blocks import BLOCK_TOKENS, block_hashes
from testbed.validation import digits_python_reads
from traffic.request import Request, RequestBatch

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
KEEP_PROBLEMS = 20
MAX_TIMESTAMP_MS = units.MAX_DURATION_S * 1000.0
# The longest line read: 4 MiB of text, five times the longest valid one (16M tokens are 32768 ids of at most 20
# characters and a separator: 0.7 MB), room for extra keys. A longer line is refused unparsed: a 2-GB line of ids was
# read whole and parsed into a list of 10^9 numbers (memory exhausted) before its length was looked at.
MAX_LINE_CHARS = 4 * 1024 * 1024
GZIP_MAGIC = b"\x1f\x8b"


class TraceLineError(ValueError):
    """One bad line: `field` is None when the line as a whole is bad (not JSON, not an object)."""

    def __init__(self, line: int, field_name: str | None, message: str) -> None:
        self.line = line
        self.field = field_name
        where = f"line {line}" + (f", field {field_name!r}" if field_name else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class TraceData:
    requests: tuple[Request, ...]  # a tuple: `traffic.workload.trace_data` hands one kept result to every caller
    skipped: int = 0
    problems: tuple[str, ...] = field(default=())  # the first KEEP_PROBLEMS reasons for skipped lines
    path: str = ""

    def batch(self) -> RequestBatch:
        return RequestBatch.from_requests(self.requests)


def _whole(obj: dict[str, Any], key: str, lineno: int, minimum: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceLineError(lineno, key, f"{v!r} is not a whole number of tokens")
    if v < minimum:
        raise TraceLineError(lineno, key, f"{v} is {'negative' if v < 0 else 'too small'}; must be >= {minimum}")
    if v > units.MAX_TOKENS:  # 10**30 was a numpy OverflowError traceback; 10**12 passed into the model
        raise TraceLineError(lineno, key, f"{v} is more than {units.MAX_TOKENS} tokens (16M, the most a length may be)")
    return v


class _Refused(ValueError):
    """Raised by `_object` with the key a line gives twice."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of a trace line: a key given twice is refused (`json.loads` kept the last silently, so
    ``{"timestamp": 5, ..., "timestamp": 900000}`` was read as 900 s)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(dup)
    return obj


def parse_line(text: str, lineno: int, request_id: str) -> Request:
    """One trace line -> `Request`, or `TraceLineError` naming the line and the field."""
    try:
        obj = json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise TraceLineError(lineno, None, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # `[[[[...` thousands deep
        raise TraceLineError(lineno, None, "not a trace line (JSON nested too deeply)") from None
    except _Refused as exc:
        raise TraceLineError(lineno, str(exc), "is given twice in one line; keep one") from None
    except ValueError:  # Python reads no whole number past its digits: a ValueError traceback before, --skip-bad or not
        raise TraceLineError(lineno, None, f"not a trace line (a number of more than {digits_python_reads()} digits)") from None
    if not isinstance(obj, dict):
        raise TraceLineError(lineno, None, f"expected a JSON object with keys {', '.join(FIELDS)}, got {type(obj).__name__}")
    for key in FIELDS:
        if key not in obj:
            raise TraceLineError(lineno, key, "is missing")
    ts = obj["timestamp"]
    what = f"a time in milliseconds from 0 to {MAX_TIMESTAMP_MS:.0f} (a week)"
    try:  # a whole number past 1.8e308 has no float (an OverflowError traceback before)
        ms = units.finite_number(ts, what)
    except ValueError as exc:
        raise TraceLineError(lineno, "timestamp", str(exc)) from None
    if not 0 <= ms <= MAX_TIMESTAMP_MS:  # 1e15 ms asked `prfaas traffic stats` for a 7-TiB histogram
        raise TraceLineError(lineno, "timestamp", f"{ts!r} is not {what}")
    input_len = _whole(obj, "input_length", lineno, 1)
    output_len = _whole(obj, "output_length", lineno, 0)
    try:
        hashes = block_hashes(obj["hash_ids"])
    except ValueError as exc:
        raise TraceLineError(lineno, "hash_ids", str(exc)) from None
    need = -(-input_len // BLOCK_TOKENS)
    if len(hashes) != need:  # more were read and kept, and the router refused each such request (HTTP 400) in a run
        raise TraceLineError(lineno, "hash_ids", f"has {len(hashes)} ids, {'too short' if len(hashes) < need else 'too long'} "
                             f"for input_length {input_len}: {need} blocks of {BLOCK_TOKENS} tokens need exactly {need} ids")
    return Request(request_id, ms / 1000.0, input_len, output_len, tuple(hashes))


def holds_no_line(path: str | Path) -> bool:
    """Whether `path` holds no line but blank ones (0 bytes too): a trace of no requests, read up to its first other
    line. A file that cannot be read is False: reading it names the problem."""
    try:
        with Path(path).open("rb") as fh:
            return all(not line.strip() for line in fh)
    except OSError:
        return False


SKIP_BAD_OPTION = "use --skip-bad to skip and count bad lines"  # how `prfaas traffic stats` skips them


def read_trace(path: str | Path, skip_bad: bool = False, skip_hint: str | None = None) -> TraceData:
    """All requests of a Mooncake JSONL file, in file order. Blank lines are ignored. A bad line is a `UserError`
    ending in `skip_hint`, how the caller's user skips bad lines (`SKIP_BAD_OPTION` for `prfaas traffic stats`; none
    where they cannot be skipped): a scenario's trace said "use --skip-bad", an option no run has (its field is
    `workload.trace.skip_bad`)."""
    p = Path(path)
    try:
        raw = p.open("rb")
    except OSError as exc:
        raise UserError(f"trace {p}: cannot open ({exc.strerror})") from None
    requests: list[Request] = []
    skipped = 0
    problems: list[str] = []
    lineno = 0
    with raw:
        try:
            gzipped = raw.peek(2)[:2] == GZIP_MAGIC
        except OSError as exc:  # a directory opens, and fails on reading
            raise UserError(f"trace {p}: cannot read ({exc.strerror})") from None
        if gzipped:  # "not UTF-8 text after line 0" said less
            raise UserError(f"trace {p}: gzip-compressed; decompress it first (e.g. with gunzip): a Mooncake JSONL file (plain text) is expected")
        handle = io.TextIOWrapper(raw, encoding="utf-8-sig")  # -sig: a leading byte-order mark is skipped, not a bad line 1
        try:
            for lineno, text in _lines(handle):
                if text is not None and not text.strip():
                    continue
                try:
                    if text is None:
                        raise TraceLineError(lineno, None, f"longer than {MAX_LINE_CHARS:,} characters, past any trace line")
                    requests.append(parse_line(text, lineno, f"r{len(requests)}"))
                except TraceLineError as exc:
                    if not skip_bad:
                        raise UserError(f"trace {p}: {exc}" + (f" ({skip_hint})" if skip_hint else "")) from None
                    skipped += 1
                    if len(problems) < KEEP_PROBLEMS:
                        problems.append(str(exc))
        except UnicodeDecodeError:  # read in blocks, ahead of the lines: "after line 0" for a bad byte on line 40
            raise UserError(f"trace {p}: not UTF-8 text (line {_bad_utf8_line(p)}); a Mooncake JSONL file is expected") from None
    return TraceData(tuple(requests), skipped, tuple(problems), str(p))


def _bad_utf8_line(p: Path) -> int:
    """The number of the first line of `p` that is not UTF-8 (a character may straddle two pieces of a long line)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lineno = 1
    with p.open("rb") as raw:
        while piece := raw.readline(1 << 20):
            try:
                decoder.decode(piece)
            except UnicodeDecodeError:
                return lineno
            lineno += piece.endswith(b"\n")
    return lineno  # a character cut off by the end of the file


def _lines(handle: io.TextIOWrapper) -> Iterator[tuple[int, str | None]]:
    """(line number, text) of each line, the text None for a line longer than `MAX_LINE_CHARS` (read past in pieces,
    never held whole)."""
    lineno = 0
    while text := handle.readline(MAX_LINE_CHARS + 2):
        lineno += 1
        body = text[:-1] if text.endswith("\n") else text
        if len(body) <= MAX_LINE_CHARS:
            yield lineno, text
            continue
        while text and not text.endswith("\n"):
            text = handle.readline(MAX_LINE_CHARS + 2)
        yield lineno, None


def format_line(timestamp_ms: float, input_len: int, output_len: int, hashes: Iterable[int]) -> str:
    """The exact layout of Mooncake's files (json.dumps defaults)."""
    return (f'{{"timestamp": {timestamp_ms}, "input_length": {input_len}, "output_length": {output_len}, '
            f'"hash_ids": [{", ".join(map(str, hashes))}]}}')


def _ms(arrival_s: float, integer_ms: bool) -> int | float:
    ms = arrival_s * 1000.0
    if integer_ms or abs(ms - round(ms)) < 1e-6:
        return int(round(ms))
    return round(ms, 6)


def write_trace(path: str | Path, requests: Iterable[Request] | RequestBatch, integer_ms: bool = True) -> int:
    """Write requests as Mooncake JSONL; returns the count. With `integer_ms` times are rounded to whole
    milliseconds (the format's convention); otherwise sub-millisecond times are kept as decimals."""
    from testbed.atomic import replace_with

    n = 0

    def write(tmp: Path) -> None:  # atomically: a folder or a read-only disk at `path` is one line naming it
        nonlocal n
        with tmp.open("w", encoding="utf-8") as out:
            if isinstance(requests, RequestBatch):
                b = requests
                offs, flat = b.hash_offsets.tolist(), b.hashes
                for i, (t, inp, o) in enumerate(zip(b.arrival_s.tolist(), b.input_len.tolist(), b.output_len.tolist())):
                    out.write(format_line(_ms(t, integer_ms), inp, o, flat[offs[i]:offs[i + 1]].tolist()) + "\n")
                    n += 1
            else:
                for r in requests:
                    out.write(format_line(_ms(r.arrival_s, integer_ms), r.input_len, r.output_len, r.block_hashes) + "\n")
                    n += 1

    replace_with(path, write)
    return n
