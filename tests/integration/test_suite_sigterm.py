"""A test run stopped with SIGTERM still tears down what its tests built (tests/conftest.py's handler).

A child pytest, given this repository's tests/conftest.py, runs one test whose fixture creates a real
network namespace and deletes it in `finally`; the test waits; it gets SIGTERM. The namespace must be
gone and the child must report an interrupted session.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.conftest import REPO


def test_sigterm_to_a_test_run_still_runs_fixture_teardown(tmp_path: Path) -> None:
    ns = f"sigt-{uuid.uuid4().hex[:6]}"
    ready = tmp_path / "ready"
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_waits.py").write_text(f'''
import subprocess, time
from pathlib import Path
import pytest

@pytest.fixture
def namespace():
    subprocess.run(["ip", "netns", "add", "{ns}"], check=True)
    try:
        yield "{ns}"
    finally:
        subprocess.run(["ip", "netns", "del", "{ns}"], check=True)

def test_waits(namespace):
    Path("{ready}").write_text("up")
    time.sleep(60)
''')
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert child.poll() is None, child.communicate()[0]
            assert time.monotonic() < deadline, "the child test never started"
            time.sleep(0.05)
        assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        child.terminate()
        out, _ = child.communicate(timeout=20)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # only if the handler failed
    assert ns not in left, f"SIGTERM left {ns} behind:\n{out}"
    assert child.returncode == 2, f"want pytest's 'interrupted' (2), got {child.returncode}:\n{out}"
    assert "KeyboardInterrupt" in out and "SIGTERM" in out, out
