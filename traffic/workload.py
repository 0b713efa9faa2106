"""A scenario's workload: the typed `workload:` section and the reproducible request generator.

`generate_batch(spec, seed, duration_s)` draws every request in bulk (numpy columns); `generate` and
`iter_requests` give `Request` objects. Arrival times, lengths and conversations use independent random
streams spawned from the seed, so changing, say, the output length leaves the arrival times unchanged.
A trace source replays a Mooncake file (its own timestamps x `time_scale`, or a new arrival process).
See docs/scenario-workload.md for the YAML form.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from testbed.errors import FieldError, UserError
from testbed.scenario import Scenario
from testbed.validation import Fields, at_least_one, boolean, path_exists, path_is_file, positive_number, random_seed, text
from traffic.arrivals import ArrivalProcess, ClosedLoop, Poisson, TraceTimes, parse_arrivals
from traffic.lengths import PAPER_INPUT, PAPER_OUTPUT, LengthDist, parse_length
from traffic.request import Request, RequestBatch
from traffic.sessions import SessionSpec, SystemPrompts, assign_block_hashes, build_conversations, parse_sessions, parse_system_prompts
from traffic.trace import TraceData, holds_no_line, read_trace


@dataclass(frozen=True)
class TraceSource:
    path: str
    time_scale: float = 1.0  # multiplies the trace's timestamps: 0.5 replays twice as fast
    skip_bad: bool = False


@dataclass(frozen=True)
class WorkloadSpec:
    input: LengthDist = PAPER_INPUT
    output: LengthDist = PAPER_OUTPUT
    arrivals: ArrivalProcess = Poisson(1.0)
    sessions: SessionSpec | None = None
    system_prompts: SystemPrompts | None = None
    trace: TraceSource | None = None
    max_requests: int | None = None
    seed: int | None = None  # overrides the scenario's seed for the workload only

    @property
    def closed_loop(self) -> ClosedLoop | None:
        """Set when the load generator must pace requests by completions (N users, think time)."""
        return self.arrivals if isinstance(self.arrivals, ClosedLoop) else None


def _resolve(path: str, source: str | None) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute() and not path_exists(p) and source:
        alt = Path(source).resolve().parent / p
        if path_exists(alt):
            return alt
    return p


def parse_workload_section(f: Fields) -> WorkloadSpec:
    """The scenario's ``workload:`` mapping -> `WorkloadSpec` (defaults: the paper's lengths, Poisson 1/s)."""
    base_dir = Path(f.source).resolve().parent if f.source else None
    trace = None
    if f.has("trace"):
        t = f.section("trace")
        path = _resolve(t.get("path", text), f.source)
        if not path_is_file(path):
            raise t.error("path", f"{path} is not a file (a Mooncake JSONL trace)")
        if holds_no_line(path):  # `prfaas check` passed it, and a run replayed no request (2026-12-07)
            raise t.error("path", f"{path} is empty; a Mooncake JSONL trace, one request a line, is expected")
        trace = TraceSource(str(path), t.get("time_scale", positive_number, 1.0), t.get("skip_bad", boolean, False))
        t.done()
        for key in ("input", "output", "sessions", "system_prompts"):
            if f.has(key):
                raise f.error(key, "cannot be combined with trace: the trace fixes lengths and prefixes")
    spec = WorkloadSpec(
        input=f.get("input", lambda v: parse_length(v, f.name("input"), f.source, base_dir), PAPER_INPUT),
        output=f.get("output", lambda v: parse_length(v, f.name("output"), f.source, base_dir), PAPER_OUTPUT),
        arrivals=f.get("arrivals", lambda v: parse_arrivals(v, f.name("arrivals"), f.source),
                       TraceTimes((), trace.time_scale) if trace else Poisson(1.0)),
        sessions=f.get("sessions", lambda v: parse_sessions(v, f.name("sessions"), f.source), None),
        system_prompts=f.get("system_prompts", lambda v: parse_system_prompts(v, f.name("system_prompts"), f.source), None),
        trace=trace,
        max_requests=f.get("max_requests", at_least_one, None),  # 0 passed and a run sent no request (2026-12-07)
        seed=f.get("seed", random_seed, None),
    )
    if isinstance(spec.arrivals, TraceTimes) and trace is None:
        raise f.error("arrivals", "process: trace needs a workload.trace to take the timestamps from")
    if trace is None and spec.input.least() < 1:  # `prfaas check` passed it; the run refused it once one was drawn
        raise f.error("input", f"can draw a prompt of {spec.input.least()} tokens; every prompt needs at least 1 token")
    f.done()
    return spec


# The most requests one batch draws: 55 hours at 5 req/s, past any run here (a case-study run is ~250), and far below
# what fills memory (each request keeps its prompt's block ids). `duration: 1e9s` drew until killed (2026-12-06).
MAX_REQUESTS = 1_000_000


def too_many_requests(spec: WorkloadSpec, duration_s: float) -> str | None:
    """Why a synthetic workload would draw more than `MAX_REQUESTS` in `duration_s` (max_requests cuts after the
    draw), or None."""
    expected = spec.arrivals.mean_rate_rps() * duration_s
    if expected <= MAX_REQUESTS:
        return None
    count = f"{expected:,.0f}" if expected < 1e12 else f"{expected:.3g}"
    return (f"would draw about {count} requests ({spec.arrivals.mean_rate_rps():g} req/s for {duration_s:g} s); "
            f"at most {MAX_REQUESTS:,} in one batch: shorten the duration or lower the rate")


def check_workload(scenario: Scenario) -> None:
    """The workload against the scenario's duration: `prfaas check` passed `arrivals.rate: 1e30` (or 10^12 closed-loop
    users), which the run refused only once its network was up. A trace replayed at its own times must have a request
    before the end of the run: one whose every request arrives after it replayed nothing, unsaid by a scenario without
    a model (2026-12-07); one whose later requests do is cut to the duration (`_from_trace`), as a run is."""
    spec: WorkloadSpec = scenario.section("workload")
    if spec.trace is None and (why := too_many_requests(spec, scenario.duration_s)) is not None:
        raise FieldError("workload.arrivals", why, scenario.source)
    if spec.trace is not None and isinstance(spec.arrivals, TraceTimes):
        data = trace_data(spec.trace)
        first = min(r.arrival_s for r in data.requests)
        if first * spec.trace.time_scale >= scenario.duration_s:
            scaled = f" ({first:g} s x time_scale {spec.trace.time_scale:g})" if spec.trace.time_scale != 1 else ""
            raise FieldError("workload.trace", f"{data.path}: its first request arrives at {first * spec.trace.time_scale:g} s{scaled}, "
                             f"not before the end of the run (duration {scenario.duration_s:g} s): the run would replay none of its "
                             f"{len(data.requests)} requests; lengthen the duration or lower time_scale", scenario.source)


def trace_data(trace: TraceSource) -> TraceData:
    """The requests of a workload's trace (`read_trace`); a trace of none, every line bad and skipped, is refused.
    The one reader of a workload's trace: `check_workload`, `generate_batch` (a run; `prfaas check`'s arrival rate and
    throughput model) and `prfaas check`'s skip_bad warning. The last `TRACES_KEPT` results are kept, keyed by the file
    as it is now (resolved path, device and inode, size, modification time in ns) and skip_bad: `prfaas check` read a
    large trace four times, seconds each, until 2026-12-07; an edited or replaced file is read again."""
    try:
        st = Path(trace.path).stat()
    except OSError:  # `read_trace` names the problem
        data = _read(trace.path, trace.skip_bad)
    else:
        data = _read_kept(trace.path, str(Path(trace.path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                          trace.skip_bad)
    if not data.requests:  # every line bad, and skipped: the run would have replayed nothing
        why = f"{data.skipped} bad lines skipped, the first: {data.problems[0]}" if data.problems else "it is empty"
        raise UserError(f"trace {data.path}: no requests ({why}); a workload's trace needs at least one")
    return data


# Traces `trace_data` keeps parsed: the last two (a large one holds its requests' block ids in memory for the process).
TRACES_KEPT = 2


def _read(path: str, skip_bad: bool) -> TraceData:
    return read_trace(path, skip_bad=skip_bad, skip_hint="set workload.trace.skip_bad: true to skip and count bad lines")


@functools.lru_cache(maxsize=TRACES_KEPT)
def _read_kept(path: str, resolved: str, dev: int, ino: int, size: int, mtime_ns: int, skip_bad: bool) -> TraceData:
    """`_read`, kept per file version (`trace_data`): the arguments after `path` are only the key (`path` as given
    too, so that the messages name the file as the scenario does). A `TraceData` is immutable (its requests a tuple of
    frozen `Request`s), so the kept one is handed to every caller."""
    return _read(path, skip_bad)


def generate_batch(spec: WorkloadSpec | None, seed: int, duration_s: float | None) -> RequestBatch:
    """Every request arriving in [0, duration_s) (a trace: all when duration_s is None), sorted by arrival.

    `spec` None (a scenario without a workload section) means the defaults: `WorkloadSpec()`.
    """
    spec = WorkloadSpec() if spec is None else spec
    seq = np.random.SeedSequence(spec.seed if spec.seed is not None else seed)
    rng_arrivals, rng_requests = (np.random.default_rng(s) for s in seq.spawn(2))
    if spec.trace is not None:
        return _from_trace(spec, rng_arrivals, duration_s)
    if duration_s is None or duration_s <= 0:
        raise UserError("a synthetic workload needs a duration > 0 (scenario duration or --duration)")
    if (why := too_many_requests(spec, duration_s)) is not None:  # before drawing: the draw is what fills memory
        raise UserError(f"the workload {why}")
    times = spec.arrivals.times(rng_arrivals, duration_s)
    if spec.max_requests is not None:
        times = times[: spec.max_requests]
    n = len(times)
    conv = build_conversations(rng_requests, n, spec.input, spec.output, spec.sessions, spec.system_prompts, duration_s)
    if n and conv.input_len.min() < 1:
        raise UserError("workload.input: drew a prompt of 0 tokens; every prompt needs at least 1 token")
    sys_tokens = spec.system_prompts.tokens if spec.system_prompts else 0
    offsets, hashes = assign_block_hashes(conv.input_len, conv.session_id, conv.system_prompt, sys_tokens)
    return RequestBatch(times, conv.input_len, conv.output_len, conv.session_id, offsets, hashes)


def _from_trace(spec: WorkloadSpec, rng: np.random.Generator, duration_s: float | None) -> RequestBatch:
    assert spec.trace is not None
    batch = trace_data(spec.trace).batch()
    batch = batch.take(np.argsort(batch.arrival_s, kind="stable"))
    horizon = np.inf if duration_s is None else duration_s
    if isinstance(spec.arrivals, TraceTimes):
        times = batch.arrival_s * spec.trace.time_scale
    else:
        if duration_s is None:
            raise UserError("replaying a trace with a new arrival process needs a duration")
        times = spec.arrivals.times(rng, duration_s)[: len(batch)]
        batch = batch.take(np.arange(len(times)))
    keep = np.flatnonzero(times < horizon)
    if spec.max_requests is not None:
        keep = keep[: spec.max_requests]
    batch = batch.take(keep)
    return RequestBatch(times[keep], batch.input_len, batch.output_len, batch.session_id, batch.hash_offsets, batch.hashes)


def generate(spec: WorkloadSpec | None, seed: int, duration_s: float | None) -> list[Request]:
    return generate_batch(spec, seed, duration_s).to_requests()


def iter_requests(spec: WorkloadSpec | None, seed: int, duration_s: float | None) -> Iterator[Request]:
    """`Request` objects built one at a time (the columns are drawn up front; the objects lazily)."""
    return iter(generate_batch(spec, seed, duration_s))
