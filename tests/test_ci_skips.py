"""The hook at the end of tests/conftest.py: under CI (CI=true) a skipped test fails with its reason unless the
reason is a GPU's; elsewhere a skip stays a skip. Runs pytest on small test files with the real conftest."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

SKIPPING_TESTS = '''
import pytest

@pytest.fixture
def shared_data():
    pytest.skip("shared data not present")

def test_passes():
    assert 1 + 1 == 2

def test_skipped_for_postgres():
    pytest.skip("no PostgreSQL here")

def test_skipped_for_a_gpu():
    pytest.skip("this machine has a GPU")

def test_skipped_naming_a_gpu_in_passing():
    pytest.skip("no MLflow server (it runs without a GPU)")

@pytest.mark.skipif(True, reason="needs CUDA")
def test_skipped_by_a_cuda_mark():
    pass

@pytest.mark.skipif(True, reason="no two adjacent free ports")
def test_skipped_by_a_mark():
    pass

def test_skipped_by_a_fixture(shared_data):
    pass

def test_expected_to_fail():
    pytest.xfail("a known bug")
'''

SKIPPED_MODULE = '''
import pytest

pytest.skip("no server binary", allow_module_level=True)

def test_never_collected():
    pass
'''


@pytest.fixture
def skipping_project(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_skipping=SKIPPING_TESTS, test_skipped_module=SKIPPED_MODULE)
    return pytester


def _run(pytester):
    # a subprocess: the conftest under test is imported as `conftest`, which this process has imported already
    return pytester.runpytest_subprocess("-rsx", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                                         timeout=120)


def test_under_ci_a_skip_fails_with_its_reason_unless_it_is_for_a_gpu(skipping_project, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = _run(skipping_project)
    # failed: the pytest.skip in a test; errors: the skips in set-up (the mark's, the fixture's) and in collection
    # (the module's); the GPU and CUDA reasons stay skips; an xfail is not a skip
    result.assert_outcomes(passed=1, failed=2, errors=3, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "*skipped under CI (CI=true), which only a GPU reason may: Skipped: no PostgreSQL here",
        "*skipped under CI (CI=true), which only a GPU reason may: Skipped: no two adjacent free ports",
        "*skipped under CI (CI=true), which only a GPU reason may: Skipped: shared data not present",
        "*skipped under CI (CI=true), which only a GPU reason may: Skipped: no server binary",
        "*skipped under CI (CI=true), which only a GPU reason may: Skipped: no MLflow server (it runs without a GPU)",
        "SKIPPED * this machine has a GPU",
        "SKIPPED * needs CUDA",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_without_ci_every_skip_stays_a_skip_and_is_listed(skipping_project, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = _run(skipping_project)
    result.assert_outcomes(passed=1, skipped=7, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "SKIPPED * no PostgreSQL here", "SKIPPED * no two adjacent free ports", "SKIPPED * shared data not present",
        "SKIPPED * no server binary", "SKIPPED * this machine has a GPU", "SKIPPED * needs CUDA",
        "SKIPPED * no MLflow server (it runs without a GPU)",
    ])
    assert result.ret == pytest.ExitCode.OK
