"""The guard behind `make test`: a skip for a missing package fails the run when strict."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
SUITE = """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="missing package: nosuchpkg (an extra)")
def test_needs_an_extra():
    pass

@pytest.mark.skipif(True, reason="needs a GPU")
def test_needs_hardware():
    pass
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makeconftest("from strict_deps import pytest_configure  # noqa: F401")
    pytester.makepyfile(test_suite=SUITE, test_import="""
import pytest
pytest.importorskip("nosuchpkg_for_the_strict_deps_test")
""")
    return pytester


def test_strict_run_fails_on_missing_package_skips(suite, monkeypatch):
    monkeypatch.setenv("MINIFER_STRICT_DEPS", "1")
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "skipped for a missing package" in out
    assert "test_suite.py::test_needs_an_extra: Skipped: missing package: nosuchpkg" in out
    assert "test_import.py: Skipped: could not import 'nosuchpkg_for_the_strict_deps_test'" in out
    assert "test_needs_hardware" not in out


def test_other_skips_and_non_strict_runs_pass(suite, monkeypatch):
    monkeypatch.delenv("MINIFER_STRICT_DEPS", raising=False)
    result = suite.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=3)
