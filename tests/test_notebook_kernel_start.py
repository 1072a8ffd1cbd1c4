"""Issue 45, item 13: on a busy machine a notebook's kernel may not start at the first try.

nbval starts a kernel per notebook; the fork fails with EAGAIN (`BlockingIOError: [Errno 11]
Resource temporarily unavailable`) while another job holds the machine's task limit, and every
cell of that notebook then fails with it. The repository's top-level conftest.py tries again.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tool_modules import load_module

ROOT = Path(__file__).resolve().parent.parent
nb_conftest = load_module(ROOT / "conftest.py", "root_conftest")

EAGAIN = BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))


def _flaky(fails: int, error: OSError = EAGAIN):
    calls = []

    def start(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) <= fails:
            raise error
        return "kernel"

    return start, calls


def test_a_start_that_meets_eagain_is_tried_again():
    start, calls = _flaky(2)
    waits = []
    assert nb_conftest.retrying(start, sleep=waits.append)("python", cwd="x") == "kernel"
    assert len(calls) == 3 and calls[-1] == (("python",), {"cwd": "x"})
    assert waits == list(nb_conftest.RETRY_WAITS_S[:2])


def test_other_errors_and_a_lasting_eagain_stand():
    start, calls = _flaky(1, FileNotFoundError(errno.ENOENT, "no such kernel"))
    with pytest.raises(FileNotFoundError):
        nb_conftest.retrying(start, sleep=lambda s: None)()
    assert len(calls) == 1
    start, calls = _flaky(100)
    with pytest.raises(BlockingIOError):
        nb_conftest.retrying(start, waits=(0.1, 0.2), sleep=lambda s: None)()
    assert len(calls) == 3
    assert sum(nb_conftest.RETRY_WAITS_S) >= 20  # long enough for a busy spell to pass


FLAKY_PLUGIN = textwrap.dedent('''
    """The first kernel launch fails as fork() does at the task limit."""
    import errno, os
    import jupyter_client.launcher as launcher

    _real, _fails = launcher.Popen, [1]

    def _popen(*args, **kwargs):
        if _fails[0]:
            _fails[0] -= 1
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return _real(*args, **kwargs)

    launcher.Popen = _popen
''')


def _run_nbval(folder: Path) -> subprocess.CompletedProcess:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "print(6 * 7)", execution_count=1,
        outputs=[nbformat.v4.new_output("stream", name="stdout", text="42\n")])]
    nbformat.write(nb, folder / "lesson.ipynb")
    (folder / "flaky_launch.py").write_text(FLAKY_PLUGIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "flaky_launch", "-o",
                           "addopts=", "-p", "no:cacheprovider", "--nbval",
                           "--nbval-current-env", "lesson.ipynb"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_notebook_whose_first_kernel_launch_meets_eagain_passes(tmp_path):
    pytest.importorskip("nbval")
    bare, fixed = tmp_path / "bare", tmp_path / "fixed"
    bare.mkdir()
    fixed.mkdir()
    without = _run_nbval(bare)  # the symptom: the cell fails with BlockingIOError
    assert without.returncode != 0 and "BlockingIOError" in without.stdout, without.stdout
    shutil.copy(ROOT / "conftest.py", fixed / "conftest.py")
    with_retry = _run_nbval(fixed)
    assert with_retry.returncode == 0, with_retry.stdout[-3000:] + with_retry.stderr[-2000:]
    assert "1 passed" in with_retry.stdout
