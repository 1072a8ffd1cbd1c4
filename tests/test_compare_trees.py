"""tools/compare_trees.py: two git refs' decode rates, measured alternating in one run."""

from __future__ import annotations

import json
import subprocess

import pytest
from tool_modules import TOOLS, load_tool

compare_trees = load_tool("compare_trees")


@pytest.mark.skipif(subprocess.run(["git", "-C", str(TOOLS), "rev-parse", "HEAD"],
                                   capture_output=True).returncode != 0,
                    reason="needs a git checkout")
def test_head_against_itself_decodes_identical_tokens(tmp_path, capsys):
    out = tmp_path / "out.json"
    before = _compare_worktrees()
    assert compare_trees.main(["HEAD", "HEAD", "--preset", "tiny", "--precisions", "fp32",
                               "--batches", "1", "--rounds", "1", "--repeats", "1",
                               "--new-tokens", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fp32 threads=1 batch=1: old " in printed and "greedy identical yes" in printed
    result = json.loads(out.read_text())
    assert result["trees"]["old"]["commit"] == result["trees"]["new"]["commit"]
    [row] = result["rows"]
    assert row["identical"] and row["median_old"] > 0 and row["median_new"] > 0
    assert len(row["rounds_old"]) == len(row["rounds_new"]) == 1
    assert _compare_worktrees() <= before  # the temporary worktrees it made are gone


def _compare_worktrees() -> set[str]:
    """The temporary worktrees of compare_trees now registered (another run may hold some)."""
    listed = subprocess.run(["git", "-C", str(TOOLS), "worktree", "list"], capture_output=True,
                            text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if "minifer-compare-" in line}
