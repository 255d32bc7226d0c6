"""NeoX-style (rotate-half) rotary embedding applied in place to q and k, one program per
token.

Layout: ``q`` ``[T, num_heads, head_dim]`` and ``k`` ``[T, num_kv_heads, head_dim]``,
head_dim contiguous, tokens and heads addressed by stride (so q and k may be views into
a fused qkv projection); ``positions`` ``[T]``; ``cos_sin_cache`` ``[max_position,
head_dim]`` with ``cos`` in columns ``[0, head_dim/2)`` and ``sin`` in the rest. Pair ``i``
of a head is ``(x[i], x[i + head_dim/2])``::

    x[i]          <- x[i] * cos[i] - x[i + d/2] * sin[i]
    x[i + d/2]    <- x[i + d/2] * cos[i] + x[i] * sin[i]

A program loads its token's cos/sin row once and rotates all of its q and k heads, a tile
of heads at a time. Each element is read before it is written by the same program, so
the update in place is safe.

Napkin math, 7B (32 heads, head_dim 128, bf16), per token:
    q: read 8 KiB + write 8 KiB; k: 2 + 2 KiB (8 kv heads) or 8 + 8 KiB (32 kv heads);
    cos/sin: 512 B (fp32) -> ~20.5 KiB (GQA 8) or ~32.5 KiB (MHA) per token.
    FLOPs: 6 per pair -> ~15 KFLOP per token: memory-bound. 256 tokens: ~5-8 MiB, ~2 us
    at 4.3 TB/s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, next_power_of_2

__all__ = ["rotary_embedding"]

# Elements of one [heads, head_dim / 2] tile a program rotates at a time.
_TILE_ELEMENTS = 2048


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head
    stride_h,
    num_heads,
    cos,  # [1, BLOCK_HALF] fp32
    sin,
    offs_half,  # [BLOCK_HALF]
    half_mask,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < num_heads)[:, None] & half_mask[None, :]
        ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_half[None, :]
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T]
    q_ptr,  # [T, num_heads, head_dim]
    k_ptr,  # [T, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_position, head_dim]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    cache_row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(cache_row + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + HALF + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HK)


def _heads_per_tile(num_heads: int, block_half: int) -> int:
    return max(1, min(next_power_of_2(num_heads), _TILE_ELEMENTS // block_half))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotates ``q`` and ``k`` in place by the angles of ``positions``; see the reference.

    ``positions``: ``[T]`` int64/int32, each in ``[0, max_position)`` (not checked on the
    device); ``q``: ``[T, num_heads, head_dim]``; ``k``: ``[T, num_kv_heads, head_dim]``
    of q's dtype; ``cos_sin_cache``: ``[max_position, head_dim]`` (fp32 normally).
    """
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2 != 0:
        raise ValueError(f"q has odd head_dim {head_dim}; rotate-half needs an even head_dim")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must have shape [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions must have shape ({num_tokens},), got {tuple(positions.shape)}")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must have {head_dim} columns (cos | sin), got {tuple(cos_sin_cache.shape)}")
    check_devices(_rotary_kernel, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_heads, k.shape[1],
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HQ=_heads_per_tile(num_heads, block_half),
        BLOCK_HK=_heads_per_tile(k.shape[1], block_half),
        num_warps=4,
    )
