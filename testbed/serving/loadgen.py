"""The run's client agent on host ``pd-client``: ``python -m testbed.serving.loadgen --config FILE``.

It drives the workload against the router's OpenAI-compatible ``/v1/completions`` (``stream: true``,
the testbed extension ``"prfaas": {request_id, input_len, block_hashes}``), one thread per request at
its arrival time (open loop) or N users with think times (closed loop), and records what the client
saw. Because it is the only process of the run inside the PD datacenter's client host, it also relays
the run's WAN telemetry (JSON lines on stdin) to the router's ``/v1/telemetry`` and reports progress
and the router's state as JSON lines on stdout, which `testbed.runner.live` reads.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.clock import now_s, run_t0
from testbed.serving.early_stop import CUT, EarlyStop


@dataclass
class LoadConfig:
    router_host: str
    router_port: int
    requests_file: str  # JSON lines: request_id, arrival_s, input_len, output_len, block_hashes
    out_file: str  # JSON lines, one per finished request
    model: str = "prfaas"
    request_timeout_s: float = 120.0
    startup_timeout_s: float = 60.0
    closed_users: int = 0  # > 0: closed loop with this many users
    think_s: float = 1.0
    duration_s: float = 60.0
    seed: int = 1
    state_period_s: float = 0.5
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    stop_below: float | None = None  # early stopping (testbed.serving.early_stop); None: never


RECORDS_WAIT_S = 10.0  # after a drain cut, how long the client waits for the router's records (`Client.await_records`)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Client:
    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.out = open(cfg.out_file, "w")
        self.sent = self.done = self.ok = 0
        self.accepted = 0  # requests the router answered with 200: each gets a stored record (`await_records`)
        self.stop = threading.Event()
        self.early: EarlyStop | None = None
        self.stopped: str | None = None  # the early stop's reason
        self.cut: str | None = None  # the drain cut's reason (`EarlyStop.drain_settled`)
        self.cut_ids: set[str] = set()  # the requests in flight when the drain was cut
        self.flight: dict[str, list[Any]] = {}  # request id -> [arrival, first token, output_len, socket or None]
        self.started_ids: set[str] = set()

    def _conn(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.cfg.router_host, self.cfg.router_port, timeout=timeout_s)

    def get(self, path: str, timeout_s: float = 2.0) -> Any:
        c = self._conn(timeout_s)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return json.loads(r.read()) if r.status == 200 else None
        finally:
            c.close()

    def post(self, path: str, body: Any, timeout_s: float = 2.0) -> None:
        c = self._conn(timeout_s)
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            c.getresponse().read()
        finally:
            c.close()

    def wait_ready(self) -> bool:
        deadline = now_s() + self.cfg.startup_timeout_s
        while now_s() < deadline:
            try:
                if self.get("/healthz", 1.0):
                    return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def one(self, req: dict[str, Any], due_s: float | None = None) -> None:
        """One streamed completion; the row says what the client saw, failures with their reason. `due_s`: when
        the workload's schedule asked for it (open loop; the `now_s` clock), so the row says how late it went out."""
        rid = str(req["request_id"])
        sent_s = now_s()
        row: dict[str, Any] = {"request_id": rid, "client_arrival_s": sent_s - run_t0(), "client_first_token_s": None,
                               "client_finish_s": None, "tokens_received": 0, "client_status": "failed",
                               "client_reason": None, "route": None, "text": "",
                               "client_send_late_s": None if due_s is None else max(0.0, sent_s - due_s)}
        body = {"model": self.cfg.model, "prompt": "", "max_tokens": int(req["output_len"]), "stream": True,
                "prfaas": {"request_id": rid, "input_len": int(req["input_len"]), "block_hashes": list(req["block_hashes"])}}
        conn = self._conn(self.cfg.request_timeout_s)
        with self.lock:
            self.sent += 1
            self.started_ids.add(rid)
            self.flight[rid] = [row["client_arrival_s"], None, int(req["output_len"]), None]
        deadline = now_s() + self.cfg.request_timeout_s
        parts: list[str] = []
        errored = False  # the router answered with an error event: a failure, whatever stops the run
        taken = False  # the router answered 200: it records the request, whatever this end then sees
        try:
            if self.stop.is_set():  # the run was stopped early while this request was starting
                raise ConnectionAbortedError("cancelled before it was sent")
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            with self.lock:  # the socket itself: the response keeps it after the connection hands it over
                self.flight[rid][3] = conn.sock
                if self.stopped:
                    _abort(conn.sock)
            resp = conn.getresponse()
            if resp.status != 200:
                row["client_reason"] = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
            else:
                taken = True
                with self.lock:
                    self.accepted += 1
                for line in resp:
                    if now_s() > deadline:
                        row["client_reason"] = f"no answer within {self.cfg.request_timeout_s:g}s"
                        break
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    ev = json.loads(payload)
                    if "error" in ev:
                        row["client_reason"] = ev["error"].get("message")
                        errored = True
                        continue
                    text = ev["choices"][0].get("text") or ""
                    if text:
                        if row["client_first_token_s"] is None:
                            row["client_first_token_s"] = now_s() - run_t0()
                            with self.lock:
                                self.flight[rid][1] = row["client_first_token_s"]
                        parts.append(text)
                        row["tokens_received"] += 1
                    if ev.get("prfaas"):
                        row["route"] = ev["prfaas"].get("route")
                        if ev["choices"][0].get("finish_reason"):
                            row["client_status"] = "ok"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            row["client_reason"] = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        row["client_finish_s"] = now_s() - run_t0()
        row["text"] = "".join(parts)
        with self.lock:
            self.flight.pop(rid, None)
            if self.stopped and row["client_status"] != "ok":
                row["client_reason"] = f"{self.stopped} ({row['client_reason'] or 'cancelled'})"
            elif rid in self.cut_ids and row["client_status"] != "ok" and not errored:  # its stream was cut, nothing else
                row["client_status"], row["client_reason"] = CUT, self.cut
            if self.early is not None:
                ok = row["client_status"] == "ok"  # a stream broken after a 200 with no error event: not certainly failed
                self.early.finish(row["client_arrival_s"], row["client_first_token_s"], int(req["output_len"]),
                                  row["client_finish_s"], ok, failed=not ok and (errored or not taken))
            self.done += 1
            self.ok += row["client_status"] == "ok"
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def run_open(self, requests: list[dict[str, Any]], start: float) -> list[threading.Thread]:
        threads = []
        for req in requests:
            due_s = start + float(req["arrival_s"])
            delay = due_s - now_s()
            if (delay > 0 and self.stop.wait(delay)) or self.stop.is_set():
                break
            t = threading.Thread(target=self.one, args=(req, due_s), daemon=True)
            t.start()
            threads.append(t)
        return threads

    def run_closed(self, requests: list[dict[str, Any]], start: float) -> list[threading.Thread]:
        it = iter(requests)
        lock = threading.Lock()
        rng = random.Random(self.cfg.seed)

        def user() -> None:
            while not self.stop.is_set() and now_s() < start + self.cfg.duration_s:
                with lock:
                    req = next(it, None)
                    think = rng.expovariate(1.0 / self.cfg.think_s) if self.cfg.think_s > 0 else 0.0
                if req is None:
                    return
                self.one(req)
                if self.stop.wait(think):
                    return

        threads = [threading.Thread(target=user, daemon=True) for _ in range(self.cfg.closed_users)]
        for t in threads:
            t.start()
        return threads

    def watch_early_stop(self, period_s: float = 0.2) -> None:
        """Stop the run once it cannot pass any more (`EarlyStop.decide`): no more arrivals, in-flight requests
        cancelled; or, once every request has been sent, cut its drain once the verdict cannot change
        (`EarlyStop.drain_settled`): the requests still decoding are cancelled and recorded as ``cut``."""
        while not self.stop.wait(period_s):
            with self.lock:
                flight = [(a, f, n) for a, f, n, _ in self.flight.values()]
                t = now_s() - run_t0()
                reason = self.early.decide(flight, t)
                cut = self.early.drain_settled(flight, t) if reason is None and self.sent == self.early.total else None
                if reason is None and cut is None:
                    continue
                self.stopped, self.cut = reason, cut
                if cut:
                    self.cut_ids = set(self.flight)
                for *_, sock in self.flight.values():
                    _abort(sock)
            self.stop.set()
            _emit({"kind": "early_stop", "reason": reason} if reason else {"kind": "drain_cut", "reason": cut})
            return

    def await_records(self, timeout_s: float = RECORDS_WAIT_S) -> bool:
        """After a drain cut: wait until the router has stored a record of every request it accepted (it notices a
        cancelled stream at once before its first token, at its next token after it, and then stores the record with the
        request's prefill times),
        so that the run's end, which stops the router, loses none. False when it has not within `timeout_s`."""
        deadline = now_s() + timeout_s
        while now_s() < deadline:
            try:
                state = self.get("/v1/state")
            except (OSError, ValueError, http.client.HTTPException):
                state = None
            if state and sum(int(r.get("count", 0)) for r in state.get("requests", [])) >= self.accepted:
                return True
            time.sleep(0.05)
        return False

    def record_unsent(self, requests: list[dict[str, Any]]) -> None:
        """After an early stop, a row for every request never sent, with the stop's reason."""
        for req in requests:
            rid = str(req["request_id"])
            if rid not in self.started_ids:
                self.out.write(json.dumps({"request_id": rid, "client_arrival_s": None, "client_first_token_s": None,
                                           "client_finish_s": None, "tokens_received": 0, "client_status": "failed",
                                           "client_reason": f"{self.stopped} (not sent)", "route": None, "text": "",
                                           "client_send_late_s": None}) + "\n")


def _abort(sock: Any) -> None:
    """End a request's stream now (its reader returns at once); None: not connected yet."""
    if sock is None:
        return
    try:
        sock.shutdown(2)  # SHUT_RDWR
    except OSError:
        pass


def _relay_telemetry(client: Client) -> None:
    """stdin JSON lines (WAN samples from the run) -> the router's /v1/telemetry."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            client.post("/v1/telemetry", json.loads(line))
        except (OSError, ValueError, http.client.HTTPException):
            pass  # a lost sample; the next one follows within 100 ms


def _report(client: Client) -> None:
    while not client.stop.wait(client.cfg.state_period_s):
        try:
            state = client.get("/v1/state")
        except (OSError, ValueError, http.client.HTTPException):
            state = None
        _emit({"kind": "progress", "sent": client.sent, "done": client.done, "ok": client.ok, "router": state})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.serving.loadgen")
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    cfg = LoadConfig(**json.loads(Path(args.config).read_text()))
    requests = [json.loads(x) for x in Path(cfg.requests_file).read_text().splitlines() if x.strip()]
    client = Client(cfg)
    if cfg.stop_below is not None:  # the drain cut's binomial interval: scipy imported now, not under the lock mid-run (~1-3 s)
        import scipy.stats  # noqa: F401
    if not client.wait_ready():
        _emit({"kind": "error", "message": f"router {cfg.router_host}:{cfg.router_port} not ready within {cfg.startup_timeout_s:g}s"})
        return 1
    threading.Thread(target=_relay_telemetry, args=(client,), daemon=True).start()
    start = now_s()
    _emit({"kind": "started", "t_s": start - run_t0(), "requests": len(requests)})
    threading.Thread(target=_report, args=(client,), daemon=True).start()
    if cfg.stop_below is not None and cfg.slo_ttft_s is not None and cfg.slo_tpot_s is not None and requests:
        client.early = EarlyStop(len(requests), cfg.slo_ttft_s, cfg.slo_tpot_s, cfg.stop_below)
        threading.Thread(target=client.watch_early_stop, daemon=True).start()
    runner = client.run_closed if cfg.closed_users > 0 else client.run_open
    threads = runner(requests, start)
    for t in threads:
        t.join(max(0.0, cfg.request_timeout_s + 5))
    client.stop.set()
    if client.cut and not client.await_records():
        print(f"drain cut: the router had not stored every request's record within {RECORDS_WAIT_S:g}s", file=sys.stderr)
    if client.stopped:
        with client.lock:
            client.record_unsent(requests)
    client.out.close()
    _emit({"kind": "finished", "sent": client.sent, "done": client.done, "ok": client.ok, "t_s": now_s() - run_t0()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
