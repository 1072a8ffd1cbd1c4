"""No test may skip for a package that `make install` installs.

`make test` and `make check` set ``MINIFER_STRICT_DEPS=1``. A test skipped because a Python
package is missing (``pytest.importorskip``, or a skip whose reason starts ``missing package:``)
then fails the run, so a fresh clone's ``make test`` proves that ``make install`` installs
everything the tests need. Skips for what pip cannot install (a GPU, Debian's chromium, a C
compiler for inductor, a kernel this torch lacks) stay skips; so does every skip when the
variable is unset (``make test-torch`` installs the ``test`` extra only).
"""

from __future__ import annotations

import os
import re

import pytest

MISSING_PACKAGE = re.compile(r"^(Skipped: )?(missing package:|could not import '(?!minifer))")


class StrictDeps:
    """Collects the skips that name a missing package; fails the session if there are any."""

    def __init__(self) -> None:
        self.missing: list[str] = []

    def _record(self, report) -> None:
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
            if MISSING_PACKAGE.match(reason):
                self.missing.append(f"{report.nodeid}: {reason}")

    def pytest_runtest_logreport(self, report) -> None:
        self._record(report)

    def pytest_collectreport(self, report) -> None:
        self._record(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.missing:
            terminalreporter.section("skipped for a missing package (MINIFER_STRICT_DEPS=1)",
                                     red=True)
            for line in self.missing:
                terminalreporter.line(line)

    def pytest_sessionfinish(self, session) -> None:
        if self.missing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config) -> None:
    if os.environ.get("MINIFER_STRICT_DEPS") == "1":
        config.pluginmanager.register(StrictDeps(), "minifer-strict-deps")
