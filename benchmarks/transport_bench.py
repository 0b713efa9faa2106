"""Transport benchmark: KV goodput vs iperf3 with the same number of TCP streams, side by side.

    sudo python benchmarks/transport_bench.py [--quick] [--connections 1,2,4,8] [--duration 10]
    python benchmarks/transport_bench.py --loopback        # no root: 127.0.0.1, no WAN (report only)

On the emulated WAN (testbed.net.emulation.Network: 5 Gbps wire, 10 ms one way, 0% and 0.1% loss,
scale 1) the KV receiver runs on `pd-d0` and the sender on `prfaas-p0`; for each number of streams
N, iperf3 -P N and the KV transport (profile mode: real bytes, framed and checksummed, every
transfer verified by the receiver before it counts) run one after the other on the same network.
KV goodput = verified payload bytes / (first byte queued .. last verdict received).
Target: KV goodput >= 0.95 x iperf3 at every N and loss (exit status 1 otherwise).
Beside it, "same-window" KV / iperf3: TCP bytes acknowledged on the KV connections during exactly the
seconds iperf3 measures (separates throughput from the wait for each transfer's last frames).
`--repeat R` runs each (loss, N) R times and prints the mean and a 95% t-interval of both ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from testbed.clock import now_s  # noqa: E402

TARGET_RATIO = 0.95
KV_PORT, IPERF_PORT = 9000, 5201
REQUEST_BYTES = 128 << 20  # one transfer: 16 layers of 8 MiB
LAYERS = 16
console = Console(width=max(140, Console().width))


# ------------------------------------------------------------------------------------------ roles

def run_receiver(port: int) -> int:
    """Accept KV transfers until SIGTERM; print one JSON line of totals at exit."""
    from testbed.kv.transport import KVReceiver, ReceivedKV

    totals = {"ok": 0, "failed": 0, "kv_bytes": 0, "reasons": []}
    lock = threading.Lock()

    def on_complete(rid: str, r: ReceivedKV) -> None:
        with lock:
            totals["ok" if r.ok else "failed"] += 1
            totals["kv_bytes"] += r.kv_bytes if r.ok else 0
            if not r.ok:
                totals["reasons"].append(r.reason)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with KVReceiver("0.0.0.0", port, on_complete):
        print("ready", flush=True)
        stop.wait()
    print(json.dumps(totals), flush=True)
    return 0


def run_sender(host: str, port: int, connections: int, duration_s: float, pipeline: int = 2,
               cc: str | None = None, lowat: int | None = -1) -> dict:
    """Send back-to-back profile-mode transfers for `duration_s` from `pipeline` threads (so the pipe never
    idles while a verdict is awaited); return the goodput."""
    from testbed.kv.transport import KVSender

    results: list = []
    lock = threading.Lock()
    extra = {} if lowat == -1 else {"notsent_lowat_bytes": lowat or None}
    with KVSender(host, port, connections=connections, congestion_control=cc, **extra) as tx:
        t_stop = now_s() + duration_s
        t0 = now_s()

        def worker(w: int) -> None:
            i = 0
            while now_s() < t_stop:
                rid = f"bench-{os.getpid()}-{connections}-{w}-{i}"
                for layer in range(LAYERS):
                    tx.send_bytes(rid, layer, "gqa", REQUEST_BYTES // LAYERS)
                st = tx.finish(rid)
                with lock:
                    results.append(st)
                i += 1

        from testbed.kv.transport import tcp_info

        def acked() -> int:
            return sum(s.bytes_acked for s in (tcp_info(c.sock, c.index) for c in tx._conns) if s is not None)

        acked0 = acked()
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(pipeline)]
        for t in threads:
            t.start()
        time.sleep(max(t_stop - now_s(), 0.0))
        window_bytes = acked() - acked0  # TCP payload acknowledged in exactly the window iperf3 measures
        for t in threads:
            t.join()
        congestion = tx.congestion()
    ok = [r for r in results if r.ok]
    end = max((r.end_s for r in results), default=t0)
    kv = sum(r.kv_bytes for r in ok)
    return {"connections": connections, "transfers": len(results), "failed": len(results) - len(ok),
            "kv_bytes": kv, "wire_bytes": sum(r.wire_bytes for r in ok), "elapsed_s": end - t0,
            "goodput_bps": 8 * kv / (end - t0) if end > t0 else 0.0, "retransmits": congestion["retransmits"],
            "window_bps": 8 * window_bytes / duration_s,
            "reasons": sorted({r.reason for r in results if not r.ok})[:3]}


def _iperf_bps(out: str) -> float:
    data = json.loads(out)
    if "error" in data:
        raise RuntimeError(f"iperf3: {data['error']}")
    return float(data["end"]["sum_received"]["bits_per_second"])


# ---------------------------------------------------------------------------------------- drivers

def bench_wan(loss: str, streams: list[int], duration_s: float, cc: str | None = None, lowat: int = -1,
              repeat: int = 1) -> list[dict]:
    from testbed.net.emulation import Network
    from testbed.sections import load_scenario

    sc = load_scenario("net-default", ["wan.rate=5Gbps", "wan.delay=10ms", f"wan.loss={loss}", "scale=1"])
    rows = []
    me = [sys.executable, str(Path(__file__).resolve())]
    with Network(sc, scale=1) as net:
        dst = net.host_ip("pd-d0")
        iperf_srv = net.popen("pd-d0", ["iperf3", "-s", "-p", str(IPERF_PORT)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        rx = net.popen("pd-d0", me + ["--role", "receiver", "--port", str(KV_PORT)], stdout=subprocess.PIPE, text=True)
        try:
            assert rx.stdout is not None and rx.stdout.readline().strip() == "ready", "KV receiver did not start"
            time.sleep(0.5)
            def fresh_metrics() -> None:
                """Forget the ssthresh/cwnd Linux caches per destination, so neither tool inherits the
                other's (after losses, a cached small ssthresh cripples the next connection's start)."""
                for host in ("prfaas-p0", "pd-d0"):
                    net.run(host, ["ip", "tcp_metrics", "flush", "all"])

            for k, n in enumerate([n for n in streams for _ in range(repeat)]):
                def iperf_run() -> float:
                    fresh_metrics()
                    ip = net.run("prfaas-p0", ["iperf3", "-c", dst, "-p", str(IPERF_PORT), "-P", str(n), "-t",
                                              str(int(duration_s)), "-J"] + (["-C", cc] if cc else []),
                                 timeout_s=duration_s + 30)
                    return _iperf_bps(ip.stdout)

                def kv_run() -> dict:
                    fresh_metrics()
                    kv = net.run("prfaas-p0", me + ["--role", "sender", "--host", dst, "--port", str(KV_PORT),
                                                    "--connections", str(n), "--duration", str(duration_s)]
                                 + (["--cc", cc] if cc else []) + (["--notsent-lowat", str(lowat)] if lowat != -1 else []),
                                 timeout_s=duration_s + 120)
                    if kv.returncode != 0:
                        raise RuntimeError(f"KV sender failed: {kv.stderr.strip()[-500:]}")
                    return json.loads(kv.stdout.strip().splitlines()[-1])

                if k % 2 == 0:  # alternate who goes first, so neither always meets a warm (or tired) path
                    iperf, res = iperf_run(), kv_run()
                else:
                    res = kv_run()
                    iperf = iperf_run()
                rows.append({"loss": loss, "cc": cc or "default", "streams": n, "iperf3_bps": iperf, **res,
                             "ratio": res["goodput_bps"] / iperf if iperf else 0.0,
                             "window_ratio": res["window_bps"] / iperf if iperf else 0.0})
                console.print(f"  loss {loss:5s} N={n}: iperf3 {iperf / 1e9:.2f} Gbps, KV {res['goodput_bps'] / 1e9:.2f} Gbps "
                              f"end to end, {res['window_bps'] / 1e9:.2f} Gbps acked in iperf3's window, "
                              f"{res['elapsed_s']:.1f} s to the last verdict, {res['transfers']} transfers")
        finally:
            rx.send_signal(signal.SIGTERM)
            try:
                rx.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                rx.kill()
            iperf_srv.terminate()
            iperf_srv.wait(5)
    return rows


def bench_loopback(streams: list[int], duration_s: float) -> list[dict]:
    """No WAN, no root: both tools on 127.0.0.1 (CPU-bound; shows the transport's own cost)."""
    import shutil

    rows = []
    me = [sys.executable, str(Path(__file__).resolve())]
    rx = subprocess.Popen(me + ["--role", "receiver", "--port", str(KV_PORT + 77)], stdout=subprocess.PIPE, text=True)
    srv = subprocess.Popen(["iperf3", "-s", "-p", str(IPERF_PORT + 77)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) if shutil.which("iperf3") else None
    try:
        assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        for n in streams:
            iperf = 0.0
            if srv is not None:
                out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(IPERF_PORT + 77), "-P", str(n), "-t",
                                      str(int(duration_s)), "-J"], capture_output=True, text=True, timeout=duration_s + 30)
                iperf = _iperf_bps(out.stdout)
            res = run_sender("127.0.0.1", KV_PORT + 77, n, duration_s)
            rows.append({"loss": "loopback", "cc": "default", "streams": n, "iperf3_bps": iperf, **res,
                         "ratio": res["goodput_bps"] / iperf if iperf else 0.0,
                         "window_ratio": res["window_bps"] / iperf if iperf else 0.0})
            console.print(f"  loopback N={n}: iperf3 {iperf / 1e9:.2f} Gbps, KV {res['goodput_bps'] / 1e9:.2f} Gbps")
    finally:
        rx.send_signal(signal.SIGTERM)
        rx.communicate(timeout=10)
        if srv is not None:
            srv.terminate()
            srv.wait(5)
    return rows


def summarize_repeats(rows: list[dict]) -> None:
    """Mean and 95% t-interval of KV / iperf3 per (loss, cc, N): whole-run goodput and same-window goodput."""
    from scipy import stats

    t = Table(title="KV / iperf3 over repetitions: mean [95% CI]")
    for col in ("loss", "cc", "streams", "reps", "end-to-end ratio", "same-window ratio"):
        t.add_column(col, justify="right")
    keys = sorted({(r["loss"], r.get("cc", "default"), r["streams"]) for r in rows})
    for key in keys:
        g = [r for r in rows if (r["loss"], r.get("cc", "default"), r["streams"]) == key]
        cells = []
        for col in ("ratio", "window_ratio"):
            x = [r[col] for r in g if col in r]
            if len(x) >= 2:
                m, sem = sum(x) / len(x), stats.sem(x)
                lo, hi = stats.t.interval(0.95, len(x) - 1, loc=m, scale=sem) if sem > 0 else (m, m)
                cells.append(f"{m:.3f} [{lo:.3f}, {hi:.3f}]")
            else:
                cells.append(f"{x[0]:.3f}" if x else "-")
        t.add_row(key[0], key[1], str(key[2]), str(len(g)), *cells)
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=KV_PORT, help=argparse.SUPPRESS)
    ap.add_argument("--connections", default="1,2,4,8", help="stream counts to compare (comma-separated)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--loss", default="0%,0.1%", help="WAN loss settings (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="N=4 only, 5 s per measurement")
    ap.add_argument("--loopback", action="store_true", help="127.0.0.1 without a WAN (no root needed; report only)")
    ap.add_argument("--cc", help="TCP congestion control for both tools (e.g. cubic); default: the host's")
    ap.add_argument("--notsent-lowat", type=int, default=-1, help="sender TCP_NOTSENT_LOWAT bytes (0: off; default: the transport's)")
    ap.add_argument("--json", type=Path, help="write the rows to this file")
    ap.add_argument("--repeat", type=int, default=1, help="repetitions per (loss, N); >= 5 gives a 95%% CI per setting")
    args = ap.parse_args(argv)

    if args.role == "receiver":
        return run_receiver(args.port)
    if args.role == "sender":
        print(json.dumps(run_sender(args.host, args.port, int(args.connections), args.duration, cc=args.cc,
                                    lowat=args.notsent_lowat)), flush=True)
        return 0

    streams = [4] if args.quick else [int(x) for x in args.connections.split(",")]
    duration = 5.0 if args.quick else args.duration
    if args.loopback:
        rows = bench_loopback(streams, duration)
    else:
        if os.geteuid() != 0:
            console.print("transport_bench: the emulated WAN needs root (network namespaces); run with sudo, "
                          "or --loopback for a report-only run without a WAN")
            return 2
        rows = []
        for loss in args.loss.split(","):
            rows += bench_wan(loss.strip(), streams, duration, args.cc, args.notsent_lowat, args.repeat)

    t = Table(title="KV transport vs iperf3, same streams, same network" + (" (loopback)" if args.loopback else
                                                                            " (5 Gbps, 10 ms one way)"))
    for col in ["loss", "cc", "streams", "iperf3 Gbps", "KV goodput Gbps", "KV / iperf3", "same-window KV / iperf3", "transfers", "failed", "retransmits"]:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["loss"], r.get("cc", "default"), str(r["streams"]), f"{r['iperf3_bps'] / 1e9:.3f}", f"{r['goodput_bps'] / 1e9:.3f}",
                  f"{r['ratio']:.3f}", f"{r.get('window_ratio', 0.0):.3f}", str(r["transfers"]), str(r["failed"]), str(r["retransmits"]))
    console.print(t)
    if args.repeat > 1:
        summarize_repeats(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.loopback:
        return 0
    missed = [r for r in rows if r["ratio"] < TARGET_RATIO or r["failed"]]
    for r in missed:
        console.print(f"[red]MISSED[/red] loss {r['loss']} N={r['streams']}: KV/iperf3 = {r['ratio']:.3f} "
                      f"(target {TARGET_RATIO}), failed transfers {r['failed']} {r['reasons']}")
    if not missed:
        console.print("[green]transport target met[/green]")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
