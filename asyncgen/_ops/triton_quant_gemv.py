"""Weight-only quantized GEMV, ``x @ W`` for a few rows (decode at small batch).

Same arguments and arithmetic as :func:`asyncgen._ops.triton_quant_gemm.quant_gemm` (defined
by the reference ``quant_matmul``), for ``M <= MAX_ROWS``.

Without tensor cores there is no need for a K-ordered weight tile: a program loads a
``[BLOCK_KW, BLOCK_N]`` block of packed words once, then for each of the ``pack`` codes
in a word (``static_range``) shifts them out, dequantizes, and multiplies by the x
elements those codes belong to (column ``word * pack + i``, loaded straight from x,
through ``perm`` when given). Products accumulate elementwise in a
``[BLOCK_M, BLOCK_KW, BLOCK_N]`` fp32 register tile, reduced over K once at the end, so
the loop has no cross-thread reductions. Output tiles are few when N is small, so the K
range is split across programs (``SPLIT_K``) that add into an fp32 buffer atomically.

Napkin math, Llama-2-7B, one token (M = 1), 4-bit group 128: per layer the weights are
q|k|v 25 MB + o 8.4 MB + gate|up 45 MB + down 22.5 MB ~= 101 MB (scales and zeros +6 %),
~21 us at 4.8 TB/s; 32 layers ~0.7 ms a token against ~2.7 ms for fp16's 405 MB a layer.
FLOPs are 2 per weight (~0.5 FLOP/B): the dequantization (~6 ops a weight) sets the
ALU side at ~3.2 G ops a token, ~50 us of the CUDA cores: well under the memory time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_quant_gemm import check_quant_args, group_per_tile, split_k

__all__ = ["MAX_ROWS", "quant_gemv"]

MAX_ROWS = 8


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: one variant for all
def _quant_gemv_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K // pack, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (unused unless HAS_G_IDX)
    perm_ptr,  # [K] (unused unless HAS_PERM)
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N]: out's dtype, or fp32 added to atomically when SPLIT_K > 1
    M,
    N,
    K,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_om,
    group_size,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # packed words per tile along K
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK_K: tl.constexpr = BLOCK_KW * PACK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    num_words = K // PACK
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        kw = k0 // PACK + tl.arange(0, BLOCK_KW)
        kw_mask = kw < num_words
        w_mask = kw_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + kw.to(tl.int64)[:, None] * stride_qk + rn[None, :], mask=w_mask, other=0)
        if GROUP_PER_TILE:
            g = k0 // group_size
            s = tl.load(scales_ptr + g * stride_sg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + g * stride_zg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        for i in tl.static_range(PACK):
            rk = kw * PACK + i  # [BLOCK_KW] the rows whose codes sit in field i
            if not GROUP_PER_TILE:
                if HAS_G_IDX:
                    g = tl.load(g_idx_ptr + rk, mask=kw_mask, other=0).to(tl.int64)
                else:
                    g = (rk // group_size).to(tl.int64)
                s = tl.load(scales_ptr + g[:, None] * stride_sg + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + g[:, None] * stride_zg + rn[None, :], mask=w_mask, other=0.0).to(tl.float32)
            codes = (words >> (i * BITS)) & MASK
            w = ((codes.to(tl.float32) - z) * s).to(scales_ptr.dtype.element_ty)
            w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
            if HAS_PERM:
                cols = tl.load(perm_ptr + rk, mask=kw_mask, other=0)
            else:
                cols = rk
            xi = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & kw_mask[None, :], other=0.0).to(tl.float32)
            acc += xi[:, :, None] * w[None, :, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        y += b[None, :] * (pid_k == 0).to(tl.float32)
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, y, mask=mask)


def _config(m: int, n: int, k: int, bits: int, group_size: int, g_idx, device: torch.device) -> dict:
    """Launch configuration; the register tile is BLOCK_M * BLOCK_KW * BLOCK_N fp32."""
    block_m = 1
    while block_m < m:
        block_m *= 2
    block_n = 64
    block_kw = max(1, 2048 // (block_m * block_n))  # 32 words (256 4-bit rows) at M = 1
    pack = 32 // bits
    if g_idx is None and group_size < k:
        while block_kw > 1 and group_size % (block_kw * pack):
            block_kw //= 2
    tiles = triton.cdiv(n, block_n)
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw,
        SPLIT_K=split_k(tiles, k, block_kw * pack, device), num_warps=4,
    )


def quant_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x[:, perm] @ W + bias`` for at most :data:`MAX_ROWS` rows of ``x``; arguments as
    :func:`~asyncgen._ops.triton_quant_gemm.quant_gemm`. Never synchronises with the device."""
    m, n, k = check_quant_args(x, qweight, scales, zeros, bits, group_size, g_idx, perm, bias, out, _quant_gemv_kernel)
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows; the GEMV takes at most {MAX_ROWS} (use quant_gemm)")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = _config(m, n, k, bits, group_size, g_idx, x.device)
    block_k = cfg["BLOCK_KW"] * (32 // bits)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    split = cfg["SPLIT_K"]
    target = out if split == 1 else torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _quant_gemv_kernel[grid](
        x, qweight, scales, zeros,
        g_idx if g_idx is not None else qweight,
        perm if perm is not None else qweight,
        bias if bias is not None else scales,
        target,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), target.stride(0),
        group_size,
        BITS=bits,
        HAS_G_IDX=g_idx is not None,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        GROUP_PER_TILE=group_per_tile(group_size, k, block_k, g_idx),
        **cfg,
    )
    if split > 1:
        out.copy_(target)
    return out
