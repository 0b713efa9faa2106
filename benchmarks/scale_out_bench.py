"""Scale-out benchmark (issue 14), measured side by side in one invocation, as root:

1. **Fidelity side by side**: a lone run, then two runs at once (`--executor local:2`); each run's
   fidelity figures (RTT p50 vs configured, goodput ratio, sleep lateness p99, schedule lateness p99,
   delay-line cores) and its TTFT p50 in one table. Target: both parallel runs complete with 0 failed
   requests, and either they stay within tolerance (RTT within 0.5 ms, sleeps late <= 5 ms at p99) or
   they are flagged and `prfaas doctor` suggests local:1 for this host.
2. **Wall time of an experiment**: the same runs with `local`, `local:2` and a real 2-node Ray cluster
   on this host (head + one worker node). Reported as ratios to `local`; target <= 0.6x on a host with
   >= 4 cores (not judged on fewer: two runs cannot both have their cores).
3. **Node loss**: the 2-node cluster loses its worker node while a run is on it: every run still ends
   ok exactly once (the lost one retried on the head node), and `prfaas clean` leaves no network,
   bridge or process behind.

Full: the `quick` scenario (30 s of traffic) and an 8-run experiment (about 25 minutes on 2 cores).
`--quick`: a 6 s micro variant of it and a 4-run experiment (about 6 minutes).

    sudo .venv/bin/python benchmarks/scale_out_bench.py --quick [--json FILE] [--skip-ray]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from experiments.engine import run_tasks  # noqa: E402
from experiments.executor import Executor, RunTask, SequentialExecutor  # noqa: E402
from testbed.fidelity import TOLERANCES, suggest_parallelism  # noqa: E402
from testbed.scenario import builtin_scenarios_dir  # noqa: E402

SPEEDUP_TARGET = 0.6
MIN_CORES_FOR_SPEEDUP = 4


def scenario_file(tmp: Path, quick: bool) -> str:
    data = yaml.safe_load((builtin_scenarios_dir() / "quick.yaml").read_text())
    if quick:  # the micro variant the integration tests use
        data.update(name="quick-micro", duration="6s")
        data["wan"]["schedule"] = [{"at": "2s", "rate": "2Gbps", "for": "2s", "direction": "prfaas_to_pd"}]
        data["workload"]["arrivals"] = {"process": "poisson", "rate": "1/s"}
        data["workload"]["output"] = 16
        data["serving"]["instances"] = {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1}
    path = tmp / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def tasks(sc: str, out: Path, seeds: list[int]) -> list[RunTask]:
    return [RunTask(key=f"s{s}", scenario=sc, overrides=(f"seed={s}",), out_dir=out / f"s{s}") for s in seeds]


def run_all(ts: list[RunTask], ex: Executor) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    outcomes = run_tasks(ts, ex, progress=False)
    return time.monotonic() - t0, outcomes


def row(label: str, task: RunTask, status: str) -> dict[str, Any]:
    s = json.loads((task.out_dir / "summary.json").read_text()) if (task.out_dir / "summary.json").exists() else {}
    f = json.loads((task.out_dir / "fidelity.json").read_text()) if (task.out_dir / "fidelity.json").exists() else {}
    wan, cpu = f.get("wan", {}), f.get("cpu", {})
    return {"case": label, "run": task.key, "status": status, "failed_requests": s.get("requests_failed"),
            "ttft_p50_s": (s.get("ttft_s") or {}).get("p50"), "rtt_p50_ms": (wan.get("rtt_p50_s") or float("nan")) * 1e3,
            "rtt_configured_ms": (wan.get("configured_rtt_s") or float("nan")) * 1e3, "rate_ratio": wan.get("rate_ratio"),
            "sleep_late_p99_ms": ((f.get("sleep") or {}).get("late_p99_s") or float("nan")) * 1e3,
            "schedule_late_p99_ms": ((f.get("schedule") or {}).get("late_p99_s") or float("nan")) * 1e3,
            "delayline_cores": max((cpu.get("delayline_cores") or {"-": 0}).values()), "host_busy": cpu.get("host_busy_share"),
            "flags": f.get("flags")}


def fmt(x: Any, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def part_fidelity(sc: str, tmp: Path) -> dict[str, Any]:
    from experiments.parallel import ParallelExecutor

    lone = tasks(sc, tmp / "lone", [1])
    pair = tasks(sc, tmp / "pair", [1, 2])
    _, o1 = run_all(lone, SequentialExecutor())
    _, o2 = run_all(pair, ParallelExecutor(2, warn=False))
    rows = [row("alone", lone[0], o1["s1"].status)] + [row("2 at once", t, o2[t.key].status) for t in pair]
    print("\n1. timing fidelity, a lone run beside two runs at once")
    cols = ("case", "run", "status", "failed_requests", "ttft_p50_s", "rtt_p50_ms", "rate_ratio", "sleep_late_p99_ms",
            "schedule_late_p99_ms", "delayline_cores", "host_busy")
    print("  " + " | ".join(cols))
    for r in rows:
        print("  " + " | ".join(fmt(r[c]) for c in cols))
        if r["flags"]:
            print(f"      flagged: {'; '.join(r['flags'])}")
    parallel = rows[1:]
    completed = all(r["status"] == "ok" and r["failed_requests"] == 0 for r in parallel)
    suggested = suggest_parallelism(os.cpu_count() or 1)
    verdicts = [run_verdict(r, suggested) for r in parallel]
    met = completed and all(v != "out of tolerance, not flagged" for v in verdicts)
    print(f"  target: both complete with 0 failed ({completed}); each run within tolerance, or flagged with doctor "
          f"suggesting local:1 (suggests local:{suggested}): {', '.join(verdicts)} -> {'met' if met else 'NOT MET'}")
    return {"rows": rows, "completed": completed, "verdicts": verdicts, "doctor_suggests": suggested, "met": met}


def run_verdict(r: dict[str, Any], suggested: int) -> str:
    """Per run (the target's two cases): within the RTT and sleep tolerances, or flagged while doctor suggests 1."""
    within = (abs(r["rtt_p50_ms"] - r["rtt_configured_ms"]) <= TOLERANCES.rtt_abs_s * 1e3
              and r["sleep_late_p99_ms"] <= TOLERANCES.sleep_late_p99_s * 1e3)
    if within:
        return "within tolerance"
    return "flagged, doctor suggests 1" if r["flags"] and suggested == 1 else "out of tolerance, not flagged"


def part_wall(sc: str, tmp: Path, n_runs: int, with_ray: bool) -> dict[str, Any]:
    from experiments.parallel import ParallelExecutor

    seeds = list(range(1, n_runs + 1))
    walls: dict[str, float] = {}
    ok: dict[str, int] = {}
    for name, make in (("local", SequentialExecutor), ("local:2", lambda: ParallelExecutor(2, warn=False))):
        walls[name], o = run_all(tasks(sc, tmp / name.replace(":", "-"), seeds), make())
        ok[name] = sum(x.status == "ok" for x in o.values())
    if with_ray:
        from experiments.ray_executor import RayExecutor
        from experiments.ray_local import LocalRayCluster

        with LocalRayCluster(workers=1) as cluster:
            walls["ray (2 nodes)"], o = run_all(tasks(sc, tmp / "ray", seeds), RayExecutor(cluster.address, progress=False))
            ok["ray (2 nodes)"] = sum(x.status == "ok" for x in o.values())
            import ray

            ray.shutdown()
    cores = os.cpu_count() or 1
    print(f"\n2. wall time of a {n_runs}-run experiment ({cores} cores)")
    judged = cores >= MIN_CORES_FOR_SPEEDUP
    met = True
    for name, w in walls.items():
        ratio = w / walls["local"]
        print(f"  {name:14s} {w:7.1f} s   {ratio:.2f}x of local   {ok[name]}/{n_runs} ok")
        if name != "local" and judged and ratio > SPEEDUP_TARGET:
            met = False
    print(f"  target <= {SPEEDUP_TARGET}x on >= {MIN_CORES_FOR_SPEEDUP} cores: " + ("met" if met else "NOT MET") if judged
          else f"  target <= {SPEEDUP_TARGET}x applies on >= {MIN_CORES_FOR_SPEEDUP} cores; this host has {cores}: reported only")
    all_ok = all(v == n_runs for v in ok.values())
    return {"wall_s": walls, "ok": ok, "judged": judged, "met": met and all_ok}


def part_node_loss(sc: str, tmp: Path) -> dict[str, Any]:
    from experiments.ray_executor import RayExecutor
    from experiments.ray_local import LocalRayCluster, kill_node_when_running
    from testbed.net import cleanup, state
    from testbed.net.cleanup import _our_bridges

    ts = tasks(sc, tmp / "loss", [1, 2, 3])
    outcomes: list[Any] = []
    import threading

    with LocalRayCluster(workers=1) as cluster:
        ex = RayExecutor(cluster.address, progress=False)
        th = threading.Thread(target=ex.run, args=(ts, outcomes.append), daemon=True)
        th.start()
        killed = kill_node_when_running(cluster, 1)
        th.join(1800)
        import ray

        ray.shutdown()
    keys = [o.task.key for o in outcomes]
    complete = sorted(keys) == sorted(t.key for t in ts) and all(o.status == "ok" for o in outcomes)
    ok_dirs = all((t.out_dir / "summary.json").exists() for t in ts)
    rep = cleanup.clean()
    left = {"states": [p.name for p, _ in state.list_states()], "bridges": _our_bridges(),
            "netns": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()}
    nothing_left = not any(left.values())
    met = killed is not None and complete and ok_dirs and nothing_left
    print("\n3. node loss: the worker node killed while a run was on it")
    print(f"  killed a run in progress: {killed is not None}; outcomes {keys}; every run ok exactly once: {complete}; "
          f"run directories complete: {ok_dirs}")
    print(f"  prfaas clean removed {len(rep.networks)} network(s), {len(rep.processes)} process(es); left afterwards: {left} "
          f"-> {'met' if met else 'NOT MET'}")
    return {"killed": killed is not None, "outcomes": keys, "complete": complete, "cleaned_networks": len(rep.networks),
            "left": left, "met": met}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 s micro runs and a 4-run experiment")
    ap.add_argument("--skip-ray", action="store_true", help="only the local executors (no Ray cluster)")
    ap.add_argument("--json", type=Path, metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("scale_out_bench: run as root (network namespaces)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="prfaas-scaleout-") as td:
        tmp = Path(td)
        sc = scenario_file(tmp, args.quick)
        res = {"host_cpus": os.cpu_count(), "quick": args.quick, "fidelity": part_fidelity(sc, tmp)}
        res["wall"] = part_wall(sc, tmp, 4 if args.quick else 8, not args.skip_ray)
        if not args.skip_ray:
            res["node_loss"] = part_node_loss(sc, tmp)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    met = all(part.get("met", True) for part in res.values() if isinstance(part, dict))
    print("\nall targets met" if met else "\nsome target NOT MET")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
