"""Times variants of the csrc 4-bit GEMV (csrc/gemv.cuh) on a GPU, to pick its defaults.

Each variant is the same kernel source compiled with other values of its tuning macros,
built side by side with ``torch.utils.cpp_extension``. ``CxUxL`` is the CUDA-core kernel
(``AG_QGEMV_COL_THREADS``: column threads per block, 4 columns each; ``AG_QGEMV_UNROLL``:
packed rows per load batch; ``AG_QGEMV_LOAD``: 0 plain loads, 1 the read-only path, 2
streaming loads; these build without the one-row streaming kernel); ``sCxTxD`` is the
one-row streaming kernel (``AG_QGEMV1_COLS`` column threads, ``AG_QGEMV1_THREADS`` threads
a block, ``AG_QGEMV1_DEPTH`` pairs of packed rows in flight a thread), ``s`` its default shapes;
``mmaWxD`` is the tensor-core kernel (``AG_QGEMV_MMA_WARPS`` warps per
block, ``AG_QGEMV_MMA_DEPTH`` chunks in flight per lane), ``mma`` its default shapes.
Every call is checked against dequantize-then-matmul, then timed at Llama-2-7B decode
shapes inside a CUDA graph that cycles through enough copies of the weight to keep it
out of L2 (as in a model, where each layer's weight is read once per step). The Triton
4-bit GEMV and an fp16 cuBLAS ``F.linear`` are timed the same way for reference.

    PYTHONPATH=. python3 benchmarks/gemv_variants.py [--variants 4x4x0,8x4x1,s4x256x4,...] [--rows 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # (K, N): qkv, o, gate|up, down
ROWS = (1, 4, 8, 16, 32, 64)  # the CUDA-core variants take up to 8
L2_BYTES = 50 * 2**20

# The variant is csrc/gemv.cu itself (the op's glue and checks) built with the macros
# set; this only exposes its entry point to Python.
BINDING = r"""
#include "ops.h"

void run(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros, int64_t group_size) {
  asyncgen::quant_gemv_4bit(out, x, qweight, scales, zeros, group_size, std::nullopt, 0, false);
}
"""


def build(variant: str):
    from torch.utils.cpp_extension import load_inline

    if variant == "mma":  # the default: warps by layer width
        macros = []
    elif variant == "s":  # the default: shapes by layer width
        macros = ["-DAG_QGEMV_MMA=0"]
    elif variant.startswith("s"):
        cols, threads, depth = (int(v) for v in variant[1:].split("x"))
        macros = ["-DAG_QGEMV_MMA=0", f"-DAG_QGEMV1_COLS={cols}", f"-DAG_QGEMV1_THREADS={threads}",
                  f"-DAG_QGEMV1_DEPTH={depth}"]
    elif variant.startswith("mma"):
        warps, depth = (int(v) for v in variant[3:].split("x"))
        macros = [f"-DAG_QGEMV_MMA_WARPS={warps}", f"-DAG_QGEMV_MMA_DEPTH={depth}"]
    else:
        cols, unroll, load = (int(v) for v in variant.split("x"))
        macros = ["-DAG_QGEMV_MMA=0", "-DAG_QGEMV1=0", f"-DAG_QGEMV_COL_THREADS={cols}", f"-DAG_QGEMV_UNROLL={unroll}",
                  f"-DAG_QGEMV_LOAD={load}"]
    return load_inline(
        name=f"ag_qgemv_{variant}",
        cpp_sources=BINDING,
        cuda_sources=(CSRC / "gemv.cu").read_text(),
        functions=["run"],
        extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", *macros],
        verbose=False,
    )


def _build_in_child(variant: str) -> str:
    build(variant)
    return variant


def make_weights(k: int, n: int, copies: int, gen) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``copies`` random 4-bit weights [K, N], group 128: (qweight packed along K, scales,
    zeros), as the csrc kernels take them."""
    from asyncgen._ops import quant_reference as qref

    groups = k // 128
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda")
        out.append((qref.pack_rows(codes, 4),
                    (torch.rand(groups, n, generator=gen, device="cuda") * 0.002 + 0.0005).half(),
                    torch.randint(0, 16, (groups, n), generator=gen, device="cuda").half()))
    return out


def shape_weights(k: int, n: int, gen) -> tuple[list, list[torch.Tensor]]:
    """The 4-bit weights (``make_weights``) and dense fp16 weights [N, K] of one shape, as
    many copies of each as take 3x L2's bytes (at least 2), to cycle through in a graph."""
    qbytes = k * n // 2 + (k // 128) * n * 4
    weights = make_weights(k, n, max(2, -(-3 * L2_BYTES // qbytes)), gen)
    dense_copies = max(2, -(-3 * L2_BYTES // (k * n * 2)))
    dense = [torch.randn(n, k, generator=gen, device="cuda").half() * 0.02 for _ in range(dense_copies)]
    return weights, dense


def row_case(m: int, k: int, n: int, weights, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [m, K] fp16, an output [m, N], x @ the first weight dequantized in fp32)."""
    from asyncgen._ops import quant_reference as qref

    x = torch.randn(m, k, generator=gen, device="cuda").half()
    q, s, z = weights[0]
    return x, torch.empty(m, n, dtype=torch.float16, device="cuda"), x.float() @ qref.dequantize(q, s, z, 4, 128).float()


def graph_us(calls) -> float:
    """Per-call time of ``calls`` (a list of thunks) replayed as one CUDA graph."""
    from asyncgen._ops.cuda_backend import graph_time_ms

    return 1e3 * graph_time_ms(lambda call: call(), calls, passes=5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="4x4x2,8x4x2,mma,mma8x8,mma16x8",
                    help="COL_THREADSxUNROLLxLOAD or mmaWARPSxDEPTH, comma-separated")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts to time, comma-separated")
    args = ap.parse_args()
    variants = args.variants.split(",")
    rows = [int(v) for v in args.rows.split(",")]
    with ProcessPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        list(pool.map(_build_in_child, variants))  # compile in parallel, before CUDA starts here
    modules = {v: build(v) for v in variants}

    from asyncgen._ops.triton_quant_gemm import quant_gemm as triton_gemm
    from asyncgen._ops.triton_quant_gemv import quant_gemv as triton_gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us, weights cycled past L2; GB/s of weights read")
    header = f"{'K x N':<12} {'M':>2} {'fp16 cuBLAS':>11} {'triton':>8} " + " ".join(f"{v:>8}" for v in variants)
    print(header)
    failures = 0
    results: dict[str, float] = {v: 0.0 for v in variants}
    for k, n in SHAPES:
        weights, dense = shape_weights(k, n, gen)
        for m in rows:
            x, out, want = row_case(m, k, n, weights, gen)
            q, s, z = weights[0]
            row = []
            t = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
            row.append(f"{t:>11.1f}")
            triton = triton_gemv if m <= 8 else triton_gemm
            t = graph_us([lambda w=w: triton(x, *w, 4, 128, out=out) for w in weights])
            row.append(f"{t:>8.1f}")
            for v, mod in modules.items():
                if (m > 8 and not v.startswith("mma")) or (m > 1 and v.startswith("s")):
                    row.append(f"{'-':>8}")
                    continue
                out.fill_(float("nan"))
                try:
                    mod.run(out, x, q, s, z, 128)
                except RuntimeError as exc:  # a launch the variant cannot make: report it, go on
                    failures += 1
                    print(f"  FAIL {v} {k}x{n} M={m}: {str(exc).splitlines()[0]}")
                    row.append(f"{'err':>8}")
                    continue
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                if not err < 2e-3:
                    failures += 1
                    print(f"  FAIL {v} {k}x{n} M={m}: rel err {err:.2e}")
                t = graph_us([lambda w=w, mod=mod: mod.run(out, x, *w, 128) for w in weights])
                results[v] += t if m <= 8 else 0.0
                row.append(f"{t:>8.1f}")
            print(f"{k}x{n:<6} {m:>2} " + " ".join(row), flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    best = min(results, key=results.get)
    print("total us over the shapes at 1-8 rows: " + ", ".join(f"{v} {t:.1f}" for v, t in results.items()))
    print(f"fastest: {best}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
