"""Profiles the decode products at one row on a GPU: the csrc GEMVs (csrc/gemv.cuh) and
cuBLAS at the four Llama-2-7B shapes, beside a plain read of the 4-bit weight's bytes.

Run it plainly for CUDA-graph timings (per call, weights cycled past L2) and the cost of
an empty kernel in a graph; run it under ``ncu`` (``--profile``: each kernel twice,
eagerly) for hardware counters::

    PYTHONPATH=. python3 benchmarks/gemv_profile.py
    PYTHONPATH=. ncu --clock-control none --set full -k regex:"gemv|nvjet|sm90" \
        python3 benchmarks/gemv_profile.py --profile

(cuBLAS's kernels for these shapes are named ``nvjet_sm90_*`` on an H200 with CUDA 13.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_variants import make_weights  # noqa: E402
from read_bandwidth import _sum_kernel  # noqa: E402

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SHAPES = {"q|k|v": (4096, 12288), "o_proj": (4096, 4096), "gate|up": (4096, 22016), "down_proj": (11008, 4096)}
L2_BYTES = 50 * 2**20

BINDING = r"""
#include "ops.h"

void quant(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros, int64_t group_size,
           int64_t kernel) {
  asyncgen::quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, std::nullopt, kernel, false);
}
void dense(at::Tensor out, at::Tensor x, at::Tensor weight) { asyncgen::dense_gemv(out, x, weight, std::nullopt, 0, false); }
"""


def build(extra_sources: list[Path] = (), name: str = "ag_gemv_profile"):
    from torch.utils.cpp_extension import load_inline

    cuda = "\n".join([(CSRC / "gemv.cu").read_text(), *(p.read_text() for p in extra_sources)])
    return load_inline(name=name, cpp_sources=BINDING, cuda_sources=cuda, functions=["quant", "dense"],
                       extra_include_paths=[str(CSRC)], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="run each kernel twice eagerly, for ncu")
    args = ap.parse_args()
    mod = build()
    from asyncgen._ops.cuda_backend import graph_time_ms

    gen = torch.Generator(device="cuda").manual_seed(0)
    if not args.profile:
        tiny = torch.zeros(1, device="cuda")
        empty_us = 1e3 * graph_time_ms(lambda _: tiny.add_(1), list(range(200)), passes=5)
        print(f"an elementwise kernel of one element, back to back in a graph: {empty_us:.2f} us")
    print(f"{'layer':<10} {'bytes MB':>8} {'read 4b':>8} {'cuBLAS':>8} {'dense':>8} {'4b cores':>9} {'4b mma':>8}  (us per call, M=1)")
    for name, (k, n) in SHAPES.items():
        qbytes = k * n // 2 + (k // 128) * n * 4
        copies = 1 if args.profile else max(2, -(-3 * L2_BYTES // qbytes))
        quant = make_weights(k, n, copies, gen)
        dcopies = 1 if args.profile else max(2, -(-3 * L2_BYTES // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda").half() * 0.02 for _ in range(dcopies)]
        x = torch.randn(1, k, generator=gen, device="cuda").half()
        out = torch.empty(1, n, dtype=torch.float16, device="cuda")
        reads = [torch.randn(qbytes // 2, generator=gen, device="cuda").half() for _ in range(copies)]
        sums = torch.empty(qbytes // 2 // (1024 * 8) + 1, device="cuda")
        calls = {
            "read": [lambda r=r: _sum_kernel[(triton.cdiv(r.numel(), 8192),)](r, sums, r.numel(), BLOCK=1024, ITERS=8)
                     for r in reads],
            "cuBLAS": [lambda w=w: F.linear(x, w) for w in dense],
            "dense": [lambda w=w: mod.dense(out, x, w) for w in dense],
            "cores": [lambda w=w: mod.quant(out, x, *w, 128, 1) for w in quant],
            "mma": [lambda w=w: mod.quant(out, x, *w, 128, 2) for w in quant],
        }
        if args.profile:
            torch.cuda.synchronize()
            for fns in calls.values():
                for _ in range(2):
                    fns[0]()
            torch.cuda.synchronize()
            continue
        times = {key: 1e3 * graph_time_ms(lambda f: f(), fns, passes=5) for key, fns in calls.items()}
        print(f"{name:<10} {qbytes / 1e6:>8.1f} " + " ".join(f"{t:>8.1f}" for t in times.values()), flush=True)
        del quant, dense, reads
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
