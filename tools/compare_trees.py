"""Decode tokens/s of minifer at two git refs, alternating in one run: did a change regress?

    python tools/compare_trees.py OLD_REF [NEW_REF] --threads 1 2 --precisions fp32 int8 bf16 \\
        --batches 1 16 64 --rounds 3 --json out.json

Without NEW_REF the new side is this checkout's working tree as it is (uncommitted changes
included). Each ref is checked out as a detached `git worktree` in a temporary directory,
removed after. For each (threads, precision) cell, every round runs one fresh process per tree,
old then new in even rounds and new then old in odd ones, so a slow spell of the machine hits
both. A process imports minifer from its tree, builds ``GPT.from_config(PRESET, seed=0)``
(random weights), quantizes it with ``quantize(model, precision)`` (int8 on the W8A8 kernel,
``impl="integer"``, or with ``--int8 auto`` its default) and, per batch size, decodes the same random prompts greedily past
end-of-sequence: one warm-up call, then ``--repeats`` timed calls. A call's rate is decode
alone, ``batch × (new_tokens − 1)`` over the time from the first new token to the last (the
completions' ``token_times``); the process reports the median of its calls.

Reported per cell and batch: the median over the rounds for old and for new, new/old, whether
every process of both trees produced the same greedy tokens, and the 1-minute load average as
the cell ended. A ref's tree builds its C++ kernels into a cache of its own
(``~/.cache/minifer-compare/<commit>``): trees sharing torch's cache would rebuild over each
other's builds at every switch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8", "int4")


def worker(preset: str, precision: str, threads: int, batches: list[int], prompt_len: int,
           new_tokens: int, repeats: int, ragged: bool = False, int8: str = "integer") -> dict:
    """One process's measurement, with the minifer that is on its sys.path: batch -> rate and
    greedy tokens. `ragged`: prompts of 4..`prompt_len` tokens (a left-padded batch); `int8`: the
    int8 kernel (``impl``), or "auto" for `quantize`'s default."""
    import torch

    import minifer as mf

    torch.set_num_threads(threads)
    model = mf.GPT.from_config(preset, seed=0).eval()
    if precision != "fp32":
        model = mf.quantize(model, precision, **({"impl": int8} if precision == "int8"
                                                  else {}))
    params = mf.SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    out = {"minifer": mf.__file__, "batches": {}}
    for batch in batches:
        prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                                generator=gen).tolist()
        if ragged:
            lengths = torch.randint(4, prompt_len + 1, (batch,), generator=gen).tolist()
            prompts = [p[:n] for p, n in zip(prompts, lengths)]
        tokens = [c.token_ids for c in mf.generate(model, prompts, params)]  # warm-up
        rates = []
        for _ in range(repeats):
            done = mf.generate(model, prompts, params)
            start = min(c.token_times[0] for c in done)
            end = max(c.token_times[-1] for c in done)
            rates.append(batch * (new_tokens - 1) / (end - start))
            if [c.token_ids for c in done] != tokens:
                tokens = None  # not even deterministic within the process
        out["batches"][str(batch)] = {"rate": statistics.median(rates), "tokens": tokens}
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _run_tree(tree: dict, args: argparse.Namespace, threads: int, precision: str) -> dict:
    """One fresh process measuring `tree`."""
    env = dict(os.environ, PYTHONPATH=tree["path"])
    if tree["extensions"]:
        env["TORCH_EXTENSIONS_DIR"] = tree["extensions"]
    command = [args.python, str(Path(__file__).resolve()), "--worker", json.dumps(
        [args.preset, precision, threads, args.batches, args.prompt_len, args.new_tokens,
         args.repeats, args.ragged, args.int8])]
    done = subprocess.run(command, env=env, cwd=tree["path"], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"compare_trees: {tree['label']} {precision} threads={threads} failed:\n"
                 f"{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["minifer"]).resolve().is_relative_to(Path(tree["path"]).resolve()):
        sys.exit(f"compare_trees: {tree['label']} imported minifer from {out['minifer']}, not "
                 f"from its tree {tree['path']}")
    return out


def compare(trees: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """Every (threads, precision) cell, the trees alternating in each round; one row per batch."""
    rows = []
    for threads in args.threads:
        for precision in args.precisions:
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    runs[side].append(_run_tree(trees[side], args, threads, precision))
            load = os.getloadavg()[0]
            for batch in map(str, args.batches):
                rates = {s: [run["batches"][batch]["rate"] for run in runs[s]] for s in runs}
                tokens = [run["batches"][batch]["tokens"] for s in runs for run in runs[s]]
                old, new = (statistics.median(rates[s]) for s in ("old", "new"))
                rows.append({"threads": threads, "precision": precision, "batch": int(batch),
                             "median_old": old, "median_new": new, "new_over_old": new / old,
                             "identical": tokens[0] is not None
                             and all(t == tokens[0] for t in tokens),
                             "load": load, "rounds_old": rates["old"],
                             "rounds_new": rates["new"]})
                row = rows[-1]
                print(f"{precision} threads={threads} batch={batch}: old {old:.1f} new {new:.1f} "
                      f"tok/s  new/old {row['new_over_old']:.3f}  greedy identical "
                      f"{'yes' if row['identical'] else 'no'}  load {load:.2f}", flush=True)
    return rows


def _tree(ref: str, folder: Path) -> dict:
    """`ref` checked out, detached, in `folder`; its kernels built into a cache of its own."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    _git("worktree", "add", "--detach", str(folder), commit)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return {"label": f"{ref} ({commit[:9]})", "ref": ref, "commit": commit, "path": str(folder),
            "extensions": str(cache / "minifer-compare" / commit)}


def _working_tree() -> dict:
    """This checkout as it is (its kernels in torch's usual cache)."""
    head = _git("rev-parse", "HEAD")
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
    return {"label": f"working tree (HEAD {head[:9]}{dirty})", "ref": None, "commit": head,
            "path": str(ROOT), "extensions": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", help="the old git ref")
    parser.add_argument("new", nargs="?", default=None,
                        help="the new git ref (default: this checkout's working tree as it is)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8", "bf16"],
                        choices=PRECISIONS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh processes per tree and cell (default 3)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed calls per batch in a process, after a warm-up (default 2)")
    parser.add_argument("--preset", default="gpt2", help="model preset, random weights")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--int8", default="integer", choices=["integer", "auto"],
                        help="int8's kernel: W8A8 (default), or auto: quantize's default here")
    parser.add_argument("--ragged", action="store_true",
                        help="prompts of 4..--prompt-len tokens, random: a left-padded batch")
    parser.add_argument("--new-tokens", type=int, default=33,
                        help="new tokens per call (default 33: 32 decode steps)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter both trees run with (default: this one)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode is timed from the first new token)")
    with tempfile.TemporaryDirectory(prefix="minifer-compare-") as tmp:
        trees: dict[str, dict] = {}
        try:
            trees["old"] = _tree(args.old, Path(tmp) / "old")
            trees["new"] = _tree(args.new, Path(tmp) / "new") if args.new else _working_tree()
            print(f"old: {trees['old']['label']}; new: {trees['new']['label']}; {args.preset} "
                  f"(random weights), prompt {'4..' if args.ragged else ''}{args.prompt_len} + "
                  f"{args.new_tokens} new tokens, "
                  f"greedy; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
                  flush=True)
            rows = compare(trees, args)
        finally:
            for tree in trees.values():
                if tree["path"] != str(ROOT):
                    _git("worktree", "remove", "--force", tree["path"])
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("old", "new", "json")}
        trees = {s: {k: t[k] for k in ("label", "ref", "commit")} for s, t in trees.items()}
        Path(args.json).write_text(json.dumps({"trees": trees, "settings": settings,
                                               "cpus": os.cpu_count(), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(*json.loads(sys.argv[2]))))
    else:
        sys.exit(main())
