"""Where the time of the 4-bit GEMM with producer warps (``csrc/quant_ws.cuh``) goes: the
kernel rebuilt with ``AG_QWS_PROBE`` = 1 (the consumers leave out their products: the
ring of copies and barriers alone), 2 (the producers leave out their copies and the
reordering of x: the products alone) and 3 (no ``wgmma``), and with a deeper ring, timed
beside the kernel as it is and the warpgroup kernel without producer warps, at the
Llama-2-7B layer shapes, per call in CUDA graphs over weight copies cycled past L2. The
probes' results are wrong by design; only the kernel as it is gets checked (by
``quant_gemm_sweep.py`` and ``tests/gpu/check_quant_ops.py``); the other variants are
checked here against dequantize-then-matmul before they are timed.

    PYTHONPATH=. python3 benchmarks/quant_ws_probe.py [--rows 16,64] [--configs 8x-1,4x-2,8x8]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_variants import graph_us, row_case, shape_weights  # noqa: E402
from quant_gemm_sweep import BINDING, CSRC, GROUP, SHAPES  # noqa: E402


VARIANTS = {"as is": [], "no products": ["-DAG_QWS_PROBE=1"], "no copies": ["-DAG_QWS_PROBE=2"],
            "no wgmma": ["-DAG_QWS_PROBE=3"], "11 slots": ["-DAG_QWS_STAGES8=11"]}


def build(name: str):
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="ag_qws_" + "".join(ch if ch.isalnum() else "_" for ch in name), cpp_sources=BINDING, cuda_sources=(CSRC / "gemv.cu").read_text(),
        functions=["run"], extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DAG_WGMMA", *VARIANTS[name]],
    )


def _build_in_child(name: str) -> str:
    build(name)
    return name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--configs", default="8x-1,4x-2,8x8", help="warps x splits of the kernel with producer warps")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="builds to time, comma-separated")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    names = [v for v in args.variants.split(",") if v]
    if "as is" not in names:
        names.insert(0, "as is")  # its build also times the warpgroup kernel
    with ProcessPoolExecutor(max_workers=len(names)) as pool:
        list(pool.map(_build_in_child, names))  # compile in parallel, before CUDA starts here
    mods = {name: build(name) for name in names}

    from asyncgen._ops import cuda_backend

    scratch = cuda_backend.GemmScratch("cuda")
    failures = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us, weights cycled past L2")
    for k, n in SHAPES:
        weights, _ = shape_weights(k, n, gen)
        for m in rows:
            x, out, want = row_case(m, k, n, weights, gen)
            cells = []
            for warps, splits in configs:
                pieces = cuda_backend.quant_gemm_pieces(n, k, warps, splits, x.device)
                ws, ct = scratch.buffers(pieces * m * n, -(-n // (32 * warps)))
                for name, mod in mods.items():
                    if not any("PROBE" in flag for flag in VARIANTS[name]):
                        out.fill_(float("nan"))
                        mod.run(out, x, *weights[0], GROUP, ws if pieces > 1 else None, ct if pieces > 1 else None,
                                warps, splits, 2)
                        err = ((out.float() - want).abs().max() / want.abs().max()).item()
                        if not err < 2e-3:
                            print(f"  FAIL {name} {warps}x{splits} {k}x{n} M={m}: rel err {err:.2e}", flush=True)
                            failures += 1
                            continue
                    t = graph_us([lambda w=w, mod=mod: mod.run(out, x, *w, GROUP, ws if pieces > 1 else None,
                                                               ct if pieces > 1 else None, warps, splits, 2)
                                  for w in weights])
                    cells.append(f"{warps}x{splits} {name} {t:.1f}")
            ws, ct = scratch.buffers(4 * m * n, -(-n // 128))
            wg = graph_us([lambda w=w: mods["as is"].run(out, x, *w, GROUP, ws, ct, 4, 4, 1) for w in weights])
            print(f"{k}x{n} M={m}: wgmma 4x4 {wg:.1f} | " + " | ".join(cells), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
