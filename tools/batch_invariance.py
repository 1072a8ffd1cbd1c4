"""How often a prompt's greedy tokens differ batched and alone: random prompt mixes, per precision.

    python tools/batch_invariance.py                       # 100 mixes per precision, both modes
    python tools/batch_invariance.py --mixes 20 --precisions int8 --modes default

Each mix is 2-16 prompts of 1-200 tokens, windows of the shipped model's validation text at
random places (seeded). For each precision (fp32, bf16, int8 = W8A8 here where the CPU has
int8 dot products, int4) and each mode (``default``: `generate` as it is; ``invariant``:
``batch_invariant=True``) it generates `--new-tokens` greedy tokens for the whole mix at
once and for every prompt alone, and counts the prompts whose tokens differ. Not part of the
test suite (minutes, not seconds); tests/test_batch_invariant.py holds the short version.
Prints one line per precision and mode, and a JSON line with every count at the end.
Timings depend on the machine's load: the counts do not.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's minifer

import minifer as mf  # noqa: E402
from minifer.pretrained import load_validation_text  # noqa: E402


def mixes(ids: list[int], n: int, seed: int) -> list[list[list[int]]]:
    """`n` mixes of 2-16 prompts, each a window of 1-200 tokens of `ids`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        mix = []
        for _ in range(rng.randint(2, 16)):
            length = rng.randint(1, 200)
            at = rng.randrange(len(ids) - length)
            mix.append(ids[at:at + length])
        out.append(mix)
    return out


def differing(model, mix: list[list[int]], params, invariant: bool, threads: int) -> list[int]:
    """The positions in `mix` whose tokens batched differ from the same prompt alone."""
    kw = dict(batch_invariant=invariant, threads=threads)
    batched = [c.token_ids for c in mf.generate(model, mix, params, **kw)]
    return [i for i, p in enumerate(mix) if mf.generate(model, [p], params, **kw)[0].token_ids
            != batched[i]]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4")
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--threads", type=int, default=1, help="torch's thread count (fixed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model, tok = mf.load_pretrained("shakespeare")
    ids = tok.encode(load_validation_text())
    params = mf.SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    all_mixes = mixes(ids, args.mixes, args.seed)
    results = {}
    for precision in args.precisions.split(","):
        m = model if precision == "fp32" else mf.quantize(model, precision)
        for mode in args.modes.split(","):
            t0, bad_mixes, bad_prompts, prompts = time.perf_counter(), 0, 0, 0
            for mix in all_mixes:
                bad = differing(m, mix, params, mode == "invariant", args.threads)
                bad_mixes += bool(bad)
                bad_prompts += len(bad)
                prompts += len(mix)
            results[f"{precision}/{mode}"] = dict(mixes_differing=bad_mixes, mixes=len(all_mixes),
                                                  prompts_differing=bad_prompts, prompts=prompts)
            print(f"{precision:5s} {mode:9s}: {bad_mixes}/{len(all_mixes)} mixes with a prompt "
                  f"that differs, {bad_prompts}/{prompts} prompts "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
