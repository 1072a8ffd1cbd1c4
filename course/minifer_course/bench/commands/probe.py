"""``python -m minifer_course.bench probe``: this machine's memory bandwidth and matmul FLOP/s
(`minifer_course.bench.probes` measures)."""

from __future__ import annotations

import argparse

import torch

from ..probes import measure_bandwidth, measure_matmul_flops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--size-mib", type=int, default=128,
                        help="bandwidth probe buffer size in MiB (default: 128)")
    parser.add_argument("--n", type=int, default=2048, help="matmul size n (default: 2048)")
    parser.add_argument("--dtype", default="float32",
                        help="matmul dtype: float32, bfloat16, float16 (default: float32)")
    parser.add_argument("--repeats", type=int, default=5, help="counted runs (default: 5)")


def run_command(args: argparse.Namespace) -> int:
    bw = measure_bandwidth(args.device, args.size_mib * 2**20, repeats=args.repeats)
    flops = measure_matmul_flops(args.device, args.n, args.dtype, repeats=args.repeats)
    print(f"device            {args.device} ({torch.get_num_threads()} threads)")
    print(f"memory bandwidth  {bw / 1e9:.1f} GB/s  (copy of {args.size_mib} MiB)")
    print(f"matmul            {flops / 1e9:.1f} GFLOP/s  ({args.n}x{args.n}, {args.dtype})")
    print(f"ridge point       {flops / bw:.1f} FLOP/byte")
    return 0
