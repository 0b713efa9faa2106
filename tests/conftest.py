"""Shared test configuration.

Unit tests (tests/unit) need no root. Integration tests (tests/integration) are marked ``root``: they
bring up real namespaces and always tear them down; without root they are skipped with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.root)
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="needs root: integration tests create network namespaces and qdiscs (run as root)")
        for item in items:
            if "root" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the checkout (traces, reference tables); tests that need it skip with the reason."""
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not found: reference data lives beside the checkout")
    return SHARED


@pytest.fixture(scope="session")
def mooncake_trace(shared_dir: Path) -> Path:
    return shared_dir / "traces" / "mooncake_synthetic_trace.jsonl"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After a root run: no namespace may be left behind (the suite's promise); fail the session if one is."""
    if os.geteuid() != 0:
        return
    import subprocess

    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip()
    if left:
        print(f"\nERROR: network namespaces left behind by the tests: {left.split()}")
        session.exitstatus = 1
