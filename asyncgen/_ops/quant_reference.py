"""Plain-torch definitions of the 4-bit (and 8-bit) weight-only quantized matmul.

Every quantized checkpoint format (AWQ, GPTQ) is converted at load into one layout, the
one the Triton kernels read; these functions define what that layout means::

    qweight  [K // pack, N]  int32   pack = 32 // bits codes per word, packed along K:
                                     code (k, n) = (qweight[k // pack, n] >> (bits * (k % pack))) & (2**bits - 1)
    scales   [G, N]          fp16    (or bf16) one scale per group of input rows and column
    zeros    [G, N]          scales' dtype, the zero point as a (small, exact) integer value
    g_idx    [K] int32 or None       group of row k; None means k // group_size
    perm     [K] int64 or None       row k of the weight multiplies input column perm[k]

    W[k, n] = to_scales_dtype((code(k, n) - zeros[g(k), n]) * scales[g(k), n])     # [K, N]
    y       = x[:, perm] @ W  (+ bias)                                               # [M, N]

The product ``(code - zero) * scale`` is exact in fp32 (a 5-bit integer times an 11-bit
significand), so rounding it once to the scales' dtype gives bit for bit the fp16 weight
that AutoAWQ and GPTQModel compute with their own fp16 arithmetic.

    K-packed words, 4-bit, one column n:
        qweight[j, n] = | k=8j+7 | k=8j+6 | ... | k=8j+1 | k=8j |   (bit 31 ... bit 0)
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize",
    "pack_cols",
    "pack_rows",
    "quant_matmul",
    "unpack_cols",
    "unpack_rows",
]

SUPPORTED_BITS = (4, 8)


def _pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 32 // bits


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32 bits (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] integer codes in [0, 2**bits) -> [K // pack, N] int32, packed along K."""
    pack = _pack_factor(bits)
    k, n = codes.shape
    if k % pack:
        raise ValueError(f"rows ({k}) must be a multiple of {pack} to pack {bits}-bit codes")
    c = codes.to(torch.int64).view(k // pack, pack, n)
    shifts = torch.arange(pack, device=codes.device, dtype=torch.int64) * bits
    return _to_int32_words((c << shifts.view(1, pack, 1)).sum(dim=1))


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """[K // pack, N] int32 -> [K, N] int32 codes (inverse of :func:`pack_rows`)."""
    pack = _pack_factor(bits)
    rows, n = qweight.shape
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    codes = (qweight.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return codes.reshape(rows * pack, n)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, N] integer codes -> [R, N // pack] int32, packed along N (column n in field n % pack)."""
    return pack_rows(codes.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, N // pack] int32 -> [R, N] int32 codes (inverse of :func:`pack_cols`)."""
    return unpack_rows(packed.t(), bits).t().contiguous()


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense weight ``W`` [K, N] in the dtype of ``scales`` (see the module docstring).

    ``group_size`` <= 0 means one group spanning all K rows (per-channel scales).
    """
    codes = unpack_rows(qweight, bits)  # [K, N]
    k = codes.shape[0]
    if g_idx is None:
        size = group_size if group_size > 0 else k
        g_idx = torch.arange(k, device=codes.device) // size
    g = g_idx.long()
    w = (codes.float() - zeros.float()[g]) * scales.float()[g]
    return w.to(scales.dtype)


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x[:, perm] @ W + bias`` for ``x`` [M, K]; accumulated in fp32, returned in x's dtype."""
    w = dequantize(qweight, scales, zeros, bits, group_size, g_idx).to(x.dtype)
    if perm is not None:
        x = x[:, perm]
    y = x.float() @ w.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
