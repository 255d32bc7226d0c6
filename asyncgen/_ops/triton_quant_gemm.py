"""Weight-only quantized GEMM, ``x @ W`` with ``W`` 4-bit (or 8-bit), for prompt chunks
and large decode batches.

The weight layout and the exact arithmetic are defined by
:mod:`asyncgen._ops.quant_reference` (``quant_matmul``)::

    x        [M, K]         fp16 / bf16 / fp32, rows strided, last dim contiguous
    qweight  [K // pack, N] int32, codes packed along K (pack = 32 // bits)
    scales   [G, N], zeros [G, N]   per group of input rows
    g_idx    [K] int32 (optional)   per-row group; default k // group_size
    perm     [K] (optional)         weight row k multiplies x[:, perm[k]]
    out      [M, N]         x's dtype

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``out``. Per ``BLOCK_K`` step it
loads the x tile (through ``perm`` when given) and the packed words under the weight tile
(each word once per code it holds; the repeats hit L1), unpacks and dequantizes the tile
in registers, rounds it as the reference does, and feeds it to ``tl.dot``. When every K
tile lies in one group (``group_size`` a multiple of ``BLOCK_K``, no ``g_idx``) it reads
one row of scales and zeros per tile, else one per weight row. With few output tiles the
K loop is split across programs (``SPLIT_K``) that add into an fp32 buffer atomically.

Napkin math, Llama-2-7B MLP gate|up (K = 4096, N = 22016), 4-bit, group 128:
    weights 45 MB (+ 2.8 MB scales and zeros) against 180 MB in fp16.
    M = 256: 46 GFLOP, ~70 us on H200 tensor cores (~660 TFLOP/s dense fp16); weight reads
    ~10 us at 4.8 TB/s: compute-bound, as fp16 is at this size. The dequantization (~6
    integer/fp32 ops per weight) is repeated once per M tile: K*N*6*(M/BLOCK_M) = 1.1
    GOP at BLOCK_M = 128, a few us of the CUDA cores' ~60 TOP/s.
    M = 16: 8x fewer FLOPs than bytes allow; bandwidth-bound at ~10 us (fp16: ~40 us).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_shape, check_tensor, is_interpreted, num_sms

__all__ = ["dequant_matmul", "dequantize", "quant_gemm"]


@triton.jit
def dequant_tile(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    g_idx_ptr,
    rk,  # [BLOCK_K] weight rows of the tile
    rn,  # [BLOCK_N] columns of the tile
    k_mask,
    n_mask,
    k0,  # first row of the tile
    stride_qk,
    stride_sg,
    stride_zg,
    group_size,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,
):
    """The ``[BLOCK_K, BLOCK_N]`` weight tile, rounded to the scales' dtype (as the reference)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    mask = k_mask[:, None] & n_mask[None, :]
    word_rows = (rk // PACK).to(tl.int64)
    words = tl.load(qweight_ptr + word_rows[:, None] * stride_qk + rn[None, :], mask=mask, other=0)
    codes = (words >> ((rk % PACK) * BITS)[:, None]) & MASK
    if GROUP_PER_TILE:
        g = k0 // group_size
        s = tl.load(scales_ptr + g * stride_sg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        z = tl.load(zeros_ptr + g * stride_zg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    else:
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + rk, mask=k_mask, other=0)
        else:
            g = rk // group_size
        g = g.to(tl.int64)
        s = tl.load(scales_ptr + g[:, None] * stride_sg + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + g[:, None] * stride_zg + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    w = (codes.to(tl.float32) - z) * s
    return w.to(scales_ptr.dtype.element_ty)


@triton.jit
def dequant_tile_unpacked_once(
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    rn,  # [BLOCK_N] columns of the tile
    n_mask,
    k0,  # first row of the tile, a multiple of BLOCK_K (so of the pack factor)
    num_words,  # K // pack
    stride_qk,
    stride_sg,
    stride_zg,
    group_size,
    BITS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """:func:`dequant_tile` for a tile inside one group, loading each packed word once:
    ``[BLOCK_K // pack, BLOCK_N]`` words, shifted into ``[BLOCK_K // pack, pack, BLOCK_N]``
    codes, reshaped (in order) to the ``[BLOCK_K, BLOCK_N]`` tile."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    kw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    mask = (kw < num_words)[:, None] & n_mask[None, :]
    words = tl.load(qweight_ptr + kw.to(tl.int64)[:, None] * stride_qk + rn[None, :], mask=mask, other=0)
    shifts = tl.arange(0, PACK) * BITS
    codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
    g = k0 // group_size
    s = tl.load(scales_ptr + g * stride_sg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    z = tl.load(zeros_ptr + g * stride_zg + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    w = (codes.to(tl.float32) - z) * s
    return w.to(scales_ptr.dtype.element_ty)


@triton.jit(do_not_specialize=["M"])  # the row count changes every step: one variant for all
def _quant_gemm_kernel(
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
    DOT_FP32: tl.constexpr,
    UNPACK_ONCE: tl.constexpr,  # with GROUP_PER_TILE: load each packed word once per tile
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Swizzled tile order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + rk, mask=k_mask, other=0)
        else:
            cols = rk
        a = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if UNPACK_ONCE and GROUP_PER_TILE:
            w = dequant_tile_unpacked_once(
                qweight_ptr, scales_ptr, zeros_ptr, rn, n_mask, k0, K // (32 // BITS),
                stride_qk, stride_sg, stride_zg, group_size, BITS, BLOCK_K, BLOCK_N,
            )
        else:
            w = dequant_tile(
                qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rk, rn, k_mask, n_mask, k0,
                stride_qk, stride_sg, stride_zg, group_size, BITS, HAS_G_IDX, GROUP_PER_TILE,
            )
        w = w.to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        b = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[None, :] * (pid_k == 0).to(tl.float32)
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


# --- launcher -------------------------------------------------------------------------------------
def check_quant_args(x, qweight, scales, zeros, bits, group_size, g_idx, perm, bias, out, kernel) -> tuple[int, int, int]:
    """Checks the arguments shared by the quantized GEMM and GEMV launchers; returns (M, N, K)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    n = check_quant_weight(qweight, scales, zeros, bits, group_size, g_idx, k, "x has")
    if perm is not None:
        check_tensor("perm", perm, ndim=1, dtypes=INDEX_DTYPES)
        check_shape("perm", perm, (k,))
    if bias is not None:
        check_tensor("bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_shape("bias", bias, (n,))
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(x.dtype,))
        check_shape("out", out, (m, n))
    check_devices(
        kernel, x=x, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx, perm=perm, bias=bias, out=out
    )
    return m, n, k


def check_quant_weight(qweight, scales, zeros, bits, group_size, g_idx, k: int, k_source: str) -> int:
    """Checks a packed weight of ``k`` input rows (``k_source`` says where that count came
    from, for the messages); returns N."""
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int32,))
    check_tensor("scales", scales, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("zeros", zeros, ndim=2, dtypes=FLOAT_DTYPES)
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    pack = 32 // bits
    n = qweight.shape[1]
    if k % pack:
        raise ValueError(f"{k_source} {k} columns, not a multiple of {pack} ({bits}-bit codes per int32)")
    check_shape("qweight", qweight, (k // pack, n))
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int (K for one group), got {group_size!r}")
    num_groups = scales.shape[0]
    check_shape("scales", scales, (num_groups, n))
    check_shape("zeros", zeros, (num_groups, n))
    if g_idx is None and -(-k // group_size) > num_groups:
        raise ValueError(f"scales has {num_groups} groups; {k} rows in groups of {group_size} need {-(-k // group_size)}")
    if g_idx is not None:
        check_tensor("g_idx", g_idx, ndim=1, dtypes=(torch.int32,))
        check_shape("g_idx", g_idx, (k,))
    return n


@triton.jit
def _dequantize_kernel(
    qweight_ptr,  # [K // pack, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (unused unless HAS_G_IDX)
    out_ptr,  # [K, N], scales' dtype
    N,
    K,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_ok,
    group_size,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    k0 = tl.program_id(0) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = rk < K
    n_mask = rn < N
    if GROUP_PER_TILE:  # each packed word loaded once
        w = dequant_tile_unpacked_once(
            qweight_ptr, scales_ptr, zeros_ptr, rn, n_mask, k0, K // (32 // BITS),
            stride_qk, stride_sg, stride_zg, group_size, BITS, BLOCK_K, BLOCK_N,
        )
    else:
        w = dequant_tile(
            qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rk, rn, k_mask, n_mask, k0,
            stride_qk, stride_sg, stride_zg, group_size, BITS, HAS_G_IDX, GROUP_PER_TILE,
        )
    tl.store(out_ptr + rk.to(tl.int64)[:, None] * stride_ok + rn[None, :], w, mask=k_mask[:, None] & n_mask[None, :])


_DEQUANT_BLOCK_K, _DEQUANT_BLOCK_N = 64, 128


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense weight ``W`` [K, N] in the dtype of ``scales``, as the reference
    ``dequantize`` defines it (``group_size`` positive: K for one group). ``out``
    (keyword-only): a preallocated contiguous [K, N] tensor of that dtype."""
    k = qweight.shape[0] * (32 // bits) if bits in (4, 8) and qweight.dim() == 2 else 0
    n = check_quant_weight(qweight, scales, zeros, bits, group_size, g_idx, k, "qweight unpacks to")
    check_devices(_dequantize_kernel, qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx, out=out)
    if out is None:
        out = torch.empty(k, n, dtype=scales.dtype, device=qweight.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(scales.dtype,))
        check_shape("out", out, (k, n))
        if out.stride(1) != 1:
            raise ValueError(f"out must have contiguous rows, got strides {tuple(out.stride())}")
    return _launch_dequantize(qweight, scales, zeros, bits, group_size, g_idx, out)


def _launch_dequantize(qweight, scales, zeros, bits: int, group_size: int, g_idx, out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` with its arguments already checked."""
    k, n = out.shape
    if k == 0 or n == 0:
        return out
    grid = (triton.cdiv(k, _DEQUANT_BLOCK_K), triton.cdiv(n, _DEQUANT_BLOCK_N))
    _dequantize_kernel[grid](
        qweight, scales, zeros, g_idx if g_idx is not None else qweight, out,
        n, k, qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), group_size,
        BITS=bits,
        HAS_G_IDX=g_idx is not None,
        GROUP_PER_TILE=group_per_tile(group_size, k, _DEQUANT_BLOCK_K, g_idx),
        BLOCK_K=_DEQUANT_BLOCK_K,
        BLOCK_N=_DEQUANT_BLOCK_N,
        num_warps=4,
    )
    return out


def dequant_matmul(
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
    """:func:`quant_gemm`'s product computed another way: the weight dequantized to a
    dense [K, N] buffer (:func:`dequantize`), then a dense matmul (cuBLAS on CUDA). For
    prompt-sized M the matmul runs at dense speed and the dequantization, a pass over the
    weight that writes 2 bytes per weight, costs less than dequantizing inside every
    output tile. Same arguments and result (to the matmul's summation order)."""
    m, n, k = check_quant_args(x, qweight, scales, zeros, bits, group_size, g_idx, perm, bias, out, _dequantize_kernel)
    w = torch.empty(k, n, dtype=scales.dtype, device=qweight.device)
    w = _launch_dequantize(qweight, scales, zeros, bits, group_size, g_idx, w)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if perm is not None:
        x = x.index_select(1, perm)
    y = torch.mm(x, w) if bias is None else torch.addmm(bias.to(x.dtype), x, w)
    if out is None:
        return y
    return out.copy_(y)


def group_per_tile(group_size: int, k: int, block_k: int, g_idx) -> bool:
    """Whether every K tile of ``block_k`` rows lies in one group."""
    return g_idx is None and (group_size >= k or group_size % block_k == 0)


def split_k(num_tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Programs per output tile along K: enough for about four programs per SM."""
    want = max(1, (4 * num_sms(device)) // max(num_tiles, 1))
    split = 1
    while split * 2 <= min(want, 16, triton.cdiv(k, block_k)):
        split *= 2
    return split


def _config(m: int, n: int, k: int, bits: int, group_size: int, g_idx, device: torch.device) -> dict:
    """Launch configuration by the number of rows (decode batch or prompt chunk).

    From timing the alternatives on an H200 at the 7B layer shapes
    (``tests/gpu/check_quant_ops.py --sweep``, docs/BENCHMARKS.md): unpacking each word
    once per tile won at almost every shape (up to 2.6x at M = 256), and 8 warps with a
    K split of at most 2-4 at M = 64.
    """
    wide = n > 4096 or k > 8192
    if m <= 32:
        block_m, block_n, block_k, warps, stages = (16 if m <= 16 else 32), (128 if wide else 64), 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, (128 if k > 8192 else 64), 128, 8, 3
    elif m <= 256:
        block_m, block_n, block_k, warps, stages = (128 if n > 8192 else 64), 128, 64, 8, 3
    else:
        block_m, block_n, block_k, warps, stages = 128, 128, 64, 8, 3
    # Prefer a tile that stays inside one group (one scale row per tile) when one fits.
    if g_idx is None and group_size < k:
        while block_k > 16 and group_size % block_k:
            block_k //= 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # Splitting K only pays while the weight read dominates (few rows).
    split = split_k(tiles, k, block_k, device) if m <= 64 else 1
    if 32 < m <= 64:
        split = min(split, 4 if k > 8192 else 2)
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_M=8, num_warps=warps,
        num_stages=stages, UNPACK_ONCE=True,
    )


def quant_gemm(
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
    """``x[:, perm] @ W + bias`` for the packed weight ``W``; see the reference
    ``quant_matmul`` (same arguments; ``group_size`` must be positive: pass K for one
    group). ``out`` (keyword-only): a preallocated [M, N] output, possibly a column slice
    of a wider tensor. Never synchronises with the device."""
    m, n, k = check_quant_args(x, qweight, scales, zeros, bits, group_size, g_idx, perm, bias, out, _quant_gemm_kernel)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    if perm is not None and x.is_cuda:
        # Gathering x's columns once (a small copy) instead of inside every tile: on an
        # H200, act-order 4096x11008 at M = 64 took 139 us against 415-465 us.
        x, perm = x.index_select(1, perm), None
    cfg = _config(m, n, k, bits, group_size, g_idx, x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    split = cfg["SPLIT_K"]
    target = out if split == 1 else torch.zeros(m, n, dtype=torch.float32, device=x.device)
    _quant_gemm_kernel[grid](
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
        GROUP_PER_TILE=group_per_tile(group_size, k, cfg["BLOCK_K"], g_idx),
        DOT_FP32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and is_interpreted(_quant_gemm_kernel)),
        **cfg,
    )
    if split > 1:
        out.copy_(target)
    return out
