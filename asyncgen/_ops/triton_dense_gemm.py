"""Dense ``x @ W^T`` for a few dozen to a hundred-odd rows: a weight-streaming GEMM.

    x       [M, K]  fp16 / bf16 / fp32, rows strided, last dim contiguous
    weight  [N, K]  x's dtype, rows strided, last dim contiguous (an ``nn.Linear`` weight)
    bias    [N]     optional
    out     [M, N]  x's dtype

At these row counts a product is bound by reading the weight once, and what matters is
keeping every SM streaming it: one program computes a ``[BLOCK_M, BLOCK_N]`` tile of
``out`` over a share of K. With few column tiles (N = 4096 at BLOCK_N = 128 gives 32) the
K loop is split over ``SPLIT_K`` programs; each writes its fp32 partial to a workspace,
takes a ticket on its tile's counter, and the program that takes the last ticket adds the
partials up, adds the bias, writes ``out`` and resets the counter, so one launch does the
whole product and the counters stay zero between calls.

Napkin math, Llama-2-7B gate|up (K = 4096, N = 22016) at M = 128: 180 MB of weight, 41
us at the H200's 4.4 TB/s bulk read; 23 GFLOP, ~35 us of its ~660 TFLOP/s dense fp16.
q|k|v (N = 12288) 100 MB, 23 us; o and down (N = 4096) 34 and 90 MB, 8 and 20 us. The x
tile is re-read from L2 by every column tile (N / BLOCK_N reads of M * K * 2 bytes: 1 MB
at M = 128, K = 4096), so BLOCK_N stays at 64 or more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import check_devices, check_out, check_tensor

__all__ = ["DenseGemmConfig", "dense_gemm"]

# Counters of the split-K tiles, per device: zero between calls (the last program of a
# tile resets its own). Kernels on one stream run one after another, so calls share them.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16


class DenseGemmConfig(tuple):
    """``(block_m, block_n, block_k, split_k, num_warps, num_stages)``."""

    __slots__ = ()

    def __new__(cls, block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int):
        for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if not isinstance(split_k, int) or split_k < 1:
            raise ValueError(f"split_k must be an int >= 1, got {split_k!r}")
        if num_warps not in (1, 2, 4, 8, 16) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_warps must be 1-16 (a power of two) and num_stages >= 1, got {num_warps!r}, "
                             f"{num_stages!r}")
        return super().__new__(cls, (block_m, block_n, block_k, split_k, num_warps, num_stages))

    block_m = property(lambda self: self[0])
    block_n = property(lambda self: self[1])
    block_k = property(lambda self: self[2])
    split_k = property(lambda self: self[3])
    num_warps = property(lambda self: self[4])
    num_stages = property(lambda self: self[5])


def default_config(m: int, n: int, k: int, sms: int = 132) -> DenseGemmConfig:
    """All rows in one tile (up to 128), 128 columns a tile, and K split until the tiles
    give about one program per SM, each with at least 8 K steps of 64."""
    block_m = max(16, min(128, triton.next_power_of_2(m)))
    block_n = 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= sms and triton.cdiv(k, 64) // (split * 2) >= 8:
        split *= 2
    return DenseGemmConfig(block_m, block_n, 64, split, 4, 4)


@triton.jit
def _dense_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,  # [SPLIT_K, grid_m * BLOCK_M, N] fp32 (SPLIT_K > 1)
    counter_ptr,  # [grid_m * grid_n] int32, zero on entry and on exit
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t_lo = pid_k * per_split
    t_hi = tl.minimum(t_lo + per_split, k_tiles)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [M, K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k0 = t * BLOCK_K
        k_mask = k0 + offs_k < K
        a = tl.load(x_ptrs + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)

    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        rows = tl.num_programs(1) * BLOCK_M
        ws_offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        split_stride = rows.to(tl.int64) * N
        tl.store(ws_ptr + pid_k * split_stride + ws_offs, acc, mask=out_mask)
        # Every thread's partial is written before the ticket is taken (the barrier), and
        # the ticket's release/acquire orders them for the program that takes the last one.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + s * split_stride + ws_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _MAX_TILES:
        raise ValueError(f"dense_gemm: {tiles} output tiles exceed the {_MAX_TILES} split-K counters; use larger "
                         f"blocks or split_k=1")
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return buf


def dense_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: DenseGemmConfig | None = None,
) -> torch.Tensor:
    """``out = x @ weight.T (+ bias)``, as ``torch.nn.functional.linear``: fp32
    accumulation, one rounding to x's dtype. ``config`` defaults to
    :func:`default_config` for the shape. Returns ``out`` (allocated when not given)."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("weight", weight, ndim=2, dtypes=(x.dtype,))
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must have shape (N, {k}) to match x's K, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=(x.dtype,))
        if bias.shape[0] != n:
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    check_out("out", out, (m, n), x.dtype)
    device = check_devices(_dense_gemm_kernel, x=x, weight=weight, bias=bias, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=device)
    if m == 0 or n == 0:
        return out
    cfg = config if config is not None else default_config(m, n, k)
    if not isinstance(cfg, DenseGemmConfig):
        raise ValueError(f"config must be a DenseGemmConfig, got {cfg!r}")
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    if cfg.split_k > 1:
        counters = _counters(device, grid[0] * grid[1])
        ws = torch.empty((cfg.split_k, grid[1] * cfg.block_m, n), dtype=torch.float32, device=device)
    else:
        counters, ws = out, out
    _dense_gemm_kernel[grid](
        x, weight, bias if bias is not None else out, out, ws, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        UPCAST=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
