"""Shared test configuration.

Unit tests (tests/unit) need no root. Integration tests (tests/integration) are marked ``root``: they
bring up real namespaces and always tear them down; without root they are skipped with the reason.

Skips: a test may skip only for a host capability a user's machine may lack, listed in ALLOWED_SKIPS
(the one list): its reason starts with the capability's tag (``pytest.skip("netem: ...")``). In CI
(``CI=true``, which .ci/run sets) and in any run as root, a skip for another reason fails the session,
so a missing file or a broken import can never pass as a skip.

Stopped from outside: SIGTERM and SIGHUP raise KeyboardInterrupt in pytest's main thread, as Ctrl-C does,
so the running test's `finally` blocks and every fixture's teardown still run (pytest ignores SIGTERM's
default death, which would leave namespaces behind: a CI system that enforces its timeout with SIGTERM).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"  # reference data with its provenance and licence: tests/data/README.md

# tag -> the host capability. Both directions count: a test of the netem path skips where the kernel
# has no netem, a test of the fallback skips where it has one.
ALLOWED_SKIPS = {
    "netem": "the kernel's netem qdisc (present or absent)",
    "cuda": "a CUDA device",
    "bbr": "the kernel's BBR congestion control (tcp_bbr), which the KV sender's RTO watchdog acts on",
}

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    from testbed.interrupts import raise_keyboard_interrupt

    raise_keyboard_interrupt()


def skip_is_allowed(reason: str) -> bool:
    tag, sep, _ = reason.removeprefix("Skipped: ").partition(":")
    return bool(sep) and tag.strip().lower() in ALLOWED_SKIPS


def skips_enforced() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.geteuid() == 0


_unexpected_skips: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.root)
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="needs root: integration tests create network namespaces and qdiscs (run as root)")
        for item in items:
            if "root" in item.keywords:
                item.add_marker(skip)
        return
    _route_netem_tests(config, items)


def _route_netem_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """netem tests run here where the kernel has netem; else inside a guest kernel (test_netem_guest.py).

    Only where no guest can start do they skip, naming both reasons. The tests not needed on this host
    are deselected (pytest counts them as such), never silently dropped.
    """
    netem_items = [i for i in items if "netem" in i.keywords]
    guest_items = [i for i in items if "netem_guest" in i.keywords]
    if not netem_items and not guest_items:
        return
    from testbed.net.guest import guest_available
    from testbed.net.netem import netem_available

    has_netem, why = netem_available()
    can_boot, guest_why = (False, "not needed") if has_netem else guest_available()
    if has_netem:
        drop = guest_items
    elif can_boot:
        drop = netem_items
    else:
        drop = guest_items
        skip = pytest.mark.skip(reason=f"netem: the kernel has none ({why}) and no guest kernel can start ({guest_why})")
        for item in netem_items:
            item.add_marker(skip)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not skip_is_allowed(reason):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


@pytest.fixture(scope="session")
def test_data() -> Path:
    """tests/data: the reference tables and the Mooncake trace (tests/data/README.md)."""
    return DATA


@pytest.fixture(scope="session")
def mooncake_trace(test_data: Path) -> Path:
    return test_data / "mooncake_synthetic_trace.jsonl"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session on a skip outside ALLOWED_SKIPS (CI or root), and, after a root run, on any
    network namespace left behind (the suite's promise). Last: after an interrupt, pytest's own
    sessionfinish tears down the fixtures still set up, and only then is the check fair."""
    if _unexpected_skips and skips_enforced():
        allowed = ", ".join(f"{k} ({v})" for k, v in ALLOWED_SKIPS.items())
        print(f"\nERROR: {len(_unexpected_skips)} unexpected skip(s); only host capabilities may skip ({allowed}):")
        for line in _unexpected_skips:
            print(f"  {line}")
        session.exitstatus = 1
    if os.geteuid() != 0:
        return
    left = netns_left()
    if left:
        print(f"\nERROR: network namespaces left behind by the tests: {left}")
        session.exitstatus = 1


def netns_left(netns_dir: Path = Path("/run/netns")) -> list[str]:
    """The named network namespaces: the folder `ip netns list` lists, read directly, so that the check
    also runs (and does not crash) on a host without the `ip` command (the GPU machine had none)."""
    return sorted(p.name for p in netns_dir.iterdir()) if netns_dir.is_dir() else []
