"""The client agent (`testbed.serving.loadgen`) against a stand-in router on 127.0.0.1 speaking the
router's streaming format, and the assembly of requests.parquet rows (`testbed.runner.collect.requests_frame`)."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from analysis.metrics import drain_cut, early_stop, summarize
from testbed.clock import now_s
from testbed.runner.collect import requests_frame
from testbed.serving import loadgen
from testbed.serving.early_stop import MARGIN_S
from testbed.serving.loadgen import Client, LoadConfig
from traffic.request import Request

pytestmark = pytest.mark.timeout(60)


class StandIn:
    """Streams `max_tokens` chunks like the router; request ids starting with "fail" end in an error event,
    "drop" ones without any last chunk (the connection just closes),
    ids starting with "stall" wait for `stall` (when set) before answering, "slow" ones stream a token
    every 0.1 s."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.active = 0
        self.peak = 0
        self.lock = threading.Lock()
        self.stall: threading.Event | None = None
        self.stored = 0  # requests answered or abandoned: the router's stored records (`/v1/state`)
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a: Any) -> None:
                return

            def do_GET(self) -> None:
                state = {"ok": True, "requests": [{"route": "prfaas", "status": "any", "count": outer.stored}]}
                data = json.dumps(state).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                    outer.times.append(time.monotonic())
                    outer.active += 1
                    outer.peak = max(outer.peak, outer.active)
                rid = body["prfaas"]["request_id"]
                try:
                    self.stream(body, rid)
                finally:
                    with outer.lock:
                        outer.active -= 1
                        outer.stored += 1

            def stream(self, body: dict[str, Any], rid: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if rid.startswith("stall") and outer.stall is not None:
                    self.wfile.flush()
                    outer.stall.wait(30)  # headers sent, no token: a prefill queue that never reaches this request
                for i in range(body["max_tokens"]):
                    chunk = {"id": rid, "choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}]}
                    try:
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    except OSError:  # the client cancelled the stream
                        return
                    time.sleep(0.1 if rid.startswith("slow") else 0.01)
                if rid.startswith("drop"):
                    return  # every token, then the connection closes: no final chunk, no error event
                if rid.startswith("fail"):
                    last = {"error": {"message": f"request {rid} failed: decode instance 0: gone", "type": "worker_error"}}
                else:
                    last = {"id": rid, "choices": [{"text": "", "index": 0, "finish_reason": "length"}], "prfaas": {"route": "prfaas", "cached_len": 0}}
                self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]


@pytest.fixture
def router():
    r = StandIn()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def rows(path: Path) -> dict[str, dict[str, Any]]:
    return {r["request_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def reqs(n: int, gap_s: float, prefix: str = "r") -> list[dict[str, Any]]:
    return [{"request_id": f"{prefix}{i}", "arrival_s": i * gap_s, "input_len": 600, "output_len": 4, "block_hashes": [7, 8]}
            for i in range(n)]


def test_open_loop_sends_at_arrival_times_with_the_testbed_extension(router: StandIn, tmp_path: Path):
    cfg = LoadConfig("127.0.0.1", router.port, "", str(tmp_path / "out.jsonl"), request_timeout_s=10)
    client = Client(cfg)
    assert client.wait_ready()
    start = time.monotonic()
    for t in client.run_open(reqs(4, 0.3) + reqs(1, 1.0, "fail"), start):
        t.join(10)
    client.out.close()
    offsets = sorted(t - start for t in router.times)
    late_s = [o - s for o, s in zip(offsets[:4], [0.0, 0.3, 0.6, 0.9])]
    # Never before its arrival time (all at once would be 0.3-0.9 s early); lateness is a loose sanity
    # bound (0.1 s flaked once on a loaded 2-core host), not a timing measurement.
    assert min(late_s) > -0.02 and max(late_s) < 0.5, late_s
    body = next(b for b in router.bodies if b["prfaas"]["request_id"] == "r1")
    assert body["stream"] is True and body["max_tokens"] == 4
    assert body["prfaas"] == {"request_id": "r1", "input_len": 600, "block_hashes": [7, 8]}
    out = rows(tmp_path / "out.jsonl")
    assert out["r2"]["client_status"] == "ok" and out["r2"]["tokens_received"] == 4 and out["r2"]["route"] == "prfaas"
    assert out["r2"]["text"] == " t0 t1 t2 t3"
    assert out["r2"]["client_first_token_s"] <= out["r2"]["client_finish_s"]
    assert out["fail0"]["client_status"] == "failed" and "decode instance 0: gone" in out["fail0"]["client_reason"]
    # each row says how late the client sent it against the schedule (the same loose bound); "fail0", listed after
    # r3 with an arrival time of 0, went out with r3, 0.9 s behind
    late = {k: r["client_send_late_s"] for k, r in out.items()}
    assert all(0.0 <= late[f"r{i}"] < 0.5 for i in range(4)) and late["fail0"] >= 0.9 - 0.02, late


def test_the_client_records_how_far_behind_its_schedule_it_sent(router: StandIn, tmp_path: Path):
    """A schedule whose times have passed (a client starved of a core) is sent at once, and each row says by how
    much it was late: what `fidelity.client_timing` judges."""
    cfg = LoadConfig("127.0.0.1", router.port, "", str(tmp_path / "out.jsonl"), request_timeout_s=10)
    client = Client(cfg)
    for t in client.run_open(reqs(3, 0.5), now_s() - 2.0):  # due 2.0, 1.5 and 1.0 s ago
        t.join(10)
    client.out.close()
    late = [rows(tmp_path / "out.jsonl")[f"r{i}"]["client_send_late_s"] for i in range(3)]
    assert [round(x - due, 1) for x, due in zip(late, (2.0, 1.5, 1.0))] == [0.0, 0.0, 0.0], late


def test_closed_loop_keeps_at_most_the_users_in_flight(router: StandIn, tmp_path: Path):
    cfg = LoadConfig("127.0.0.1", router.port, "", str(tmp_path / "out.jsonl"), closed_users=2, think_s=0.01, duration_s=30)
    client = Client(cfg)
    for t in client.run_closed(reqs(8, 0.0), time.monotonic()):
        t.join(20)
    client.out.close()
    assert len(rows(tmp_path / "out.jsonl")) == 8
    assert router.peak == 2
    assert all(r["client_send_late_s"] is None for r in rows(tmp_path / "out.jsonl").values())  # no schedule to be late for


def test_a_router_that_never_answers_is_reported_after_the_startup_timeout(tmp_path: Path):
    cfg = LoadConfig("127.0.0.1", 9, "", str(tmp_path / "out.jsonl"), startup_timeout_s=0.5)
    assert Client(cfg).wait_ready() is False


def test_requests_frame_keeps_every_generated_request_and_names_why_one_failed():
    generated = [Request("a", 0.0, 100, 4, (1,)), Request("b", 0.5, 200, 4, (2,)), Request("c", 1.0, 300, 4, (3,))]
    router_rows = [{"request_id": "a", "arrival_s": 3.0, "route": "pd", "status": "ok", "kv_bytes": 10, "first_token_s": 3.5,
                    "finish_s": 4.0, "reason": None}]
    client_rows = [{"request_id": "a", "client_arrival_s": 2.99, "client_first_token_s": 3.51, "client_finish_s": 4.01,
                    "tokens_received": 4, "client_status": "ok", "client_reason": None, "route": "pd", "text": ""},
                   {"request_id": "b", "client_arrival_s": 3.5, "client_first_token_s": None, "client_finish_s": 5.0,
                    "tokens_received": 0, "client_status": "failed", "client_reason": "ConnectionRefusedError: refused",
                    "route": None, "text": ""}]
    df = requests_frame(generated, router_rows, client_rows).set_index("request_id")
    assert list(df.index) == ["a", "b", "c"]
    assert df.loc["a", "status"] == "ok" and df.loc["a", "kv_bytes"] == 10 and df.loc["a", "arrival_s"] == 3.0
    assert df.loc["b", "status"] == "failed" and df.loc["b", "reason"] == "ConnectionRefusedError: refused"
    assert df.loc["b", "arrival_s"] == 3.5
    assert df.loc["c", "status"] == "failed" and df.loc["c", "reason"] == "not sent before the run ended"
    assert df.loc["c", "scheduled_arrival_s"] == 1.0 and df.loc["c", "input_len"] == 300


def test_the_client_ends_a_run_that_cannot_pass_and_accounts_for_every_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no telemetry to relay
    router = StandIn()
    release = threading.Event()
    router.stall = release  # requests named "stall*" wait for this before their first token
    try:
        reqs = [{"request_id": f"stall{i}", "arrival_s": 0.05 * i, "input_len": 600, "output_len": 4, "block_hashes": [1]}
                for i in range(3)]
        reqs += [{"request_id": f"r{i}", "arrival_s": 0.2 + 0.25 * i, "input_len": 600, "output_len": 4, "block_hashes": [2]}
                 for i in range(17)]  # arrivals up to 4.2 s
        (tmp_path / "req.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
        cfg = {"router_host": "127.0.0.1", "router_port": router.port, "requests_file": str(tmp_path / "req.jsonl"),
               "out_file": str(tmp_path / "out.jsonl"), "request_timeout_s": 30, "slo_ttft_s": 0.3, "slo_tpot_s": 1.0,
               "stop_below": 0.9}
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        t0 = time.monotonic()
        assert loadgen.main(["--config", str(tmp_path / "cfg.json")]) == 0
        took = time.monotonic() - t0
    finally:
        release.set()
        router.server.shutdown()
        router.server.server_close()
    # 3 of 20 stalled: 17 (85%) can be good once they pass TTFT 0.3 s + margin: the run ends at ~0.9 s, not 30 s
    assert took < 0.3 + MARGIN_S + 1.5
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in rows) == sorted(r["request_id"] for r in reqs)
    by = {r["request_id"]: r for r in rows}
    assert all(by[f"stall{i}"]["client_status"] == "failed" and by[f"stall{i}"]["client_reason"].startswith("stopped early: 3 of 20")
               for i in range(3))
    assert by["r16"]["client_reason"].endswith("(not sent)")
    df = requests_frame([Request(r["request_id"], r["arrival_s"], 600, 4, tuple(r["block_hashes"])) for r in reqs], [], rows)
    assert early_stop(df) == "stopped early: 3 of 20 requests already missed an SLO, so fewer than 90% can be good"


def _drive(tmp_path: Path, reqs: list[dict[str, Any]], **cfg: Any) -> tuple[float, dict[str, dict[str, Any]]]:
    """loadgen.main against a stand-in router: (wall seconds, the client's rows by request id)."""
    import scipy.stats  # noqa: F401  (main imports it before the workload when stop_below is set: not timed here)

    router = StandIn()
    try:
        (tmp_path / "req.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
        conf = {"router_host": "127.0.0.1", "router_port": router.port, "requests_file": str(tmp_path / "req.jsonl"),
                "out_file": str(tmp_path / "out.jsonl"), "request_timeout_s": 30, **cfg}
        (tmp_path / "cfg.json").write_text(json.dumps(conf))
        t0 = time.monotonic()
        assert loadgen.main(["--config", str(tmp_path / "cfg.json")]) == 0
        return time.monotonic() - t0, rows(tmp_path / "out.jsonl")
    finally:
        router.server.shutdown()
        router.server.server_close()


def _slow_and_quick(slow: int, total: int = 20) -> list[dict[str, Any]]:
    """`slow` requests with 30-token answers (3 s of streaming) first, then quick 4-token ones, 50 ms apart."""
    return [{"request_id": f"slow{i}" if i < slow else f"r{i}", "arrival_s": 0.05 * i, "input_len": 600,
             "output_len": 30 if i < slow else 4, "block_hashes": [i]} for i in range(total)]


def test_the_client_cuts_the_drain_once_the_decoding_requests_cannot_change_the_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    reqs = _slow_and_quick(2)
    took, out = _drive(tmp_path, reqs, slo_ttft_s=1.0, slo_tpot_s=1.0, stop_below=0.9)
    # 18 of 20 certainly good (90%) whether or not the 2 still decoding end good: the same verdict either
    # way, so the run ends once the quick ones are done (~1 s), not after the slow answers' 3 s
    assert took < 2.6, took
    assert all(out[f"r{i}"]["client_status"] == "ok" for i in range(2, 20))
    for i in range(2):
        assert out[f"slow{i}"]["client_status"] == "cut" and out[f"slow{i}"]["client_first_token_s"] is not None
        assert out[f"slow{i}"]["client_reason"].startswith("drain cut: every request has its first token and 18 of 20")
    # the router's records as it keeps them: a cut stream is a client that went away
    router_rows = [{"request_id": k, "arrival_s": r["client_arrival_s"], "first_token_s": r["client_first_token_s"],
                    "finish_s": r["client_finish_s"], "status": "ok" if r["client_status"] == "ok" else "failed",
                    "reason": None if r["client_status"] == "ok" else "client disconnected"} for k, r in out.items()]
    df = requests_frame([Request(r["request_id"], r["arrival_s"], 600, r["output_len"], tuple(r["block_hashes"])) for r in reqs],
                        router_rows, list(out.values()))
    assert list(df.loc[df["status"] == "cut", "request_id"]) == ["slow0", "slow1"]
    assert df.set_index("request_id").loc["slow0", "reason"].startswith("drain cut")
    assert drain_cut(df) is not None and early_stop(df) is None
    s = summarize(df, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert (s["requests_ok"], s["requests_failed"], s["requests_cut"]) == (18, 0, 2)
    assert s["good_fraction"] == 0.9  # a cut request is not good: a lower bound
    # its TTFT counts: the mean is over all 20 first tokens
    assert s["ttft_s"]["mean"] == pytest.approx((df["first_token_s"] - df["arrival_s"]).mean())
    assert s["ttft_s"]["mean"] != pytest.approx((df["first_token_s"] - df["arrival_s"])[df["status"] == "ok"].mean())


def test_the_client_does_not_cut_a_drain_whose_decoding_requests_can_still_change_the_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    took, out = _drive(tmp_path, _slow_and_quick(3), slo_ttft_s=1.0, slo_tpot_s=1.0, stop_below=0.9)
    # 17 certainly good (85%): the 3 still decoding decide whether 90% are good, so nothing is cut before
    # the first of them has finished (3 s of streaming); then 18 are good and the other two can be cut
    assert took >= 3.0, took
    assert out["slow0"]["client_status"] == "ok" and all(out[f"r{i}"]["client_status"] == "ok" for i in range(3, 20))


def test_a_stream_that_breaks_after_the_router_took_it_is_not_counted_as_certainly_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Early stopping counts only certain failures: an error event, or a request the router never took. A stream
    that ends without its last chunk may still be ok in the router's record (which the run's figures read), so
    3 such requests of 20 do not stop the run (85% could no longer be good), while 3 error events do."""
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    slo = {"slo_ttft_s": 5.0, "slo_tpot_s": 1.0, "stop_below": 0.9}
    for prefix, stopped in (("drop", False), ("fail", True)):
        reqs = [{"request_id": f"{prefix}{i}" if i < 3 else f"r{i}", "arrival_s": 0.1 * i, "input_len": 600, "output_len": 4,
                 "block_hashes": [i]} for i in range(20)]
        _, by = _drive(tmp_path, reqs, **slo)
        reasons = [r["client_reason"] or "" for r in by.values()]
        assert any(x.startswith("stopped early") for x in reasons) is stopped, (prefix, reasons)
        if not stopped:
            assert sum(r["client_status"] == "ok" for r in by.values()) == 17  # every other request ran to its end
