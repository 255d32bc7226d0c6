"""Times the column-layout 4-bit GEMV (csrc/gemv_columns.cuh) against the one-row kernel
of the checkpoint's layout (csrc/gemv.cuh) at one row, on a GPU.

Each variant ``SPLITxCOLSxSTEPSxTHREADS`` is one instantiation of the column kernel.
Every call is first checked against dequantize-then-matmul in fp32; then each kernel is
timed per call inside a CUDA graph that cycles through enough copies of the weight to
keep it out of L2, launched as a dependent (as the engine launches both on sm_90) and
not. ``--chain`` also times a layer's four products in order (o, gate|up, down, q|k|v,
each reading the one before's output) over 16 layers with their own weights.

    PYTHONPATH=. python3 benchmarks/gemv_columns.py [--variants 4x8x1x256,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # (K, N): qkv, o, gate|up, down
L2_BYTES = 50 * 2**20
DEFAULT_VARIANTS = ("4x8x1x256,4x4x1x256,4x16x1x256,4x8x1x128,2x8x2x256,1x4x4x256,1x8x4x256,"
                    "4x8x3x256,4x4x3x256,8x8x2x256,8x4x2x256,2x4x6x256")

DECLARATIONS = r"""
#include <torch/extension.h>
void one_row(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros);
void columns(at::Tensor out, at::Tensor x, at::Tensor qcol, at::Tensor zs, int64_t variant, bool dependent);
"""

BINDING = r"""
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include "gemv_columns.cuh"
#include "ops.h"

void one_row(at::Tensor out, at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor zeros) {
  asyncgen::quant_gemv_4bit(out, x, qweight, scales, zeros, 128, std::nullopt, 1, false);
}

void columns(at::Tensor out, at::Tensor x, at::Tensor qcol, at::Tensor zs, int64_t variant, bool dependent) {
  asyncgen::QuantGemvColumnsParams p{};
  p.out = reinterpret_cast<__half*>(out.data_ptr());
  p.x = reinterpret_cast<const __half*>(x.data_ptr());
  p.qcol = qcol.data_ptr<int32_t>();
  p.zs = reinterpret_cast<const uint32_t*>(zs.data_ptr());
  p.bias = nullptr;
  p.n = qcol.size(0);
  p.k = qcol.size(1) * 8;
  p.group_size = 128;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  switch (variant) {
VARIANT_CASES
    default: TORCH_CHECK(false, "no such variant");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def build(variants: list[tuple[int, int, int, int]]):
    from torch.utils.cpp_extension import load_inline

    cases = "\n".join(
        f"    case {i}: asyncgen::launch_quant_gemv_columns_shaped<{s}, {c}, {st}, {t}>(p, s, dependent); break;"
        for i, (s, c, st, t) in enumerate(variants))
    sources = BINDING.replace("VARIANT_CASES", cases)
    # gemv.cu carries the one-row kernel's op (its glue and checks); the binding adds both.
    return load_inline(
        name="ag_gemv_columns",
        cpp_sources=DECLARATIONS,
        cuda_sources=[(CSRC / "gemv.cu").read_text(), sources],
        functions=["one_row", "columns"],
        extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-DAG_QGEMV_MMA=0"],
        verbose=False,
    )


def to_columns(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint layout (qweight [K / 8, N] packed along K, scales and zeros [G, N])
    as the column kernel's (qcol [N, K / 8], zs [N, G] half2 (z, s))."""
    from asyncgen._ops import quant_reference as qref

    return qref.columns_layout(qref.unpack_rows(q, 4), s, z)


def graph_us(calls) -> float:
    from asyncgen._ops.cuda_backend import graph_time_ms

    return 1e3 * graph_time_ms(lambda call: call(), calls, passes=5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--chain", action="store_true")
    args = ap.parse_args()
    variants = [tuple(int(v) for v in name.split("x")) for name in args.variants.split(",")]
    mod = build(variants)
    from asyncgen._ops import quant_reference as qref

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us at one row, weights cycled past L2 (dep: dependent launch)")
    failures = 0
    best_by_shape = {}
    for k, n in SHAPES:
        groups = k // 128
        qbytes = k * n // 2 + groups * n * 4
        copies = max(2, -(-3 * L2_BYTES // qbytes))
        ws = []
        for _ in range(copies):
            codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda")
            q = qref.pack_rows(codes, 4)
            s = (torch.rand(groups, n, generator=gen, device="cuda") * 0.002 + 0.0005).half()
            z = torch.randint(0, 16, (groups, n), generator=gen, device="cuda").half()
            ws.append((q, s, z, *to_columns(q, s, z)))
        x = torch.randn(1, k, generator=gen, device="cuda").half()
        out = torch.empty(1, n, dtype=torch.float16, device="cuda")
        q, s, z, qc, zs = ws[0]
        want = x.float() @ qref.dequantize(q, s, z, 4, 128).float()
        mod.one_row(out, x, q, s, z)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        t_row = graph_us([lambda w=w: mod.one_row(out, x, w[0], w[1], w[2]) for w in ws])
        print(f"{k}x{n}: {qbytes / 1e6:.1f} MB; one-row kernel {t_row:.2f} us ({qbytes / t_row / 1e6:.2f} TB/s), "
              f"rel err {err:.1e}", flush=True)
        if not err < 2e-3:
            failures += 1
        results = []
        for i, v in enumerate(variants):
            split, cols, steps, threads = v
            if split * 32 * steps < k // 32:
                continue
            out.fill_(float("nan"))
            mod.columns(out, x, qc, zs, i, False)
            torch.cuda.synchronize()
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            ok = err < 2e-3
            failures += not ok
            t = graph_us([lambda w=w, i=i: mod.columns(out, x, w[3], w[4], i, False) for w in ws])
            td = graph_us([lambda w=w, i=i: mod.columns(out, x, w[3], w[4], i, True) for w in ws])
            results.append((min(t, td), "x".join(map(str, v))))
            print(f"  {'x'.join(map(str, v)):<12} {t:6.2f} us, dep {td:6.2f} us ({qbytes / td / 1e6:.2f} TB/s)"
                  f"  rel err {err:.1e}{'' if ok else '  FAIL'}", flush=True)
        best_by_shape[(k, n)] = min(results)
        print(f"  best: {best_by_shape[(k, n)][1]} {best_by_shape[(k, n)][0]:.2f} us against {t_row:.2f}")
        del ws
        torch.cuda.empty_cache()
    if args.chain:
        failures += chain(mod, variants, best_by_shape, gen)
    print("FAILURES" if failures else "all checks passed", failures)
    return 1 if failures else 0


def chain(mod, variants, best_by_shape, gen, layers: int = 16) -> int:
    """A layer's four products in order over ``layers`` layers, µs a layer."""
    from asyncgen._ops import quant_reference as qref

    order = [(4096, 4096), (4096, 22016), (11008, 4096), (4096, 12288)]
    names = ["x".join(map(str, v)) for v in variants]
    weights = []
    for _ in range(layers):
        layer = []
        for k, n in order:
            groups = k // 128
            q = qref.pack_rows(torch.randint(0, 16, (k, n), generator=gen, device="cuda"), 4)
            s = (torch.rand(groups, n, generator=gen, device="cuda") * 0.0002).half()
            z = torch.full((groups, n), 8.0, device="cuda").half()
            layer.append((q, s, z, *to_columns(q, s, z)))
        weights.append(layer)
    bufs = {n: torch.randn(1, n, generator=gen, device="cuda").half() * 0.1 for _, n in order}
    x0 = torch.randn(1, 4096, generator=gen, device="cuda").half()

    def run(columns: bool):
        calls = []
        for layer in weights:
            x = x0
            for (k, n), w in zip(order, layer):
                out = bufs[n]
                if columns:
                    i = names.index(best_by_shape[(k, n)][1])
                    calls.append(lambda x=x[:, :k], out=out, w=w, i=i: mod.columns(out, x, w[3], w[4], i, True))
                else:
                    calls.append(lambda x=x[:, :k], out=out, w=w: mod.one_row(out, x, w[0], w[1], w[2]))
                x = out
        return calls

    t_row = graph_us(run(False)) * 4
    t_col = graph_us(run(True)) * 4
    print(f"chain of a layer's four products, {layers} layers: one-row kernel {t_row:.2f} us a layer, "
          f"column kernel (best variant per shape) {t_col:.2f} us a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
