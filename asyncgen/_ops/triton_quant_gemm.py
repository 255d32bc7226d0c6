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

Within one group and where every code fits a 16-bit float's significand (4-bit codes; 8-bit
in fp16), the tile is dequantized without integer-to-float conversions, which issue at a
quarter of the arithmetic rate on the GPU and, with the fp32 -> fp16 rounding after them,
bounded the GEMM at decode batches: code ``c`` ORed into the significand of ``2**e`` is
the float ``2**e + c`` (``e`` = 10 in fp16, 7 in bf16), and ``(2**e + c) - (2**e + z)``
is exact, so ``((2**e + c) - (2**e + z)) * s`` in the scales' dtype, one rounding, is the
reference's weight bit for bit. In SASS (sm_90) the inner loop of a 64x64x128 tile lost
its 32 I2FP and 16 F2FP per thread and went from 401 to 334 instructions, the
subtraction and the product issuing as half2 pairs.

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


@triton.jit
def dequant_tile_magic(
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
    MATH_FP32: tl.constexpr,
):
    """:func:`dequant_tile_unpacked_once` without integer-to-float conversions: every
    code is ORed into the significand of a 16-bit float ``2**e + code``, then
    ``(that - (2**e + zero)) * scale`` in the scales' dtype. The subtraction is exact
    (small integers), and the product of two 16-bit floats rounded once is the
    reference's fp32 product rounded once. The ``pack`` codes of a word become rows
    ``pack * i + j`` through joins in the registers of the thread that loaded it."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    IS_FP16: tl.constexpr = scales_ptr.dtype.element_ty == tl.float16
    # fp16 1024.0 (10 significand bits) or bf16 128.0 (7): 2**e + code for codes below that.
    MAGIC: tl.constexpr = 0x6400 if IS_FP16 else 0x4300
    MAGIC_VALUE: tl.constexpr = 1024.0 if IS_FP16 else 128.0
    kw = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    mask = (kw < num_words)[:, None] & n_mask[None, :]
    words = tl.load(qweight_ptr + kw.to(tl.int64)[:, None] * stride_qk + rn[None, :], mask=mask, other=0)
    g = k0 // group_size
    s = tl.load(scales_ptr + g * stride_sg + rn, mask=n_mask, other=0.0)[None, :]
    z = tl.load(zeros_ptr + g * stride_zg + rn, mask=n_mask, other=0.0)[None, :]
    c0 = (((words >> (0 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
    c1 = (((words >> (1 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
    c2 = (((words >> (2 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
    c3 = (((words >> (3 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
    if PACK == 8:
        c4 = (((words >> (4 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
        c5 = (((words >> (5 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
        c6 = (((words >> (6 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
        c7 = (((words >> (7 * BITS)) & MASK) | MAGIC).to(tl.int16).to(s.dtype, bitcast=True)
        # [W, N, b0, b1, b2] with code j = 4 b2 + 2 b1 + b0, then rows 8 i + j.
        t = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))
        codes = tl.reshape(tl.permute(t, (0, 4, 3, 2, 1)), (BLOCK_K, BLOCK_N))
    else:
        t = tl.join(tl.join(c0, c1), tl.join(c2, c3))
        codes = tl.reshape(tl.permute(t, (0, 3, 2, 1)), (BLOCK_K, BLOCK_N))
    if MATH_FP32:
        return ((codes.to(tl.float32) - (z.to(tl.float32) + MAGIC_VALUE)) * s.to(tl.float32)).to(s.dtype)
    return (codes - (z + MAGIC_VALUE).to(s.dtype)) * s


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
    MAGIC: tl.constexpr,  # with GROUP_PER_TILE: that, without int-to-float conversions
    MATH_FP32: tl.constexpr,  # MAGIC's arithmetic in fp32 (the interpreter's bf16 is wrong)
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
        if MAGIC and GROUP_PER_TILE:
            w = dequant_tile_magic(
                qweight_ptr, scales_ptr, zeros_ptr, rn, n_mask, k0, K // (32 // BITS),
                stride_qk, stride_sg, stride_zg, group_size, BITS, BLOCK_K, BLOCK_N, MATH_FP32,
            )
        elif UNPACK_ONCE and GROUP_PER_TILE:
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
    MAGIC: tl.constexpr,
    MATH_FP32: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    k0 = tl.program_id(0) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = rk < K
    n_mask = rn < N
    if GROUP_PER_TILE and MAGIC:  # each packed word loaded once, no int-to-float conversions
        w = dequant_tile_magic(
            qweight_ptr, scales_ptr, zeros_ptr, rn, n_mask, k0, K // (32 // BITS),
            stride_qk, stride_sg, stride_zg, group_size, BITS, BLOCK_K, BLOCK_N, MATH_FP32,
        )
    elif GROUP_PER_TILE:  # each packed word loaded once
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
        MAGIC=magic_exact(bits, scales.dtype),
        MATH_FP32=scales.dtype == torch.bfloat16 and is_interpreted(_dequantize_kernel),
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


def magic_exact(bits: int, dtype: torch.dtype) -> bool:
    """Whether :func:`dequant_tile_magic` holds every code of ``bits`` in ``dtype``'s
    significand: fp16 has 10 bits, bf16 7."""
    return (dtype == torch.float16 and bits <= 10) or (dtype == torch.bfloat16 and bits <= 7)


def _config(
    m: int, n: int, k: int, bits: int, group_size: int, g_idx, device: torch.device, scales_dtype: torch.dtype
) -> dict:
    """Launch configuration by the number of rows (decode batch or prompt chunk).

    From timing the alternatives on an H200 at the 7B layer shapes
    (``tests/gpu/check_quant_ops.py --sweep-only``, docs/BENCHMARKS.md): unpacking each
    word once per tile won at almost every shape (up to 2.6x at M = 256); with the codes
    ORed into floats (``MAGIC``), 64-column tiles and a K split of at most 4 (1 for the
    wide layers, which have tiles enough) up to 64 rows, 128 columns and 8 warps for the
    4096-wide ones at 33-64 rows.
    """
    if m <= 32:
        if m <= 16:
            block_m, block_n, block_k, warps, stages, max_split = 16, 64, 128, 4, 4, 4
        else:
            block_m, block_n, block_k, warps, stages, max_split = 32, 64, 64, 4, 4, 2
    elif m <= 64:
        if n > 4096:
            block_m, block_n, block_k, warps, stages, max_split = 64, 64, 128, 4, 3, 1
        else:
            block_m, block_n, block_k, warps, stages, max_split = 64, (64 if k > 8192 else 128), 128, 8, 3, 4
    elif m <= 256:
        block_m, block_n, block_k, warps, stages, max_split = (128 if n > 8192 else 64), 128, 64, 8, 3, 1
    else:
        block_m, block_n, block_k, warps, stages, max_split = 128, 128, 64, 8, 3, 1
    # Prefer a tile that stays inside one group (one scale row per tile) when one fits.
    if g_idx is None and group_size < k:
        while block_k > 16 and group_size % block_k:
            block_k //= 2
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    # Splitting K only pays while the weight read dominates (few rows).
    split = min(split_k(tiles, k, block_k, device), max_split)
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, GROUP_M=8, num_warps=warps,
        num_stages=stages, UNPACK_ONCE=True, MAGIC=magic_exact(bits, scales_dtype),
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
    cfg = _config(m, n, k, bits, group_size, g_idx, x.device, scales.dtype)
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
        MATH_FP32=scales.dtype == torch.bfloat16 and is_interpreted(_quant_gemm_kernel),
        **cfg,
    )
    if split > 1:
        out.copy_(target)
    return out
