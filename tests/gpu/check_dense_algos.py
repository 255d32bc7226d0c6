"""The cuBLASLt routes of dense layers on a GPU, against ``F.linear``.

For Llama-2-7B's four weight shapes (and a small one with a bias, as Qwen2's q|k|v has),
fp16 and bf16: every algorithm cuBLASLt offers at a few row counts is run once on random
input into a poisoned output and compared with ``F.linear`` (relative error of the whole
output); then ``choose_dense_algos`` times them as the engine does and every route it
chose is checked again, eagerly and replayed from a CUDA graph with new input copied
into the captured buffer.

    PYTHONPATH=. python3 tests/gpu/check_dense_algos.py [--quick]
"""

from __future__ import annotations

import argparse
import sys

import torch

from asyncgen._ops import cublaslt, cuda_backend
from asyncgen.model.linear import RowLinear

SHAPES = [(12288, 4096, False), (4096, 4096, False), (22016, 4096, False), (4096, 11008, False), (1152, 896, True)]
TOL = 1e-2


class Checks:
    def __init__(self):
        self.total = self.failed = 0

    def check(self, ok: bool, what: str) -> None:
        self.total += 1
        if not ok:
            self.failed += 1
            print(f"FAIL {what}", flush=True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fp16 and two row counts only")
    args = ap.parse_args()
    if not cublaslt.available():
        print("cuBLASLt is not available here", file=sys.stderr)
        return 2
    checks = Checks()
    gen = torch.Generator(device="cuda").manual_seed(0)
    workspace = torch.empty(cuda_backend.LT_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    dtypes = [torch.float16] if args.quick else [torch.float16, torch.bfloat16]
    all_rows = [16, 80] if args.quick else [16, 32, 64, 80, 96, 128, 256]
    for dtype in dtypes:
        for n, k, bias in SHAPES:
            layers = []
            for i in range(3):
                layer = RowLinear(f"l{i}", k, n, bias, dtype, "cuda")
                layer.weight.data.copy_(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5)
                if bias:
                    layer.bias.data.copy_(torch.randn(n, generator=gen, device="cuda"))
                layers.append(layer)
            w, b = layers[0].weight, layers[0].bias
            # Every algorithm at two row counts, eagerly.
            for m in all_rows[:2]:
                plan = cublaslt.LtMatmul(m, n, k, dtype, bias, 0)
                algos = plan.algos(workspace_bytes=workspace.numel())
                checks.check(len(algos) > 0, f"{dtype} {n}x{k} m={m}: no algorithm")
                for algo in algos:
                    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                    checks.check(plan.accepts(out, x, w, b), f"{dtype} {n}x{k} m={m}: tensors refused")
                    plan.run(out, x, w, b, algo, workspace)
                    err = rel_err(out, torch.nn.functional.linear(x, w, b))
                    checks.check(err < TOL, f"{dtype} {n}x{k} m={m} rank {algo.rank}: rel err {err:.2e}")
            # The engine's choice, then each route eagerly and from a graph.
            chosen = cuda_backend.choose_dense_algos(layers, all_rows, workspace)
            picks = chosen.get((n, k, dtype, bias), {})
            print(f"{dtype} {n}x{k}{' +bias' if bias else ''}: routes {picks}", flush=True)
            for m, route in layers[0].lt_routes.items():
                checks.check(all(layer.lt_routes[m] is route for layer in layers), f"{n}x{k} m={m}: shared route")
                x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                for layer in layers:
                    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                    err = rel_err(layer(x), want)
                    checks.check(err < TOL, f"{dtype} {n}x{k} m={m} eager: rel err {err:.2e}")
                static_x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
                layers[1](static_x)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = layers[1](static_x)
                static_x.copy_(torch.randn(m, k, generator=gen, device="cuda").to(dtype))
                static_out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                want = torch.nn.functional.linear(static_x, layers[1].weight, layers[1].bias)
                err = rel_err(static_out, want)
                checks.check(err < TOL, f"{dtype} {n}x{k} m={m} graph replay: rel err {err:.2e}")
            del layers
            torch.cuda.empty_cache()
    print(f"dense algorithm checks: {checks.total}, failed {checks.failed}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
