"""Checks the 4-bit (and 8-bit) quantized GEMV and GEMM kernels on a CUDA GPU and times them.

Every case draws random codes, zero points and scales, packs them in asyncgen's kernel
layout (:mod:`asyncgen._ops.quant_reference`), and compares each kernel with
dequantize-then-matmul (the weight dequantized in fp16 by the reference, multiplied in
fp32). Shapes are a 7B Llama's: 4096x4096 (q, k, v, o), 4096x11008 (gate or up),
4096x22016 (gate|up merged), 11008x4096 (down); batch (rows of x) 1, 16, 64, 256.
Variants: AWQ/GPTQ 4-bit group 128, GPTQ act-order (permuted activations), 8-bit.

Times (``triton.testing.do_bench``, median) go next to an fp16 ``x @ W`` (cuBLAS) on the
dense weight, with the bytes each quantized call must read and the share of 4.3 TB/s.
A last check captures the decode-shaped calls in a CUDA graph and replays them.

Run from the repository root: ``PYTHONPATH=. python tests/gpu/check_quant_ops.py [--quick] [--sweep]``
(``--sweep`` also times alternative launch configurations at decode sizes).
Exits with status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

HBM_BYTES_PER_S = 4.3e12
SHAPES = [(4096, 4096), (4096, 11008), (4096, 22016), (11008, 4096)]  # (K = in, N = out)
BATCHES = [1, 4, 16, 64, 256, 1024]


@dataclass
class Row:
    kernel: str
    case: str
    rel_err: float
    ok: bool
    us: float
    fp16_us: float
    num_bytes: int


ROWS: list[Row] = []


def bench_us(fn) -> float:
    from triton.testing import do_bench

    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    except TypeError:  # older triton: no return_mode
        return do_bench(fn, warmup=25, rep=100) * 1e3


def make_weights(k: int, n: int, bits: int, group_size: int, act_order: bool, gen: torch.Generator):
    from asyncgen._ops import quant_reference as qref

    num_groups = -(-k // group_size)
    codes = torch.randint(0, 2**bits, (k, n), generator=gen, device="cuda")
    scales = (torch.rand(num_groups, n, generator=gen, device="cuda") * 0.002 + 0.0005).half()
    zeros = torch.randint(0, 2**bits, (num_groups, n), generator=gen, device="cuda").half()
    perm = torch.randperm(k, generator=gen, device="cuda") if act_order else None
    return qref.pack_rows(codes, bits), scales, zeros, perm


def check_case(kernel_name, kernel, x, qweight, scales, zeros, bits, group_size, perm, dense, fp16_us, case) -> None:
    got = kernel(x, qweight, scales, zeros, bits, group_size, None, perm)
    xs = x if perm is None else x[:, perm]
    want = xs.float() @ dense.float()
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    rel = err / max(scale, 1e-6)
    # fp16 output rounding (2**-11 relative) plus fp32 summation order.
    ok = bool(torch.isfinite(got).all()) and rel < 2e-3
    out = torch.empty_like(got)
    us = bench_us(lambda: kernel(x, qweight, scales, zeros, bits, group_size, None, perm, out=out))
    k, n = dense.shape
    num_bytes = qweight.numel() * 4 + scales.numel() * 2 * 2 + x.numel() * 2 + got.numel() * 2 + (0 if perm is None else k * 8)
    ROWS.append(Row(kernel_name, case, rel, ok, us, fp16_us, num_bytes))
    print(f"  {kernel_name:<5} {case:<44} {'ok ' if ok else 'FAIL'} rel_err {rel:.1e} {us:9.1f} us "
          f"(fp16 {fp16_us:8.1f} us)", flush=True)


def check_kernels(shapes, batches) -> None:
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_quant_gemm import dequant_matmul, quant_gemm
    from asyncgen._ops.triton_quant_gemv import MAX_ROWS, quant_gemv

    from asyncgen._ops import cuda_backend

    csrc_gemv = cuda_backend.quant_gemv_4bit if cuda_backend.is_available() else None
    if csrc_gemv is None:
        print("  (csrc extension not built: its 4-bit GEMV is not checked)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = [("4-bit g128", 4, 128, False), ("4-bit g128 act-order", 4, 128, True), ("8-bit g128", 8, 128, False)]
    for k, n in shapes:
        for name, bits, group, act in variants:
            if bits == 8 and (k, n) != (4096, 4096):
                continue
            qweight, scales, zeros, perm = make_weights(k, n, bits, group, act, gen)
            dense = qref.dequantize(qweight, scales, zeros, bits, group)  # [K, N] fp16
            for m in batches:
                x = torch.randn(m, k, generator=gen, device="cuda").half()
                fp16_us = bench_us(lambda: x @ dense)
                case = f"{k}x{n} M={m} {name}"
                if m <= MAX_ROWS:
                    check_case("gemv", quant_gemv, x, qweight, scales, zeros, bits, group, perm, dense, fp16_us, case)
                if csrc_gemv is not None and bits == 4 and m <= cuda_backend.quant_gemv_4bit_max_rows(
                        qweight, scales, zeros, bits, group):
                    check_case("csrc", csrc_gemv, x, qweight, scales, zeros, bits, group, perm, dense, fp16_us, case)
                check_case("gemm", quant_gemm, x, qweight, scales, zeros, bits, group, perm, dense, fp16_us, case)
                if m >= 64:
                    check_case("deq", dequant_matmul, x, qweight, scales, zeros, bits, group, perm, dense, fp16_us,
                               case)
            del qweight, scales, zeros, dense
            torch.cuda.empty_cache()


def check_gated(copies: int = 8) -> None:
    """The one-row kernel's gated form (gate | up in, silu(gate) * up out) against the
    ungated kernel followed by ``silu_and_mul``, at the 7B gate|up shape (groups 128 and
    64) and two others (one with a bias), eagerly and replayed in a CUDA graph with new x;
    then, at the 7B shape, both ways and the GEMV alone timed in CUDA graphs over
    ``copies`` weights (past L2), as in a decode step."""
    from asyncgen._ops import cuda_backend, reference
    from asyncgen._ops.triton_activation import silu_and_mul

    if not cuda_backend.is_available():
        ROWS.append(Row("gated", "csrc extension not built", float("nan"), False, float("nan"), float("nan"), 0))
        print("  gated: the csrc extension does not load: FAIL")
        return
    gen = torch.Generator(device="cuda").manual_seed(7)
    for k, n, group in ((4096, 22016, 128), (4096, 22016, 64), (2048, 3136, 128), (11008, 8192, 128)):
        qweight, scales, zeros, _ = make_weights(k, n, 4, group, False, gen)
        bias = torch.randn(n, generator=gen, device="cuda").half() if n == 3136 else None
        if not cuda_backend.quant_gemv1_gated_ok(qweight, scales, zeros, group):
            ROWS.append(Row("gated", f"{k}x{n} g{group} refused", float("nan"), False, float("nan"), float("nan"), 0))
            print(f"  gated {k}x{n} g{group}: quant_gemv1_gated_ok is False: FAIL")
            continue
        x = torch.randn(1, k, generator=gen, device="cuda").half()

        def gated(x=x, qweight=qweight, scales=scales, zeros=zeros, group=group, bias=bias, out=None):
            return cuda_backend.launch_quant_gemv_4bit(x, qweight, scales, zeros, group, None, bias, out=out,
                                                       kernel=1, gated=True)

        def ungated():
            return cuda_backend.launch_quant_gemv_4bit(x, qweight, scales, zeros, group, None, bias, kernel=1)

        want = reference.silu_and_mul(ungated())  # the product rounded to fp16, then the op
        got = gated()
        rel = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
        ok = bool(torch.isfinite(got).all()) and rel < 2e-3
        # A CUDA graph of the gated call, replayed with new x each time.
        out = torch.empty_like(got)
        gated(out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gated(out=out)
        worst = 0.0
        for _ in range(3):
            x.normal_()
            graph.replay()
            torch.cuda.synchronize()
            ref = reference.silu_and_mul(ungated())
            worst = max(worst, ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
        ok = ok and worst < 2e-3
        us_gated = us_separate = us_plain = float("nan")
        if n == 22016:
            weights = [make_weights(k, n, 4, group, False, gen)[:3] for _ in range(copies)]
            us_gated = 1e3 * cuda_backend.graph_time_ms(
                lambda w: cuda_backend.launch_quant_gemv_4bit(x, *w, group, None, None, kernel=1, gated=True),
                weights, passes=5)
            us_separate = 1e3 * cuda_backend.graph_time_ms(
                lambda w: silu_and_mul(cuda_backend.launch_quant_gemv_4bit(x, *w, group, None, None, kernel=1)),
                weights, passes=5)
            us_plain = 1e3 * cuda_backend.graph_time_ms(
                lambda w: cuda_backend.launch_quant_gemv_4bit(x, *w, group, None, None, kernel=1), weights, passes=5)
            del weights
        ROWS.append(Row("gated", f"{k}x{n} g{group} M=1", max(rel, worst), ok, us_gated, us_separate,
                        qweight.numel() * 4))
        print(f"  gated {k}x{n} g{group}: {'ok ' if ok else 'FAIL'} rel_err {rel:.1e}, after graph replays "
              f"{worst:.1e}; us per call in CUDA graphs: gated {us_gated:.1f}, GEMV + silu_and_mul "
              f"{us_separate:.1f}, the GEMV alone {us_plain:.1f}", flush=True)
        del qweight, scales, zeros
        torch.cuda.empty_cache()


def check_graph_capture() -> None:
    """The decode-shaped calls never synchronise: they capture in a CUDA graph and replay."""
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_quant_gemm import quant_gemm
    from asyncgen._ops.triton_quant_gemv import quant_gemv

    gen = torch.Generator(device="cuda").manual_seed(1)
    qweight, scales, zeros, perm = make_weights(4096, 4096, 4, 128, True, gen)
    x1 = torch.randn(1, 4096, generator=gen, device="cuda").half()
    x16 = torch.randn(16, 4096, generator=gen, device="cuda").half()
    for _ in range(2):  # compile outside the capture
        quant_gemv(x1, qweight, scales, zeros, 4, 128, None, perm)
        quant_gemm(x16, qweight, scales, zeros, 4, 128, None, perm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = quant_gemv(x1, qweight, scales, zeros, 4, 128, None, perm)
        y16 = quant_gemm(x16, qweight, scales, zeros, 4, 128, None, perm)
    x1.copy_(torch.randn(1, 4096, generator=gen, device="cuda").half())
    x16.copy_(torch.randn(16, 4096, generator=gen, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    ok, worst = True, 0.0
    for x, y in ((x1, y1), (x16, y16)):
        want = qref.quant_matmul(x, qweight, scales, zeros, 4, 128, None, perm).float()
        rel = ((y.float() - want).abs().max() / want.abs().max()).item()
        worst = max(worst, rel)
        ok = ok and rel < 2e-3
    ROWS.append(Row("graph", "capture+replay gemv M=1, gemm M=16", worst, ok, 0.0, 0.0, 0))
    print(f"  graph capture+replay {'ok' if ok else 'FAIL'} rel_err {worst:.1e}", flush=True)


def sweep(rows=(16, 32, 64, 128)) -> None:
    """Times the Triton GEMM's launch configurations at decode and short-prompt sizes with
    the codes ORed into fp16 (``MAGIC``); prints, per layer shape and row count, the
    default, the fastest, and the default's tiles with the codes converted instead, next
    to fp16 cuBLAS and the csrc tensor-core kernel (to tune ``_config``). Every
    configuration timed is first checked against dequantize-then-matmul; one that fails
    is reported and not ranked."""
    import itertools

    from asyncgen._ops import cuda_backend
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops import triton_quant_gemm as tqg
    from triton.testing import do_bench

    def quick_us(fn) -> float:
        return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3

    def space(m):
        if m <= 32:
            return [dict(BLOCK_M=m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, GROUP_M=8, num_warps=4, num_stages=4)
                    for bn, bk, sk in itertools.product((64, 128, 256), (64, 128), (1, 2, 4))
                    if not (bn == 256 and bk == 128)]
        if m <= 64:
            return [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, GROUP_M=8, num_warps=w, num_stages=3)
                    for bn, bk, sk, w in itertools.product((64, 128, 256), (64, 128), (1, 2, 4), (4, 8))
                    if not (bn == 256 and bk == 128)]
        return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, GROUP_M=8, num_warps=w, num_stages=3)
                for bm, bn, bk, w in itertools.product((64, 128), (128, 256), (64, 128), (4, 8))
                if not (bn == 256 and bk == 128)]

    tc = cuda_backend.QUANT_KERNELS.get("tensor_cores") if cuda_backend.is_available() else None
    gen = torch.Generator(device="cuda").manual_seed(2)
    print("\nsweep (4-bit, group 128), us: default | best with MAGIC | default tiles converting | fp16 cuBLAS | csrc "
          "tensor cores")
    for k, n in SHAPES:
        qweight, scales, zeros, _ = make_weights(k, n, 4, 128, False, gen)
        dense = qref.dequantize(qweight, scales, zeros, 4, 128)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            want = (x.float() @ dense.float())
            scale = want.abs().max().item()
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            default = quick_us(lambda: tqg.quant_gemm(x, qweight, scales, zeros, 4, 128, out=out))
            fp16 = quick_us(lambda: torch.mm(x, dense, out=out))
            csrc = None
            if tc is not None and m <= 64:
                csrc = quick_us(lambda: cuda_backend.launch_quant_gemv_4bit(x, qweight, scales, zeros, 128, kernel=tc))
            best = {True: (float("inf"), None), False: (float("inf"), None)}
            original = tqg._config
            try:
                default_cfg = original(m, n, k, 4, 128, None, x.device, scales.dtype)
                candidates = [(dict(c, UNPACK_ONCE=True, MAGIC=True), True) for c in space(m)]
                candidates.append((dict(default_cfg, MAGIC=False), False))
                for cfg, magic in candidates:
                    tqg._config = lambda *a, _cfg=cfg: dict(_cfg)
                    try:
                        got = tqg.quant_gemm(x, qweight, scales, zeros, 4, 128)
                    except Exception:  # out of shared memory or registers: not a candidate
                        continue
                    rel = (got.float() - want).abs().max().item() / max(scale, 1e-6)
                    if not (rel < 2e-3):
                        ROWS.append(Row("sweep", f"{k}x{n} M={m} {cfg}", rel, False, 0.0, 0.0, 0))
                        print(f"  FAIL {k}x{n} M={m} {cfg}: rel_err {rel:.1e}", flush=True)
                        continue
                    us = quick_us(lambda: tqg.quant_gemm(x, qweight, scales, zeros, 4, 128, out=out))
                    if us < best[magic][0]:
                        best[magic] = (us, cfg)
            finally:
                tqg._config = original
            csrc_s = f"{csrc:.1f}" if csrc is not None else "-"
            print(f"  {k}x{n} M={m}: default {default:.1f} | MAGIC {best[True][0]:.1f} | converting "
                  f"{best[False][0]:.1f} | fp16 {fp16:.1f} | csrc {csrc_s}", flush=True)
            print(f"      best MAGIC {best[True][1]}", flush=True)
            print(f"      default {original(m, n, k, 4, 128, None, x.device, scales.dtype)}", flush=True)
        del qweight, scales, zeros, dense
        torch.cuda.empty_cache()


def sweep_graph(rows=(48, 64), copies: int = 8) -> None:
    """Times the Triton GEMM's configurations at 33-64 rows as the engine's start-up
    routing times kernels: one CUDA graph through ``copies`` copies of each 7B weight
    shape (more than the L2 holds), next to fp16 cuBLAS and the csrc tensor-core kernel
    through the same copies. Every configuration is first checked against
    dequantize-then-matmul; prints the five fastest per shape and row count."""
    import itertools

    from asyncgen._ops import cuda_backend
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops import triton_quant_gemm as tqg

    space = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, GROUP_M=8, num_warps=w, num_stages=st,
                  UNPACK_ONCE=True, MAGIC=True)
             for bn, bk, sk, w, st in itertools.product((64, 128), (128, 256), (1, 2), (4, 8), (2, 3, 4))
             if not (bn == 128 and bk == 256 and st == 4)]
    tc = cuda_backend.QUANT_KERNELS.get("tensor_cores") if cuda_backend.is_available() else None
    gen = torch.Generator(device="cuda").manual_seed(4)
    print(f"\nsweep in CUDA graphs over {copies} weight copies (4-bit, group 128), us per call")
    for k, n in [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]:
        weights = [make_weights(k, n, 4, 128, False, gen)[:3] for _ in range(copies)]
        dense = [qref.dequantize(*w, 4, 128) for w in weights[:2]]
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            wants = [x.float() @ d.float() for d in dense]
            fp16_w = [qref.dequantize(*w, 4, 128) for w in weights]
            fp16 = 1e3 * cuda_backend.graph_time_ms(lambda w: torch.mm(x, w, out=out), fp16_w)
            del fp16_w
            csrc = None
            if tc is not None:
                csrc = 1e3 * cuda_backend.graph_time_ms(
                    lambda w: cuda_backend.launch_quant_gemv_4bit(x, *w, 128, out=out, kernel=tc), weights)
            original, results = tqg._config, []
            default = original(m, n, k, 4, 128, None, x.device, torch.float16)
            try:
                for cfg in [default] + space:
                    tqg._config = lambda *a, _cfg=cfg: dict(_cfg)
                    try:
                        rel = max((tqg.quant_gemm(x, *w, 4, 128).float() - want).abs().max().item()
                                  / want.abs().max().item() for w, want in zip(weights, wants))
                    except Exception:  # out of shared memory or registers: not a candidate
                        continue
                    if not rel < 2e-3:
                        ROWS.append(Row("sweep", f"{k}x{n} M={m} {cfg}", rel, False, 0.0, 0.0, 0))
                        print(f"  FAIL {k}x{n} M={m} {cfg}: rel_err {rel:.1e}", flush=True)
                        continue
                    us = 1e3 * cuda_backend.graph_time_ms(lambda w: tqg.quant_gemm(x, *w, 4, 128, out=out), weights)
                    results.append((us, cfg is default, cfg))
            finally:
                tqg._config = original
            results.sort(key=lambda r: r[0])
            d_us = next((r[0] for r in results if r[1]), float("nan"))
            csrc_s = f"{csrc:.1f}" if csrc is not None else "-"
            print(f"  {k}x{n} M={m}: fp16 {fp16:.1f} | csrc tensor cores {csrc_s} | Triton default {d_us:.1f}", flush=True)
            for us, _, cfg in results[:5]:
                short = {key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")}
                print(f"      {us:7.1f} {short}", flush=True)
        del weights, dense
        torch.cuda.empty_cache()


def check_dependent_launch() -> None:
    """The csrc one-row GEMV is launched as a dependent of the kernel ahead (sm_90+): it
    starts fetching weights before that kernel ends and waits for it before reading x.
    Chained after the Triton RMSNorm (with a residual) and SiLU, whose outputs it reads,
    eagerly and replayed in a CUDA graph with new inputs each time, against the torch
    reference ops."""
    from asyncgen._ops import cuda_backend, reference
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_activation import silu_and_mul
    from asyncgen._ops.triton_rms_norm import rms_norm

    if not cuda_backend.is_available():
        return
    gen = torch.Generator(device="cuda").manual_seed(3)
    gate_up = make_weights(4096, 22016, 4, 128, False, gen)[:3]
    down = make_weights(11008, 4096, 4, 128, False, gen)[:3]
    norm_w = (torch.rand(4096, generator=gen, device="cuda") + 0.5).half()
    x = torch.randn(1, 4096, generator=gen, device="cuda").half()
    res = torch.randn(1, 4096, generator=gen, device="cuda").half()

    one_row = cuda_backend.QUANT_KERNELS["cuda_cores"]  # at one row: the one-row kernel, as the engine routes it

    def chain():
        h, _ = rms_norm(x, norm_w, 1e-5, res.clone())
        a = silu_and_mul(cuda_backend.launch_quant_gemv_4bit(h, *gate_up, 128, kernel=one_row))
        return cuda_backend.launch_quant_gemv_4bit(a, *down, 128, kernel=one_row)

    def want():
        h, _ = reference.rms_norm(x, norm_w, 1e-5, res.clone())
        a = reference.silu_and_mul(qref.quant_matmul(h, *gate_up, 4, 128))
        return qref.quant_matmul(a, *down, 4, 128).float()

    def rel(got):
        w = want()
        return ((got.float() - w).abs().max() / w.abs().max()).item()

    worst = rel(chain())
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain()
    for _ in range(5):
        x.copy_(torch.randn(1, 4096, generator=gen, device="cuda").half())
        res.copy_(torch.randn(1, 4096, generator=gen, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, rel(y))
    ok = worst < 1e-2
    ROWS.append(Row("graph", "dependent launch: norm, gate|up, silu, down", worst, ok, 0.0, 0.0, 0))
    print(f"  dependent launch chain (eager + 5 graph replays) {'ok' if ok else 'FAIL'} rel_err {worst:.1e}", flush=True)


TILED_SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # 7B q|k|v, o, gate|up, down


def check_tiled(rows=(1, 8, 16, 33, 48, 64), bench_rows=(16, 32, 48, 64), copies: int = 8) -> None:
    """The tiled csrc 4-bit GEMM (csrc/quant_gemm.cuh) in every launch shape of
    ``cuda_backend.QUANT_GEMM_CONFIGS``, at the 7B shapes, against dequantize-then-matmul
    (with a bias, and with act-order's permuted x for one shape), and past 64 rows in pieces
    of 64 into a column slice of a wider output; then a CUDA-graph replay
    of split launches with new inputs (the split counters must be left at 0), and a timing
    table in CUDA graphs over ``copies`` weight copies next to fp16 cuBLAS, the csrc
    tensor-core GEMV and the Triton GEMM, as the engine's start-up routing times them."""
    from asyncgen._ops import cuda_backend
    from asyncgen._ops import quant_reference as qref
    from asyncgen._ops.triton_quant_gemm import quant_gemm

    if not cuda_backend.is_available():
        print("  (csrc extension not built: the tiled GEMM is not checked)")
        return
    configs = [cuda_backend.QUANT_GEMM_CONFIGS[i] for i in cuda_backend.quant_gemm_config_indices("cuda")]
    if cuda_backend.has_wgmma("cuda"):  # and the kernel with producer warps, where the engine does not route to it
        configs += [c for c in cuda_backend.QUANT_GEMM_WS_CONFIGS if c not in configs]
    gen = torch.Generator(device="cuda").manual_seed(5)
    print(f"\ntiled 4-bit GEMM against dequantize-then-matmul (group 128); warpgroup kernel: "
          f"{cuda_backend.has_wgmma('cuda')}")
    for k, n in TILED_SHAPES:
        qweight, scales, zeros, _ = make_weights(k, n, 4, 128, False, gen)
        dense = qref.dequantize(qweight, scales, zeros, 4, 128).float()
        bias = torch.randn(n, generator=gen, device="cuda").half()
        perm = torch.randperm(k, generator=gen, device="cuda") if n == 4096 and k == 4096 else None
        assert cuda_backend.quant_gemm_4bit_weight_ok(qweight, scales, zeros, 128)
        for m in rows:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            xs = x if perm is None else x[:, perm]
            want = xs.float() @ dense + bias.float()
            worst, bad = 0.0, []
            for warps, splits, wgmma in configs:
                got = cuda_backend.launch_quant_gemm_4bit(x, qweight, scales, zeros, 128, perm, bias,
                                                          warps=warps, splits=splits, wgmma=wgmma)
                rel = ((got.float() - want).abs().max() / want.abs().max()).item()
                worst = max(worst, rel)
                if not (torch.isfinite(got).all() and rel < 2e-3):
                    bad.append((warps, splits, wgmma, rel))
            ok = not bad
            case = f"{k}x{n} M={m}{' act-order' if perm is not None else ''} bias, {len(configs)} shapes"
            ROWS.append(Row("graph", f"tiled {case}", worst, ok, 0.0, 0.0, 0))
            print(f"  tiled {case}: {'ok' if ok else 'FAIL ' + str(bad)} worst rel_err {worst:.1e}", flush=True)
        del qweight, scales, zeros, dense

    # More rows than it takes, in pieces of 64 into a column slice of a wider output (as
    # QuantLinearMethod._chunked sends them): nothing written outside the slice.
    for k, n in ((4096, 12288), (11008, 4096)):
        qweight, scales, zeros, _ = make_weights(k, n, 4, 128, False, gen)
        dense = qref.dequantize(qweight, scales, zeros, 4, 128).float()
        for m in (78, 100, 128):
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            want = x.float() @ dense
            wide = torch.full((m, n + 64), float("nan"), dtype=torch.half, device="cuda")
            out = wide[:, 32 : 32 + n]
            for wgmma in sorted({c[2] for c in configs}):
                wide.fill_(float("nan"))
                for start in range(0, m, 64):
                    cuda_backend.launch_quant_gemm_4bit(x[start : start + 64], qweight, scales, zeros, 128,
                                                        out=out[start : start + 64], warps=4, splits=2, wgmma=wgmma)
                rel = ((out.float() - want).abs().max() / want.abs().max()).item()
                ok = bool(rel < 2e-3 and torch.isnan(wide[:, :32]).all() and torch.isnan(wide[:, 32 + n :]).all())
                case = f"{('tiled', 'wgmma', 'ws')[wgmma]} {k}x{n} M={m} in pieces of 64 into a column slice"
                ROWS.append(Row("graph", case, rel, ok, 0.0, 0.0, 0))
                print(f"  {case}: {'ok' if ok else 'FAIL'} rel_err {rel:.1e}", flush=True)
        del qweight, scales, zeros, dense

    # Split launches captured in a CUDA graph, replayed with new x: the counters reset.
    qweight, scales, zeros, _ = make_weights(4096, 4096, 4, 128, False, gen)
    x = torch.randn(64, 4096, generator=gen, device="cuda").half()
    x16 = torch.randn(16, 4096, generator=gen, device="cuda").half()
    kernels = sorted({c[2] for c in configs})  # the mma.sync kernel, and the warpgroup ones where they run

    def launch_pair():
        return [(a, cuda_backend.launch_quant_gemm_4bit(a, qweight, scales, zeros, 128, warps=w, splits=sp,
                                                         wgmma=wg))
                for wg in kernels for a, w, sp in ((x, 4, 6), (x16, 8, 3))]

    for _ in range(2):
        launch_pair()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pairs = launch_pair()
    worst = 0.0
    for _ in range(4):
        x.copy_(torch.randn(64, 4096, generator=gen, device="cuda").half())
        x16.copy_(torch.randn(16, 4096, generator=gen, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        for a, b in pairs:
            want = qref.quant_matmul(a, qweight, scales, zeros, 4, 128).float()
            worst = max(worst, ((b.float() - want).abs().max() / want.abs().max()).item())
    counters = cuda_backend._default_scratch[x.device].counters
    ok = worst < 2e-3 and int(counters.abs().sum()) == 0
    ROWS.append(Row("graph", "tiled split launches: 4 graph replays", worst, ok, 0.0, 0.0, 0))
    print(f"  tiled split launches, 4 graph replays: {'ok' if ok else 'FAIL'} rel_err {worst:.1e}, "
          f"counters {int(counters.abs().sum())}", flush=True)
    del graph, qweight, scales, zeros

    tc = cuda_backend.QUANT_KERNELS["tensor_cores"]
    print(f"\ntimes in CUDA graphs over {copies} weight copies (4-bit, group 128), us per call")
    layer = {m: {"fp16": 0.0, "csrc tensor cores": 0.0, "triton": 0.0, "tiled": 0.0, "best before": 0.0}
             for m in bench_rows}
    for k, n in TILED_SHAPES:
        weights = [make_weights(k, n, 4, 128, False, gen)[:3] for _ in range(copies)]
        for m in bench_rows:
            x = torch.randn(m, k, generator=gen, device="cuda").half()
            out = torch.empty(m, n, dtype=torch.float16, device="cuda")
            fp16_w = [qref.dequantize(*w, 4, 128) for w in weights]
            t = {"fp16": 1e3 * cuda_backend.graph_time_ms(lambda w: torch.mm(x, w, out=out), fp16_w)}
            del fp16_w
            t["csrc tensor cores"] = 1e3 * cuda_backend.graph_time_ms(
                lambda w: cuda_backend.launch_quant_gemv_4bit(x, *w, 128, out=out, kernel=tc), weights)
            t["triton"] = 1e3 * cuda_backend.graph_time_ms(lambda w: quant_gemm(x, *w, 4, 128, out=out), weights)
            tiled = {}
            for warps, splits, wgmma in configs:
                tiled[(warps, splits, wgmma)] = 1e3 * cuda_backend.graph_time_ms(
                    lambda w: cuda_backend.launch_quant_gemm_4bit(x, *w, 128, out=out, warps=warps, splits=splits,
                                                                  wgmma=wgmma),
                    weights)
            best = min(tiled, key=tiled.get)
            t["tiled"] = tiled[best]
            t["best before"] = min(t["csrc tensor cores"], t["triton"])
            for key in layer[m]:
                layer[m][key] += t[key]
            shapes = " ".join(f"{('', 'g', 'p')[g]}{w}w/{s}:{v:.1f}" for (w, s, g), v in sorted(tiled.items()))
            print(f"  {k}x{n} M={m}: fp16 {t['fp16']:.1f} | csrc tensor cores {t['csrc tensor cores']:.1f} | "
                  f"triton {t['triton']:.1f} | tiled {t['tiled']:.1f} ({('', 'wgmma, ', 'ws, ')[best[2]]}{best[0]} warps, "
                  f"{best[1]} splits)", flush=True)
            print(f"      tiled by shape: {shapes}", flush=True)
        del weights
        torch.cuda.empty_cache()
    for m, t in layer.items():
        print(f"  a layer (4 shapes) M={m}: " + ", ".join(f"{key} {v:.1f}" for key, v in t.items())
              + f"; tiled / fp16 {t['fp16'] / t['tiled']:.2f}x, best before / fp16 {t['fp16'] / t['best before']:.2f}x",
              flush=True)


def print_table() -> None:
    print(f"\n{'kernel':<6} {'case':<44} {'ok':<4} {'rel_err':>8} {'us':>9} {'fp16 us':>9} {'speedup':>8} {'GB/s':>7} {'%HBM':>5}")
    for r in ROWS:
        if r.kernel == "graph":
            print(f"{r.kernel:<6} {r.case:<44} {'ok' if r.ok else 'FAIL':<4} {r.rel_err:8.1e}")
            continue
        gbs = r.num_bytes / (r.us * 1e-6) / 1e9
        print(f"{r.kernel:<6} {r.case:<44} {'ok' if r.ok else 'FAIL':<4} {r.rel_err:8.1e} {r.us:9.1f} {r.fp16_us:9.1f} "
              f"{r.fp16_us / r.us:7.2f}x {gbs:7.0f} {gbs * 1e9 / HBM_BYTES_PER_S * 100:4.0f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, batches 1 and 64")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="these batches instead of the default ones")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch configurations")
    ap.add_argument("--sweep-only", action="store_true", help="only time the alternative configurations")
    ap.add_argument("--sweep-graph", action="store_true",
                    help="only time the GEMM's configurations at 48 and 64 rows in CUDA graphs")
    ap.add_argument("--dependent-only", action="store_true", help="only the dependent-launch chain check")
    ap.add_argument("--tiled-only", action="store_true", help="only the tiled csrc GEMM's checks and timings")
    ap.add_argument("--gated-only", action="store_true", help="only the one-row kernel's gated form: checks, timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device; this script checks the compiled kernels on a GPU", file=sys.stderr)
        return 1
    try:
        import asyncgen  # noqa: F401
    except ImportError:
        print("asyncgen is not importable: run from the repository root with PYTHONPATH=.", file=sys.stderr)
        return 1
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    if args.sweep_only:
        sweep()
        return 0
    if args.sweep_graph:
        sweep_graph()
        return 0
    if args.gated_only or args.tiled_only:
        check_gated() if args.gated_only else check_tiled()
        failed = [r for r in ROWS if not r.ok]
        print(f"\n{len(ROWS) - len(failed)} / {len(ROWS)} checks passed")
        return 1 if failed else 0
    shapes = SHAPES[:2] if args.quick else SHAPES
    batches = args.batches or ([1, 64] if args.quick else BATCHES)
    if not args.dependent_only:
        check_kernels(shapes, batches)
        check_graph_capture()
        check_gated()
    check_dependent_launch()
    if args.sweep:
        sweep()
    print_table()
    failed = [r for r in ROWS if not r.ok]
    print(f"\n{len(ROWS) - len(failed)} / {len(ROWS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
