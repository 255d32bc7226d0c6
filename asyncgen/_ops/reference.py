"""Plain-torch reference implementations of every op the model calls.

These are the definitions: each Triton kernel and each csrc kernel is tested against the
function of the same name here, and the CPU backend runs them directly. They favour
clarity over speed, except where the CPU engine spends most of its time: attention, where
``exact=False`` (the CPU engine's choice) takes torch's fused attention for bf16 prompts
and for the decode queries of a step with a few sequences.

Shapes, for a step that computes ``T`` tokens of ``B`` sequences::

    q                [T, num_heads, head_dim]
    key, value       [T, num_kv_heads, head_dim]
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     [B, max_blocks_per_seq]  int32, entries past a sequence's end unused
    seq_lens         [B]                      int32, tokens in the cache after this step
    query_start_loc  [B + 1]                  int32, cumsum of query lengths, starts at 0
    slot_mapping     [T]                      int64, block_id * block_size + offset; -1 = skip

Query token ``i`` of sequence ``b`` sits at position ``seq_lens[b] - q_len_b + i`` and
attends causally to cache positions ``0 ..= that position`` (and only to the last
``sliding_window`` of them when a window is set).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "paged_attention",
    "rms_norm",
    "rotary_attention",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (when given), then RMS-normalise it in fp32.

    Returns ``(normed, residual)`` where ``residual`` is the sum the next layer adds to,
    or ``x`` itself when no residual was given. Matches HF ``LlamaRMSNorm``: the norm is
    computed in fp32, cast back to the input dtype, then scaled by ``weight``.
    """
    if residual is not None:
        x = x + residual
    residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Applies NeoX-style (rotate-half) rotary embedding to ``q`` and ``k`` in place.

    ``q``: [T, num_heads, head_dim], ``k``: [T, num_kv_heads, head_dim],
    ``positions``: [T] int64, ``cos_sin_cache``: [max_position, head_dim] fp32 holding
    ``cos`` in its first half and ``sin`` in its second half (one value per rotated pair).
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, head_dim // 2] each
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2 * d``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes token ``t``'s key and value to flat slot ``slot_mapping[t]`` of the caches.

    Slots of -1 are skipped (padding tokens of a captured CUDA graph).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(v_cache.dtype)


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`rotary_embedding` of ``q`` and ``k`` in place, then :func:`store_kv_cache` of
    the rotated ``k`` and of ``v``: the attention layer's two steps before attention, which
    a backend may do in one kernel."""
    rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def _rotary_store_kv_fp32(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
    """:func:`rotary_store_kv` in fewer torch ops, for the CPU engine's fp32 steps, where
    each op's own cost is most of a decode step's rotary: the same products, sums and
    roundings (so the same bits), q and k rotated as one tensor where k follows q in one
    buffer (the qkv projection's output), the cache rows written with ``index_copy_``."""
    if not (q.dtype == k.dtype == k_cache.dtype == cos_sin_cache.dtype == torch.float32
            and q.stride(-1) == k.stride(-1) == 1 and bool((slot_mapping >= 0).all())):
        return rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    cos, sin = cos_sin_cache.index_select(0, positions).view(num_tokens, 1, 2, head_dim // 2).unbind(2)
    row = q.stride(0)
    if (k.stride(0) == row and q.stride(1) == k.stride(1) == head_dim
            and k.data_ptr() == q.data_ptr() + num_heads * head_dim * q.element_size()):
        parts = (q.as_strided((num_tokens, num_heads + k.shape[1], head_dim), (row, head_dim, 1)),)
    else:
        parts = (q, k)
    for x in parts:
        x1, x2 = x.unflatten(-1, (2, head_dim // 2)).unbind(-2)
        first = x1 * cos - x2 * sin
        x2.mul_(cos).add_(x1 * sin)
        x1.copy_(first)
    num_kv_heads = k_cache.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


# The most decode queries the CPU engine's attention (exact=False) takes one by one.
_DECODE_ONE_BY_ONE = 4


def _window_kv(cache: torch.Tensor, block_table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Cached positions ``first .. end - 1`` of one sequence: [end - first, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    b0 = first // block_size
    blocks = cache.index_select(0, block_table[b0:(end + block_size - 1) // block_size])
    return blocks.flatten(0, 1)[first - b0 * block_size:end - b0 * block_size]


def _causal_mask(
    q_positions: torch.Tensor, k_len: int, sliding_window: int | None
) -> torch.Tensor:
    """[q_len, k_len] bool, True where attention is allowed."""
    k_positions = torch.arange(k_len, device=q_positions.device)
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return allowed


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    exact: bool = True,
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys and values.

    The current step's keys and values must already be in the cache
    (``store_kv_cache`` first). Computed in fp32; returns ``out`` (allocated when not
    given) of q's shape and dtype. ``max_query_len`` / ``max_seq_len`` are launch hints
    for the GPU kernels (the maxima over the batch); the reference ignores them.
    ``exact=False`` (the CPU engine's choice) lets bf16 prompts on the CPU run torch's
    fused attention in bf16, as transformers does: 2-2.5x faster at 1,000 tokens there,
    its products still summed in fp32; and, in a step of at most four decode queries, runs
    them one sequence at a time through that fused attention (in fp32), reading only the
    positions each may see. The kernels' tests keep the fp32 oracle.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = [i for i, n in enumerate(q_lens) if n > 1]
    native_prompt = not exact and q.dtype == torch.bfloat16 and q.device.type == "cpu" and k_cache.dtype == q.dtype

    if decode and not exact and len(decode) <= _DECODE_ONE_BY_ONE:
        # One query a sequence, each against exactly the cached positions it may see
        # (its window's), through torch's fused CPU attention: faster on the CPU than the
        # batched products below for a few sequences, slower for many (docs/BENCHMARKS.md).
        for i in decode:
            row, n = starts[i], lens[i]
            first = 0 if sliding_window is None else max(0, n - sliding_window)
            keys = _window_kv(k_cache, block_tables[i], first, n).float().transpose(0, 1)[None]
            values = _window_kv(v_cache, block_tables[i], first, n).float().transpose(0, 1)[None]
            res = F.scaled_dot_product_attention(q[row:row + 1].float().transpose(0, 1)[None], keys, values,
                                                 scale=scale, enable_gqa=group > 1)
            out[row] = res[0, :, 0].to(out.dtype)

    elif decode:
        # All single-token queries at once, a query head group's queries as rows against
        # their kv head's keys: [kv head, sequence, position, d] for the batched products.
        idx = torch.tensor(decode, device=q.device)
        lens_d = seq_lens[idx].long()  # [nd]
        block_size = k_cache.shape[1]
        max_len = int(lens_d.max())
        num_blocks = (max_len + block_size - 1) // block_size
        tables = block_tables[idx, :num_blocks].long()  # [nd, num_blocks]
        # Entries past a sequence's last block are unused and may hold anything: point
        # them at block 0 (its slots are masked below).
        used = torch.arange(num_blocks, device=q.device)[None, :] * block_size < lens_d[:, None]
        tables = tables.masked_fill(~used, 0).flatten()
        nd = len(decode)
        keys = k_cache.index_select(0, tables).view(nd, -1, num_kv_heads, head_dim)[:, :max_len]
        values = v_cache.index_select(0, tables).view(nd, -1, num_kv_heads, head_dim)[:, :max_len]
        pos = torch.arange(max_len, device=q.device)
        valid = pos[None, :] < lens_d[:, None]  # [nd, max_len]
        if sliding_window is not None:
            valid &= pos[None, :] > lens_d[:, None] - 1 - sliding_window
        # Slots outside a sequence's window may hold anything, even NaN: their scores
        # become -inf below, and their values are zeroed (only those slots are written;
        # the gathers are copies), so that a probability of 0 times NaN adds nothing.
        bad_seq, bad_pos = (~valid).nonzero(as_tuple=True)
        values[bad_seq, bad_pos] = 0
        keys = keys.permute(2, 0, 1, 3).float().contiguous()  # [kvh, nd, max_len, d]
        values = values.permute(2, 0, 1, 3).float().contiguous()
        rows = query_start_loc[idx].long()
        qd = q[rows].float().view(nd, num_kv_heads, group, head_dim).transpose(0, 1)  # [kvh, nd, g, d]
        scores = torch.matmul(qd, keys.transpose(-1, -2)) * scale  # [kvh, nd, g, max_len]
        scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
        res = torch.matmul(scores.softmax(dim=-1), values)  # [kvh, nd, g, d]
        out[rows] = res.transpose(0, 1).reshape(nd, num_heads, head_dim).to(out.dtype)

    for i in prefill:
        start, end, n = starts[i], starts[i + 1], lens[i]
        # [1, heads, tokens, head_dim]: with a batch dimension torch's CPU attention takes
        # its fused kernel, 3-5x faster than for 3-D inputs at a 1,000-token prompt.
        dtype = q.dtype if native_prompt else torch.float32
        qs = q[start:end].to(dtype).transpose(0, 1)[None]
        keys = _window_kv(k_cache, block_tables[i], 0, n).to(dtype).transpose(0, 1)[None]
        values = _window_kv(v_cache, block_tables[i], 0, n).to(dtype).transpose(0, 1)[None]
        mask = None  # the whole sequence: plain causal; else queries after cached context
        if end - start < n or sliding_window is not None:  # (causal from the bottom right) or a window
            mask = _causal_mask(torch.arange(n - (end - start), n, device=q.device), n, sliding_window)
        res = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=group > 1)
        out[start:end] = res[0].transpose(0, 1).to(out.dtype)
    return out


def rotary_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    split_counters: torch.Tensor | None = None,
    exact: bool = True,
) -> torch.Tensor:
    """The attention layer's whole step between the qkv projection and o_proj:
    :func:`rotary_store_kv`, then :func:`paged_attention` (returned, with ``exact``). ``q``
    and ``k`` may be left rotated or not (a fused kernel only reads them). ``exact=False``
    does the first step in fewer torch ops where it can (the same bits).
    ``split_counters``: an int32 buffer of zeros a GPU kernel may use for its split-K
    combine and leaves at zero (one per launch that can run concurrently); the reference
    ignores it, as it does the hints."""
    (rotary_store_kv if exact else _rotary_store_kv_fp32)(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                                          slot_mapping)
    return paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
        max_query_len=max_query_len, max_seq_len=max_seq_len, exact=exact,
    )
