"""Times every cuBLASLt algorithm offered for the dense products of a Llama-2-7B layer
against ``F.linear`` (cuBLAS's own pick) at the row counts of decode batches and prompt
chunks, on a GPU.

Each algorithm is first checked against ``F.linear`` on random inputs (relative error of
the whole output), then timed in a CUDA graph that cycles through 8 copies of the weight,
so that the weight comes from memory as in a forward pass. Prints, per shape and row
count, cuBLAS's time, the fastest algorithm's, and its rank in cuBLASLt's heuristic order.

    PYTHONPATH=. python3 benchmarks/dense_algos.py [--rows 16 64 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = {  # name: (N, K)
    "qkv": (12288, 4096),
    "o": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
}
COPIES = 8


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 80, 96, 128, 256, 1088])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--max-algos", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from asyncgen._ops import cublaslt
    from asyncgen._ops.cuda_backend import graph_time_ms

    if not cublaslt.available():
        sys.exit("cuBLASLt is not available here")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "rows": {}}
    print(f"{report['device']}, torch {torch.__version__}, {args.dtype}")
    print(f"{'shape':>8} {'rows':>5} {'cuBLAS us':>10} {'best Lt us':>10} {'gain':>6} {'rank':>5} {'waves':>6} {'ws MB':>6} {'algos':>5} {'worst err':>10}")
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [(torch.randn(n, k, generator=gen, device="cuda", dtype=torch.float32) * k**-0.5).to(dtype)
                   for _ in range(COPIES)]
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
            ref = torch.nn.functional.linear(x, weights[0])
            t_ref = 1e3 * graph_time_ms(lambda w: torch.nn.functional.linear(x, w), weights, passes=5)
            plan = cublaslt.LtMatmul(m, n, k, dtype, False, torch.cuda.current_device())
            algos = plan.algos(args.max_algos)
            outs = [torch.empty(m, n, dtype=dtype, device="cuda") for _ in range(COPIES)]
            rows = []
            worst = 0.0
            for algo in algos:
                out = outs[0]
                out.fill_(float("nan"))
                try:
                    plan.run(out, x, weights[0], None, algo, workspace)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    rows.append({"rank": algo.rank, "error": str(e)})
                    continue
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    rows.append({"rank": algo.rank, "rel_err": err, "error": "wrong result"})
                    continue
                worst = max(worst, err)
                pairs = list(zip(weights, outs))
                t = 1e3 * graph_time_ms(lambda p, a=algo: plan.run(p[1], x, p[0], None, a, workspace), pairs, passes=5)
                rows.append({"rank": algo.rank, "us": t, "waves": algo.waves, "workspace": algo.workspace_size,
                             "rel_err": err})
            timed = [r for r in rows if "us" in r]
            best = min(timed, key=lambda r: r["us"]) if timed else None
            report["rows"].setdefault(name, {})[m] = {"cublas_us": t_ref, "algos": rows}
            if best is None:
                print(f"{name:>8} {m:>5} {t_ref:>10.2f} {'-':>10}   (no algorithm ran: {rows[:2]})")
                continue
            print(f"{name:>8} {m:>5} {t_ref:>10.2f} {best['us']:>10.2f} {t_ref / best['us']:>5.2f}x {best['rank']:>5} "
                  f"{best['waves']:>6.2f} {best['workspace'] / 2**20:>6.1f} {len(timed):>5} {worst:>10.1e}")
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
