"""Times the 4-bit products of 16-128 rows (decode batches) at Llama-2-7B layer shapes on a
GPU: fp16 cuBLAS, the Triton GEMM the engine runs (``quant_gemm``), the csrc tensor-core
GEMV and tiled GEMM (each launch shape), and the transposed-tile Triton GEMM
(``quant_gemm_t``) at each of its configurations, to pick the last one's defaults.

Every kernel is first checked against dequantize-then-matmul, then timed inside a CUDA
graph that cycles through enough copies of the weight to keep it out of L2 (as a forward
pass reads each layer's weight once per step). The configurations compile in parallel
processes first (Triton's cache then serves the timing process).

    PYTHONPATH=. python3 benchmarks/quant_gemm_t_sweep.py [--rows 16,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # (K, N): qkv, o, gate|up, down
L2_BYTES = 50 * 2**20
GROUP = 128
TILES = [(bn, bk) for bn in (64, 128, 256) for bk in (64, 128)]
LAUNCH = [(4, 3), (4, 4), (4, 5), (8, 3), (8, 4)]  # (warps, stages)
SPLITS = (1, 2, 4, 8)


def configs(m: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps, stages) tried at ``m`` rows."""
    out = []
    for (bn, bk), (warps, stages) in itertools.product(TILES, LAUNCH):
        if bn == 256 and warps == 4 and m > 32:
            continue  # 256 x 64 fp32 accumulators a 128-thread program: spills
        out.append((bn, bk, warps, stages))
    return out


def _compile(job: tuple[int, tuple[int, int, int, int], int]) -> str:
    """Compiles one configuration (a tiny launch with the timed launches' specialization)."""
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_quant_gemm import quant_gemm_t

    m, (bn, bk, warps, stages), split = job
    k, n = 512, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = qref.pack_rows(torch.randint(0, 16, (k, n), generator=gen, device="cuda"), 4)
    s = torch.rand(k // GROUP, n, device="cuda").half()
    z = torch.rand(k // GROUP, n, device="cuda").half()
    x = torch.randn(m, k, device="cuda").half()
    try:
        quant_gemm_t(x, q, s, z, GROUP, config=(bn, bk, warps, stages, split))
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # reported by the timing process, which runs it again
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def graph_us(calls) -> float:
    from asyncgen._ops.cuda_backend import graph_time_ms

    return 1e3 * graph_time_ms(lambda call: call(), calls, passes=5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    jobs = [(m, c, s) for m in rows for c in configs(m) for s in (1, 2)]
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=args.workers, mp_context=mp.get_context("spawn")) as pool:
        compiled = list(pool.map(_compile, jobs))
    print(f"compiled {sum(r == 'ok' for r in compiled)} of {len(jobs)} configurations", flush=True)

    from asyncgen._ops import cuda_backend
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_quant_gemm import quant_gemm, quant_gemm_t

    have_csrc = cuda_backend.is_available()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us, weights cycled past L2")
    results = []
    failures = 0
    for k, n in SHAPES:
        groups = k // GROUP
        qbytes = k * n // 2 + groups * n * 4
        copies = max(2, -(-3 * L2_BYTES // qbytes))
        weights = []
        for _ in range(copies):
            codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda")
            weights.append((qref.pack_rows(codes, 4),
                            (torch.rand(groups, n, generator=gen, device="cuda") * 0.002 + 0.0005).half(),
                            torch.randint(0, 16, (groups, n), generator=gen, device="cuda").half()))
        dense_copies = max(2, -(-3 * L2_BYTES // (k * n * 2)))
        dense = [torch.randn(n, k, generator=gen, device="cuda").half() * 0.02 for _ in range(dense_copies)]
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            q, s, z = weights[0]
            want = x.float() @ qref.dequantize(q, s, z, 4, GROUP).float()
            row: dict[str, object] = {"k": k, "n": n, "m": m}

            def check(name, fn) -> bool:
                nonlocal failures
                out.fill_(float("nan"))
                try:
                    fn(out, x, q, s, z)
                except Exception as exc:
                    print(f"  FAIL {name} {k}x{n} M={m}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    failures += 1
                    return False
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
                if not err < 2e-3:
                    print(f"  FAIL {name} {k}x{n} M={m}: rel err {err:.2e}")
                    failures += 1
                    return False
                return True

            row["cublas_fp16"] = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
            gemm = lambda o, x, q, s, z: quant_gemm(x, q, s, z, 4, GROUP, out=o)  # noqa: E731
            if check("triton", gemm):
                row["triton"] = graph_us([lambda w=w: gemm(out, x, *w) for w in weights])
            if have_csrc and m <= cuda_backend.QUANT_MMA_MAX_ROWS:
                mma = lambda o, x, q, s, z: cuda_backend.launch_quant_gemv_4bit(x, q, s, z, GROUP, out=o, kernel=2)  # noqa: E731
                if check("csrc_mma", mma):
                    row["csrc_mma"] = graph_us([lambda w=w: mma(out, x, *w) for w in weights])
                tiled = {}
                for warps, splits in cuda_backend.QUANT_GEMM_CONFIGS:
                    fn = lambda o, x, q, s, z, a=warps, b=splits: cuda_backend.launch_quant_gemm_4bit(  # noqa: E731
                        x, q, s, z, GROUP, out=o, warps=a, splits=b)
                    if check(f"tiled{warps}x{splits}", fn):
                        tiled[f"{warps}x{splits}"] = graph_us([lambda w=w, fn=fn: fn(out, x, *w) for w in weights])
                if tiled:
                    best = min(tiled, key=tiled.get)
                    row["csrc_tiled"], row["csrc_tiled_cfg"] = tiled[best], best
            t_times = {}
            for cfg in configs(m):
                for split in SPLITS:
                    bn, bk = cfg[0], cfg[1]
                    tiles = -(-n // bn) * -(-m // 64)
                    if split > 1 and (tiles * split > 4 * 132 or k // bk < 2 * split):
                        continue
                    fn = lambda o, x, q, s, z, c=cfg + (split,): quant_gemm_t(x, q, s, z, GROUP, out=o, config=c)  # noqa: E731
                    name = "t" + "x".join(map(str, cfg + (split,)))
                    out.fill_(float("nan"))
                    try:
                        fn(out, x, q, s, z)
                    except Exception as exc:  # a configuration that does not compile or launch
                        print(f"  skip {name} {k}x{n} M={m}: {type(exc).__name__}")
                        continue
                    if not check(name, fn):
                        continue
                    t_times[name] = graph_us([lambda w=w, fn=fn: fn(out, x, *w) for w in weights])
            if t_times:
                ranked = sorted(t_times, key=t_times.get)
                row["t_best"], row["t_best_cfg"] = t_times[ranked[0]], ranked[0]
                row["t_top5"] = [(c, round(t_times[c], 1)) for c in ranked[:5]]
                row["t_all"] = {c: round(v, 2) for c, v in t_times.items()}
            results.append(row)
            cells = " ".join(
                f"{key} {row[key]:.1f}" for key in ("cublas_fp16", "triton", "csrc_mma", "csrc_tiled", "t_best") if key in row
            )
            print(f"{k}x{n:<6} M={m:<3} {cells}  [{row.get('csrc_tiled_cfg', '-')}, {row.get('t_best_cfg', '-')}]"
                  f"  top: {row.get('t_top5', [])}", flush=True)
        del weights, dense
        torch.cuda.empty_cache()
    for m in rows:
        sums = {}
        for key in ("cublas_fp16", "triton", "csrc_mma", "csrc_tiled", "t_best"):
            vals = [r[key] for r in results if r["m"] == m and key in r]
            if len(vals) == len(SHAPES):
                sums[key] = sum(vals)
        print(f"M={m}: a layer's four products, us: " + ", ".join(f"{k} {v:.1f}" for k, v in sums.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
