"""Times the 4-bit products of decode batches (16-64 rows) at Llama-2-7B layer shapes on a
GPU: fp16 cuBLAS, the Triton GEMM (``quant_gemm``), the csrc tensor-core GEMV and the
csrc tiled GEMM in each launch shape (``cuda_backend.QUANT_GEMM_CONFIGS``; its mma.sync
kernel as "tiled", its warpgroup kernels as "wgmma" and, with producer warps, "ws" where
the GPU runs them), the tiled
kernel also rebuilt with other ring depths and occupancy targets (``--variants sSwW``:
``AG_QGEMM_STAGES`` = S, ``AG_QGEMM_MIN_WARPS`` = W warps an SM, 0 for the default) and the
warpgroup kernel with other ring depths (``--variants gS``: ``AG_QWGMMA_STAGES`` = S);
variants are compiled side by side with ``torch.utils.cpp_extension``.

Every kernel is first checked against dequantize-then-matmul, then timed inside a CUDA
graph that cycles through enough copies of the weight to keep it out of L2 (as a forward
pass reads each layer's weight once per step).

    PYTHONPATH=. python3 benchmarks/quant_gemm_sweep.py [--rows 16,32,64] [--variants s3w20,s6w0] [--json out.json]

``--profile`` instead runs the built extension's tiled GEMM twice eagerly at 64 rows for
each shape (in launch shape ``--tiled 4x2``), for ``ncu``::

    PYTHONPATH=. ncu --set full -k regex:quant_gemm_4bit_tiled python3 benchmarks/quant_gemm_sweep.py --profile
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_variants import make_weights, row_case, shape_weights  # noqa: E402  (random 4-bit weights, group 128)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # (K, N): qkv, o, gate|up, down
GROUP = 128  # make_weights' group size

BINDING = r"""
#include "ops.h"

void run(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros, int64_t group_size,
         c10::optional<at::Tensor> workspace, c10::optional<at::Tensor> counters, int64_t warps, int64_t splits,
         int64_t wgmma) {
  asyncgen::quant_gemm_4bit(out, x, qweight, scales, zeros, group_size, c10::nullopt, workspace, counters, warps,
                            splits, wgmma);
}
"""


def build(variant: str):
    from torch.utils.cpp_extension import load_inline

    if variant.startswith("g"):
        macros = [f"-DAG_QWGMMA_STAGES={int(variant[1:])}"]
    else:
        stages, warps = (int(v) for v in variant[1:].split("w"))
        macros = [f"-DAG_QGEMM_STAGES={stages}", f"-DAG_QGEMM_MIN_WARPS={warps}"]
    return load_inline(
        name=f"ag_qgemm_{variant}", cpp_sources=BINDING, cuda_sources=(CSRC / "gemv.cu").read_text(),
        functions=["run"], extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DAG_WGMMA", *macros],
    )


def _build_in_child(variant: str) -> str:
    build(variant)
    return variant


def profile(tiled: str) -> int:
    from asyncgen._ops import cuda_backend

    if not cuda_backend.is_available():
        raise SystemExit("the csrc extension is not built")
    wgmma = 1 if tiled.startswith("g") else 2 if tiled.startswith("p") else 0
    warps, splits = (int(v) for v in tiled.lstrip("gp").split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in SHAPES:
        ((q, s, z),) = make_weights(k, n, 1, gen)
        x = torch.randn(64, k, generator=gen, device="cuda").half()
        for _ in range(2):
            cuda_backend.launch_quant_gemm_4bit(x, q, s, z, GROUP, warps=warps, splits=splits, wgmma=wgmma)
        torch.cuda.synchronize()
    return 0


def graph_us(calls) -> float:
    from asyncgen._ops.cuda_backend import graph_time_ms

    return 1e3 * graph_time_ms(lambda call: call(), calls, passes=5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--variants", default="", help="tiled GEMM builds to time beside the default, sSwW or gS, "
                    "comma-separated")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="run the tiled csrc GEMM eagerly, for ncu")
    ap.add_argument("--tiled", default="4x2", help="with --profile: the tiled GEMM's warps x splits (g4x2: the "
                    "warpgroup kernel's, p8x-1: the one with producer warps)")
    args = ap.parse_args()
    if args.profile:
        return profile(args.tiled)
    rows = [int(v) for v in args.rows.split(",")]
    names = [v for v in args.variants.split(",") if v]
    if names:
        with ProcessPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1)) as pool:
            list(pool.map(_build_in_child, names))  # compile in parallel, before CUDA starts here
    variants = {f"{'wgmma' if v.startswith('g') else 'tiled'}_{v}": (build(v), int(v.startswith("g"))) for v in names}

    from asyncgen._ops import cuda_backend
    from asyncgen._ops.triton_quant_gemm import quant_gemm

    if not cuda_backend.is_available():
        raise SystemExit("the csrc extension is not built")
    tiled_runs = {"tiled": (None, 0), **({"wgmma": (None, 1), "ws": (None, 2)} if cuda_backend.has_wgmma("cuda") else {}),
                  **variants}
    scratch = cuda_backend.GemmScratch("cuda")
    all_configs = cuda_backend.QUANT_GEMM_CONFIGS + tuple(
        c for c in cuda_backend.QUANT_GEMM_WS_CONFIGS if c not in cuda_backend.QUANT_GEMM_CONFIGS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us, weights cycled past L2; tiled: best launch shape (warps x splits)")
    results = []
    failures = 0
    for k, n in SHAPES:
        weights, dense = shape_weights(k, n, gen)
        for m in rows:
            x, out, want = row_case(m, k, n, weights, gen)
            q, s, z = weights[0]
            row: dict[str, object] = {"k": k, "n": n, "m": m}

            def timed(name, fn):
                """fn(out, x, q, s, z): checked, then timed (None where it fails)."""
                nonlocal failures
                out.fill_(float("nan"))
                try:
                    fn(out, x, q, s, z)
                except RuntimeError as exc:
                    print(f"  FAIL {name} {k}x{n} M={m}: {str(exc).splitlines()[0]}")
                    failures += 1
                    return None
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                if not err < 2e-3:
                    print(f"  FAIL {name} {k}x{n} M={m}: rel err {err:.2e}")
                    failures += 1
                    return None
                return graph_us([lambda w=w: fn(out, x, *w) for w in weights])

            row["cublas_fp16"] = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
            row["triton"] = timed("triton", lambda o, x, q, s, z: quant_gemm(x, q, s, z, 4, GROUP, out=o))
            row["csrc_mma"] = timed("csrc_mma", lambda o, x, q, s, z: cuda_backend.launch_quant_gemv_4bit(
                x, q, s, z, GROUP, out=o, kernel=2))
            for name, (mod, wgmma) in tiled_runs.items():
                times = {}
                for warps, splits, _ in (c for c in all_configs if c[2] == wgmma):
                    if mod is None:
                        fn = lambda o, x, q, s, z, a=warps, b=splits, g=wgmma: (  # noqa: E731
                            cuda_backend.launch_quant_gemm_4bit(x, q, s, z, GROUP, out=o, warps=a, splits=b, wgmma=g,
                                                                scratch=scratch))
                    else:
                        def fn(o, x, q, s, z, a=warps, b=splits, mod=mod, g=wgmma):
                            pieces = cuda_backend.quant_gemm_pieces(q.shape[1], q.shape[0] * 8, a, b, x.device)
                            ws, ct = scratch.buffers(pieces * x.shape[0] * q.shape[1], -(-q.shape[1] // (32 * a)))
                            mod.run(o, x, q, s, z, GROUP, ws if pieces > 1 else None, ct if pieces > 1 else None, a, b, g)
                    t = timed(f"{name}{warps}x{splits}", fn)
                    if t is not None:
                        times[f"{warps}x{splits}"] = t
                if times:
                    best = min(times, key=times.get)
                    row[name], row[name + "_cfg"] = times[best], best
                    row[name + "_all"] = {c: round(v, 2) for c, v in times.items()}
            results.append(row)
            keys = ["cublas_fp16", "triton", "csrc_mma", *tiled_runs]
            cells = " ".join(f"{key} {row[key]:.1f}" + (f" ({row[key + '_cfg']})" if key + "_cfg" in row else "")
                             for key in keys if row.get(key) is not None)
            print(f"{k}x{n:<6} M={m:<3} {cells}", flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    for m in rows:
        sums = {}
        for key in ("cublas_fp16", "triton", "csrc_mma", *tiled_runs):
            vals = [r[key] for r in results if r["m"] == m and r.get(key) is not None]
            if len(vals) == len(SHAPES):
                sums[key] = sum(vals)
        best4 = [min(r[key] for key in ("triton", "csrc_mma", *tiled_runs) if r.get(key) is not None)
                 for r in results if r["m"] == m]
        print(f"M={m}: a layer's four products, us: " + ", ".join(f"{k} {v:.1f}" for k, v in sums.items())
              + f", fastest 4-bit kernel per product {sum(best4):.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
