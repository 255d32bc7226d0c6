"""The SM clock and board power while one product runs back to back, on a GPU.

A product's per-call time in a short timing loop says nothing about the clock the GPU ran
it at. This replays one CUDA graph of calls (the weights cycled past L2, as
``quant_gemm_sweep.py`` times them) for ``--seconds`` while ``nvidia-smi`` samples the SM
clock and the power draw every 50 ms, and prints, per product, the per-call time and the
median and lowest clock and the median power of the samples taken while it ran. The
products: fp16 cuBLAS and the 4-bit GEMM in the given launch shapes (``warps x splits``,
``g`` for the warpgroup kernel; splits -1 or -2 for a balanced launch), at one 7B shape::

    PYTHONPATH=. python3 benchmarks/clock_under_load.py [--shape 4096x22016] [--rows 64] \\
        [--shapes g8x-1,g4x2] [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_variants import graph_us, shape_weights  # noqa: E402  (random 4-bit weights, group 128)


def run_sampled(graph: torch.cuda.CUDAGraph, calls_per_replay: int, seconds: float) -> dict:
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # the sampler's first lines come before the load
    start = time.monotonic()
    replays = 0
    while time.monotonic() - start < seconds:
        graph.replay()
        replays += 1
        if replays % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    smi.terminate()
    out, _ = smi.communicate()
    samples = []
    for line in out.strip().splitlines()[6:]:  # the first 0.3 s, idle
        clock, power = (float(v) for v in line.split(","))
        samples.append((clock, power))
    clocks = [c for c, _ in samples] or [0.0]
    powers = [p for _, p in samples] or [0.0]
    return {"us_per_call": 1e6 * elapsed / (replays * calls_per_replay), "clock_median": statistics.median(clocks),
            "clock_min": min(clocks), "power_median": statistics.median(powers), "samples": len(samples)}


def main() -> int:
    from asyncgen._ops import cuda_backend

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x22016", help="K x N")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--shapes", default="g8x-1,g4x2", help="4-bit launch shapes, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if not cuda_backend.is_available():
        raise SystemExit("the csrc extension is not built")
    k, n = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, dense = shape_weights(k, n, gen)
    x = torch.randn(args.rows, k, generator=gen, device="cuda").half()
    out = torch.empty(args.rows, n, dtype=torch.float16, device="cuda")
    products = {"cublas_fp16": [lambda w=w: torch.nn.functional.linear(x, w) for w in dense]}
    for shape in (s for s in args.shapes.split(",") if s):
        warps, splits = (int(v) for v in shape.removeprefix("g").split("x"))
        products[shape] = [lambda w=w, a=warps, b=splits, g=shape.startswith("g"): cuda_backend.launch_quant_gemm_4bit(
            x, *w, 128, out=out, warps=a, splits=b, wgmma=g) for w in weights]
    print(f"{torch.cuda.get_device_name()}: {k}x{n} at {args.rows} rows, {args.seconds} s each")
    for name, calls in products.items():
        timed = graph_us(calls)  # also warms up and checks that the calls run
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(max(1, 2000 // len(calls))):
                for call in calls:
                    call()
        r = run_sampled(graph, len(calls) * max(1, 2000 // len(calls)), args.seconds)
        print(f"  {name:<12} {timed:6.1f} us timed, {r['us_per_call']:6.1f} us under load; SM clock median "
              f"{r['clock_median']:.0f} MHz (lowest {r['clock_min']:.0f}), power median {r['power_median']:.0f} W "
              f"({r['samples']} samples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
