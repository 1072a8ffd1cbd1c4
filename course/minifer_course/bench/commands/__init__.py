"""The command line of ``python -m minifer_course.bench``: one module per subcommand, each with
``add_arguments(parser)`` and ``run_command(args)``.

These modules only parse options and print; the measuring lives in `minifer_course.bench`'s other
modules, which the lessons import. Nothing outside `minifer_course.bench.__main__` imports a command.
"""

from __future__ import annotations

import argparse
import sys

import torch

from minifer.checks import parse_threads
from minifer.fast.threads import apply_threads

from ..common import busy_warning


def add_machine_options(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """The options every timing command shares: ``--threads`` (and ``--device``)."""
    if device:
        parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="torch CPU threads, or 'auto': the cores idle now (default: torch's "
                        "choice)")


def set_up_machine(args: argparse.Namespace) -> None:
    """Apply ``--threads``, and warn on stderr when the CPUs are already busy (CPU runs only)."""
    apply_threads(args.threads)
    on_cpu = getattr(args, "device", "cpu") == "cpu"
    if on_cpu and (warning := busy_warning(torch.get_num_threads())):
        print(warning, file=sys.stderr, flush=True)
