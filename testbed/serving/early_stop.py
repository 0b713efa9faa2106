"""Early stopping of a run, as MLPerf's loadgen stops a run whose result is already decided.

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
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN_S = 0.5  # client-vs-router clock slack per request (intra-DC hops are ~1 ms; 0.5 s covers a loaded host)
EARLY_STOP_PREFIX = "stopped early"


@dataclass
class EarlyStop:
    total: int  # requests of the whole run (sent or not)
    ttft_s: float
    tpot_s: float
    stop_below: float  # the share of all requests that must be good for the run to pass
    margin_s: float = MARGIN_S
    missed: int = 0  # finished requests that certainly missed an SLO

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

    def finish(self, arrival_s: float, first_token_s: float | None, output_len: int, finish_s: float, ok: bool) -> None:
        """Count a finished request."""
        self.missed += self.request_missed(arrival_s, first_token_s, output_len, finish_s, failed=not ok)

    def decide(self, in_flight: list[tuple[float, float | None, int]], now_s: float) -> str | None:
        """The reason to stop now, or None: `in_flight` holds (arrival, first token or None, output_len)."""
        late = sum(self.request_missed(a, f, n, now_s) for a, f, n in in_flight)
        missed = self.missed + late
        if self.total - missed < self.stop_below * self.total:
            return (f"{EARLY_STOP_PREFIX}: {missed} of {self.total} requests already missed an SLO, so fewer than "
                    f"{self.stop_below:.0%} can be good")
        return None
