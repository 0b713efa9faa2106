"""`prfaas doctor`: what this host supports, and which WAN backend a run would use.

Kernel features are probed for real inside throwaway network namespaces (`unshare --net`, gone when
the probe exits), not guessed from module lists (kernels without loadable modules have none).
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True  # a missing required feature stops `net up`


def _probe(argv: list[str], timeout_s: float = 10) -> tuple[bool, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    text = (r.stderr or r.stdout).strip().splitlines()
    return r.returncode == 0, (text[0] if text else f"exit {r.returncode}")


def _in_netns(shell: str) -> tuple[bool, str]:
    return _probe(["unshare", "--net", "sh", "-c", shell])


def _tool(name: str) -> Check:
    path = shutil.which(name)
    return Check(name, path is not None, path or f"not found: install it (apt-get install {name})")


def _module(name: str, required: bool = True) -> Check:
    try:
        mod = importlib.import_module(name)
        return Check(f"python: {name}", True, getattr(mod, "__version__", "importable"), required)
    except Exception as exc:
        return Check(f"python: {name}", False, f"{type(exc).__name__}: {exc}", required)


def run_checks() -> list[Check]:
    from testbed.net.netem import netem_available

    root = os.geteuid() == 0
    checks = [Check("root", root, "uid 0" if root else "run as root (sudo): namespaces and qdiscs need it")]
    for tool in ("ip", "tc", "unshare", "mnexec", "iptables-legacy", "iperf3", "ping", "ethtool"):
        checks.append(_tool(tool))
    if root:
        ok, why = _probe(["unshare", "--net", "true"])
        checks.append(Check("network namespaces", ok, "unshare --net works" if ok else why))
        ok, why = _in_netns("ip link add name va type veth peer name vb")
        checks.append(Check("veth", ok, "ok" if ok else why))
        for kind in ("htb", "tbf"):
            ok, why = _in_netns(f"tc qdisc add dev lo root {kind} " + ("default 10" if kind == "htb" else "rate 1gbit burst 128k limit 1m"))
            checks.append(Check(f"qdisc {kind}", ok, "ok" if ok else why))
        ok, why = _in_netns("ip link add b0 type bridge")
        checks.append(Check("linux bridge", ok, "ok" if ok else why))
        ok, why = _in_netns("iptables-legacy -A FORWARD -j NFQUEUE --queue-num 1 --queue-bypass")
        checks.append(Check("NFQUEUE (iptables-legacy)", ok, "ok: the delay line can run" if ok else why))
        has_netem, why = netem_available()
        checks.append(Check("netem", has_netem, why, required=False))
    for mod, req in (("mininet.net", True), ("pyroute2", True), ("pandas", True), ("pyarrow", True), ("rich", True)):
        checks.append(_module(mod, req))
    checks.append(_torch_check())
    checks.append(congestion_control_check())
    return checks


def congestion_control_check() -> Check:
    """The host's default TCP congestion control (what the KV connections run unless the scenario's
    `serving.kv_congestion_control` names one) and whether BBR can be set. Informational: either works."""
    from testbed.kv.transport import congestion_control_refused, tcp_sysctl

    default = tcp_sysctl("tcp_congestion_control")
    if default is None:
        return Check("TCP congestion control", False, "unreadable: /proc/sys/net/ipv4/tcp_congestion_control", required=False)
    bbr = congestion_control_refused("bbr")  # as root this loads tcp_bbr if the kernel has it as a module
    return Check("TCP congestion control", True,
                 f"default {default} (KV uses it unless serving.kv_congestion_control names one); "
                 + ("bbr can be set" if bbr is None else f"bbr: {bbr}"), required=False)


def _torch_check() -> Check:
    try:
        import torch

        cuda = torch.cuda.is_available()
        detail = f"{torch.__version__}, " + (f"CUDA: {torch.cuda.get_device_name(0)}" if cuda else "CPU only (no CUDA device)")
        return Check("torch", True, detail, required=False)
    except Exception as exc:
        return Check("torch", False, f"{type(exc).__name__}: {exc}", required=False)


def report() -> dict[str, Any]:
    from testbed.net.netem import netem_available

    from testbed.fidelity import CORES_PER_RUN_DEFAULT, suggest_parallelism
    from testbed.net.emulation import host_capacity_bps

    checks = run_checks()
    cap_bps, cap_source = host_capacity_bps()
    cpus = os.cpu_count() or 1
    netem_ok = netem_available()[0] if os.geteuid() == 0 else False
    missing = [c.name for c in checks if c.required and not c.ok]
    return {
        "next": next_command(missing),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "backend_auto": "netem" if netem_ok else "delayline",
        "ready": not missing,
        "missing": missing,
        "checks": [asdict(c) for c in checks],
        "parallelism": {"suggested": suggest_parallelism(cpus), "cpus": cpus, "cores_per_run": CORES_PER_RUN_DEFAULT,
                        "capacity_bps": cap_bps, "capacity_source": cap_source,
                        "capacity_per_run_bps": cap_bps / suggest_parallelism(cpus)},
    }


def next_command(missing: list[str]) -> str:
    """The one command a user should run after `prfaas doctor`, given what is missing."""
    if "root" in missing:
        return "run as root: prfaas doctor (a root shell, or sudo)"
    if missing:
        return "bash scripts/bootstrap.sh setup   (as root: installs what is missing), then prfaas doctor"
    return "prfaas quickstart   (the README's run; `prfaas check quick` shows its numbers first, `prfaas lab list` the labs)"
