"""Writes each token's key and value into its slot of the paged KV cache.

Layout: ``key``, ``value`` ``[T, num_kv_heads, head_dim]`` (head_dim contiguous, tokens and
heads by stride, so they may be views of a fused qkv projection); ``k_cache``, ``v_cache``
``[num_blocks, block_size, num_kv_heads, head_dim]`` (head_dim contiguous, the rest by
stride); ``slot_mapping`` ``[T]`` with ``slot = block_id * block_size + offset``::

    slot 37, block_size 16  ->  block 2, offset 5  ->  k_cache[2, 5, :, :] = key[t]

One program per token moves its ``[num_kv_heads, head_dim]`` tile of key and of value;
slots of -1 (padding tokens of a captured CUDA graph) are skipped. Cache offsets are
computed in int64 (a cache may exceed 2**31 elements).

Napkin math, 7B (head_dim 128, bf16), per token:
    8 kv heads:  read k, v 4 KiB + write 4 KiB = 8 KiB
    32 kv heads: read 16 KiB + write 16 KiB = 32 KiB
    no FLOPs. 256 decode tokens with 8 kv heads: 2 MiB, < 1 us at 4.3 TB/s (launch-bound);
    a 4096-token prefill chunk with 32 kv heads: 128 MiB, ~31 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_backend import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, next_power_of_2

__all__ = ["store_kv_cache"]


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T]
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]

    src = key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    k = tl.load(src, mask=mask)
    dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    dst = dst + offs_h[:, None] * stride_kc_head + offs_d[None, :]
    tl.store(dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    src = value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    v = tl.load(src, mask=mask)
    dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    dst = dst + offs_h[:, None] * stride_vc_head + offs_d[None, :]
    tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key[t]`` / ``value[t]`` to flat slot ``slot_mapping[t]`` of the caches,
    skipping slots of -1; see the reference. Slots must be below
    ``num_blocks * block_size`` (not checked on the device).
    """
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,))
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache must have shape [num_blocks, block_size, {num_kv_heads}, {head_dim}] to match key, "
            f"got {tuple(k_cache.shape)}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have shape ({num_tokens},), got {tuple(slot_mapping.shape)}")
    check_devices(_store_kv_cache_kernel, key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                  slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _store_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 4096 else 8,
    )
