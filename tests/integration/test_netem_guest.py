"""The netem runtime tests, run inside a guest kernel with netem on a host kernel without it.

One guest boot (scripts/guest-kernel.sh, TCG where KVM does not work) runs pytest over
tests/integration/test_netem_runtime.py; each test there gets one test here that passes only if it
passed in the guest. tests/conftest.py keeps this module only where the host has no netem and a guest
can start (otherwise the netem tests run directly, or skip saying why no guest could start).
About 2-3 minutes on a 2-core host under TCG.
"""

import ast
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = Path(__file__).with_name("test_netem_runtime.py")
NAMES = [n.name for n in ast.parse(RUNTIME.read_text()).body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
GUEST_TIMEOUT_S = 420

pytestmark = pytest.mark.netem_guest


@pytest.fixture(scope="module")
def guest_outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("netem-guest")
    junit = out / "junit.xml"
    argv = ["bash", str(REPO / "scripts/guest-kernel.sh"), "--out", str(out), "--timeout", str(GUEST_TIMEOUT_S), "--",
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra --strict-markers",
            str(RUNTIME.relative_to(REPO)), f"--junitxml={junit}"]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=GUEST_TIMEOUT_S + 60)
    log = (r.stdout + r.stderr)[-6000:]
    assert junit.exists(), f"the guest wrote no results (exit {r.returncode}):\n{log}"
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = (kinds[0] if kinds else "passed", "".join((c.get("message") or "") for c in case)[:2000])
    return outcomes, r.returncode, log


def test_guest_run_exits_with_pytests_status(guest_outcomes):
    outcomes, status, log = guest_outcomes
    failed = [n for n, (k, _) in outcomes.items() if k != "passed"]
    assert status == (1 if failed else 0), log
    assert "guest-kernel: exit status" in log and "boot to CMD" in log


@pytest.mark.parametrize("name", NAMES)
def test_in_guest_kernel(guest_outcomes, name):
    outcomes, _, log = guest_outcomes
    assert name in outcomes, f"{name} did not run in the guest:\n{log}"
    kind, message = outcomes[name]
    assert kind == "passed", f"{name} {kind} in the guest: {message}\n{log}"
