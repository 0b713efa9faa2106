"""The suite's skip policy (tests/conftest.py): only the listed host capabilities may skip in CI."""

from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
TESTS = '''
import pytest

def test_lacks_netem():
    pytest.skip("netem: the kernel has no netem qdisc")

def test_lacks_cuda():
    pytest.skip("CUDA: no device")

def test_runs():
    assert True
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_host=TESTS)
    return pytester


def test_host_capability_skips_pass_in_ci(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    r = suite.runpytest_subprocess("-rs")
    r.assert_outcomes(passed=1, skipped=2)
    assert r.ret == 0


def test_any_other_skip_fails_the_session_in_ci(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(test_data="import pytest\n\ndef test_reads_a_file():\n    pytest.skip('reference data not found')\n")
    monkeypatch.setenv("CI", "true")
    r = suite.runpytest_subprocess("-rs")
    r.assert_outcomes(passed=1, skipped=3)
    assert r.ret == 1
    r.stdout.fnmatch_lines(["*1 unexpected skip(s)*", "*test_data.py::test_reads_a_file*reference data not found*"])
