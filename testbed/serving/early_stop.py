"""Early stopping of a run, as MLPerf's loadgen stops a run whose result is already decided, in two forms.

A capacity probe passes only if at least a share ``stop_below`` (90%) of *all* its requests are good
(within the TTFT and the TPOT SLO). Once more than ``(1 - stop_below)`` of them have certainly missed an
SLO, no later event can make the run pass: the client ends the workload there (unsent and cancelled
requests are not good either), instead of feeding a diverging queue until every request has timed out.

"Certainly missed" is judged on the client's clock with a margin (`MARGIN_S`), because the run's
figures are the router's timestamps, which lie inside the client's (arrival later, first token
earlier): a request counts as missed only when its client-side TTFT exceeds the SLO by the margin, or
when even finishing this instant would give it a TPOT above the SLO with the margin taken off. So a
stop never rests on a request the run's own figures would have called good. Nothing here is a model
or an estimate; a run that is not certain to fail runs to its end. docs/experiments.md, "Early stopping".

The drain cut (`EarlyStop.drain_settled`) ends a run in its drain, after the last arrival, once the
capacity verdict it feeds (`experiments.capacity.judge`) can no longer change: the queue trend is final
(it samples the requests waiting before their first token only up to the last arrival, so it is final
once the requests still without a first token cannot move its sample step, the median TTFT:
`step_settled`), and the good fraction's three tests -- at least `stop_below`, its binomial interval
wholly above, wholly below (`good_tests`) -- come out the same whether the requests left all end good or
all end not good. The requests left are then cancelled and recorded as ``cut``, not failed.
docs/experiments.md, "The drain cut".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

MARGIN_S = 0.5  # client-vs-router clock slack per request (intra-DC hops are ~1 ms; 0.5 s covers a loaded host)
EARLY_STOP_PREFIX = "stopped early"
DRAIN_CUT_PREFIX = "drain cut"
CUT = "cut"  # the status of a request cancelled by the drain cut (client_status, then status in requests.parquet)
STEP_FLOOR_S = 1.0  # the queue trend's shortest sample step (`analysis.metrics.queue_trend`: max(1 s, median TTFT))
CONFIDENCE = 0.95  # the good fraction's binomial interval (Clopper-Pearson), as `experiments.capacity` judges it


def step_fixed(known_s: Sequence[float], waits_s: Sequence[float]) -> bool:
    """Is max(`STEP_FLOOR_S`, median TTFT) the same wherever TTFTs that are each at least one of `waits_s` end, given
    the `known_s` ones? Yes when the TTFT at the upper median rank of all is a known one that every wait exceeds
    (pandas' median reads ranks (n - 1) // 2 and n // 2, from 0), or that TTFT is at most the floor. The client's
    drain cut (`EarlyStop.step_settled`) and the run's check of it (`analysis.metrics.cut_trend_exact`) both ask."""
    known = sorted(known_s)
    upper = (len(known) + len(waits_s)) // 2
    return upper < len(known) and (min(waits_s) > known[upper] or known[upper] <= STEP_FLOOR_S)


def good_fraction_interval(good: int, requests: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Clopper-Pearson interval of a good fraction: `good` of `requests` as binomial trials."""
    from scipy.stats import binomtest

    ci = binomtest(good, requests).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def good_tests(good: int, requests: int, bar: float) -> tuple[bool, bool, bool]:
    """What a capacity verdict reads from a good count: (at least `bar` good, the binomial interval wholly
    above `bar`, wholly below it). Each is monotone in `good`, so two counts with the same tests agree on
    every count between them."""
    lo, hi = good_fraction_interval(good, requests)
    return good / requests >= bar, lo > bar, hi < bar


@dataclass
class EarlyStop:
    total: int  # requests of the whole run (sent or not)
    ttft_s: float
    tpot_s: float
    stop_below: float  # the share of all requests that must be good for the run to pass
    margin_s: float = MARGIN_S
    missed: int = 0  # finished requests that certainly missed an SLO
    good: int = 0  # finished requests certainly within every SLO (`request_good`)
    ttfts_s: list[float] = field(default_factory=list)  # client TTFTs of the finished requests that had a first token
    last_arrival_s: float = -math.inf  # the latest arrival counted (`finish`) or seen in flight (`drain_settled`)

    def request_missed(self, arrival_s: float, first_token_s: float | None, output_len: int, now_s: float,
                       failed: bool = False) -> bool:
        """Has this request certainly missed an SLO by `now_s` (its finish time when it has finished)?"""
        if failed:
            return True
        if first_token_s is None:
            return now_s - arrival_s > self.ttft_s + self.margin_s
        if first_token_s - arrival_s > self.ttft_s + self.margin_s:
            return True
        return output_len > 1 and (now_s - first_token_s - self.margin_s) / (output_len - 1) > self.tpot_s

    def request_good(self, arrival_s: float, first_token_s: float | None, output_len: int, finish_s: float) -> bool:
        """Is this request, which finished ok at `finish_s`, certainly within every SLO on the router's clock
        too? Its client-side TTFT bounds the router's from above; its TPOT gets the margin added."""
        if first_token_s is None or first_token_s - arrival_s > self.ttft_s:
            return False
        return output_len <= 1 or (finish_s - first_token_s + self.margin_s) / (output_len - 1) <= self.tpot_s

    def finish(self, arrival_s: float, first_token_s: float | None, output_len: int, finish_s: float, ok: bool,
               failed: bool | None = None) -> None:
        """Count a finished request. `failed`: whether it certainly failed (default: not `ok`). A stream that broke
        after the router took the request, with no error event, did not: the router's record, which the run's
        figures read, may call it ok, so it counts as missed only by its times."""
        self.missed += self.request_missed(arrival_s, first_token_s, output_len, finish_s, failed=not ok if failed is None else failed)
        self.good += ok and self.request_good(arrival_s, first_token_s, output_len, finish_s)
        self.last_arrival_s = max(self.last_arrival_s, arrival_s)
        if first_token_s is not None:
            self.ttfts_s.append(first_token_s - arrival_s)

    def decide(self, in_flight: list[tuple[float, float | None, int]], now_s: float) -> str | None:
        """The reason to stop now, or None: `in_flight` holds (arrival, first token or None, output_len)."""
        late = sum(self.request_missed(a, f, n, now_s) for a, f, n in in_flight)
        missed = self.missed + late
        if self.total - missed < self.stop_below * self.total:
            return (f"{EARLY_STOP_PREFIX}: {missed} of {self.total} requests already missed an SLO, so fewer than "
                    f"{self.stop_below:.0%} can be good")
        return None

    def step_settled(self, in_flight: list[tuple[float, float | None, int]], now_s: float) -> bool:
        """Can the requests in flight that still wait for a first token no longer change the queue trend's series
        (`analysis.metrics.queue_trend`)? It counts the requests waiting before their first token only up to the
        last arrival, every max(1 s, median TTFT). So it is final once (1) every such request's first token comes
        after the router's last arrival, which the margins bound: now is more than 2 margins past the last
        arrival; and (2) the median is the same wherever their TTFTs end: they are already longer (their waits,
        less 2 margins, bound the router's TTFT from below) than the TTFT at the upper median rank of all, which
        therefore falls among the known ones (whose client TTFTs bound the router's from above), or that TTFT is
        at most 1 s, the step's floor. The run's summary then reads their TTFT as beyond every known one (a cut
        request without a first token, `queue_trend`), as every later first token would."""
        waits = [now_s - a - 2 * self.margin_s for a, f, _ in in_flight if f is None]
        if not waits:
            return True
        last = max(self.last_arrival_s, max(a for a, _, _ in in_flight))
        if now_s <= last + 2 * self.margin_s:
            return False
        return step_fixed(self.ttfts_s + [f - a for a, f, _ in in_flight if f is not None], waits)

    def drain_settled(self, in_flight: list[tuple[float, float | None, int]], now_s: float) -> str | None:
        """The reason to cut the drain now, or None. Call only once every request has been sent: `in_flight`
        holds the unfinished ones (arrival, first token or None, output_len)."""
        if not in_flight or not self.step_settled(in_flight, now_s):
            return None  # nothing left to cut; or a request without a first token can still move the queue trend
        late = sum(self.request_missed(a, f, n, now_s) for a, f, n in in_flight)
        lo, hi = self.good, self.total - self.missed - late
        if good_tests(lo, self.total, self.stop_below) != good_tests(hi, self.total, self.stop_below):
            return None
        waiting = sum(f is None for _, f, _ in in_flight)
        first = ("every request has its first token" if not waiting else
                 f"the {waiting} still without a first token cannot move the median TTFT, which fixes the queue trend,")
        return (f"{DRAIN_CUT_PREFIX}: {first} and {lo} of {self.total} are certainly good, {self.total - hi} certainly not, "
                f"so the {len(in_flight)} {'left' if waiting else 'still decoding'} cannot change the verdict")
