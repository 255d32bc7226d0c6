"""Random inputs for the paged-attention decode and KV-write kernels, built to catch
indexing and masking mistakes: shuffled non-contiguous block ids, ragged lengths with
partial last blocks, NaN in every cache slot no sequence owns, block-table padding that
points at an all-NaN block, a strided q and a strided block table.
"""

from __future__ import annotations

import dataclasses

import torch


def _shuffled_tables(lens: list[int], block_size: int, g: torch.Generator) -> tuple[torch.Tensor, int, int]:
    """Block tables for sequences of ``lens`` tokens over shuffled block ids, 4 blocks to
    spare: ``(tables [num_seqs, width + 3] int32, num_blocks, width)``. Entries past a
    sequence's blocks point at one block nobody owns (the cases fill it with NaN), and the
    view the kernels get, ``tables[:, :width]``, is strided."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = torch.randperm(num_blocks, generator=g)
    width = max(blocks_per_seq + [1]) + 2
    tables = torch.full((len(lens), width + 3), int(perm[-1]), dtype=torch.int32)
    i = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[i : i + n]
        i += n
    return tables, num_blocks, width


@dataclasses.dataclass
class DecodeCase:
    q: torch.Tensor             # [num_seqs, num_heads, head_dim], a strided view
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_cache_ref: torch.Tensor   # the same, with finite values before the window
    v_cache_ref: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, width] int32, a strided view
    seq_lens: torch.Tensor      # [num_seqs] int32
    query_start_loc: torch.Tensor
    scale: float
    sliding_window: int | None

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())


def make_decode_case(
    *,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    max_len: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    empty_seq: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> DecodeCase:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g)
    lens[0] = max_len
    if num_seqs > 2:
        lens[1] = min(max_len, 2 * block_size)  # exactly full last block
    if empty_seq:
        lens[-1] = 0  # a padding entry of a captured batch
    tables, num_blocks, width = _shuffled_tables([int(n) for n in lens], block_size, g)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    in_window = torch.zeros_like(owned)
    for b in range(num_seqs):
        n = int(lens[b])
        start = max(0, n - sliding_window) if sliding_window else 0
        for pos in range(n):
            slot = int(tables[b, pos // block_size]) * block_size + pos % block_size
            owned[slot] = True
            in_window[slot] |= pos >= start
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    # The kernel must not read positions before the window either.
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[owned & ~in_window] = float("nan")

    qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    to = dict(device=device)
    return DecodeCase(
        q=qkv.to(**to)[:, :num_heads],
        k_cache=k_cache.to(**to),
        v_cache=v_cache.to(**to),
        k_cache_ref=k_ref.to(**to),
        v_cache_ref=v_ref.to(**to),
        block_tables=tables.to(**to)[:, :width],
        seq_lens=lens.to(torch.int32).to(**to),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
    )


@dataclasses.dataclass
class RotaryDecodeCase:
    """A decode step whose new token's k and v are not in the cache yet (its slot holds
    NaN), for the fused rotary + cache write + attention; the ``*_ref`` tensors are what
    the separate reference ops give."""

    case: DecodeCase            # its caches hold NaN in the new slots
    k: torch.Tensor             # [num_seqs, num_kv_heads, head_dim] before rotary, strided views
    v: torch.Tensor
    positions: torch.Tensor     # [num_seqs] int64: seq_len - 1
    cos_sin: torch.Tensor       # [max_position, head_dim] fp32
    slot_mapping: torch.Tensor  # [num_seqs] int64; -1 for an empty sequence
    q_ref: torch.Tensor         # q after rotary
    k_cache_ref: torch.Tensor   # the caches after the reference cache write
    v_cache_ref: torch.Tensor


def make_rotary_decode_case(case: DecodeCase, seed: int = 0) -> RotaryDecodeCase:
    """Turns ``case`` into a step that still has to rotate q and k and store the new
    token (the one at ``seq_len - 1`` of every sequence)."""
    from asyncgen._ops import reference

    g = torch.Generator().manual_seed(seed + 101)
    num_seqs, num_heads, head_dim = case.q.shape
    _, block_size, num_kv_heads, _ = case.k_cache.shape
    device, dtype = case.q.device, case.q.dtype
    lens = case.seq_lens.long().cpu()
    positions = (lens - 1).clamp_min(0)
    tables = case.block_tables.long().cpu()
    slots = torch.tensor(
        [int(tables[b, int(positions[b]) // block_size]) * block_size + int(positions[b]) % block_size
         if lens[b] > 0 else -1 for b in range(num_seqs)],
        dtype=torch.int64,
    )
    kv = torch.randn(num_seqs, 3 * num_kv_heads, head_dim, generator=g).to(dtype)
    max_pos = int(positions.max()) + 7
    angles = torch.rand(max_pos, head_dim // 2, generator=g) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    for cache in (case.k_cache, case.v_cache):  # the kernel must write before it reads
        flat = cache.view(-1, num_kv_heads, head_dim)
        flat[slots[slots >= 0].to(device)] = float("nan")
    k, v = kv[:, num_kv_heads : 2 * num_kv_heads].to(device), kv[:, 2 * num_kv_heads :].to(device)
    q_ref, k_rot = case.q.clone(), k.clone()
    reference.rotary_embedding(positions.to(device), q_ref, k_rot, cos_sin.to(device))
    kc_ref, vc_ref = case.k_cache_ref.clone(), case.v_cache_ref.clone()
    reference.store_kv_cache(k_rot, v, kc_ref, vc_ref, slots.to(device))
    return RotaryDecodeCase(case, k, v, positions.to(device), cos_sin.to(device), slots.to(device), q_ref,
                            kc_ref, vc_ref)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in fp32; inf when out has NaN."""
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


@dataclasses.dataclass
class StoreCase:
    key: torch.Tensor           # [num_tokens, num_kv_heads, head_dim], a strided view
    value: torch.Tensor
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens], some -1


def make_store_case(
    *,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    num_blocks: int = 9,
    dtype: torch.dtype,
    slot_dtype: torch.dtype = torch.int64,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> StoreCase:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return StoreCase(
        key=qkv.to(device)[:, num_kv_heads : 2 * num_kv_heads],
        value=qkv.to(device)[:, 2 * num_kv_heads : 3 * num_kv_heads],
        k_cache=torch.randn(shape, generator=g).to(dtype).to(device),
        v_cache=torch.randn(shape, generator=g).to(dtype).to(device),
        slot_mapping=slots.to(slot_dtype).to(device),
    )



@dataclasses.dataclass
class RotaryStoreCase:
    """Inputs of rotary_store_kv (rotary of q and k in place, then the cache write of k and
    v) and, in ``*_ref``, what the two reference ops leave in q, k and the caches. The
    caches are views of buffers with one spare block on either side, so a write outside
    them (a padding token's) shows in the buffers."""

    q: torch.Tensor             # [num_tokens, num_heads, head_dim], a view (see layout)
    k: torch.Tensor             # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    positions: torch.Tensor     # [num_tokens] int32 or int64
    cos_sin: torch.Tensor       # [max_position, head_dim] fp32: cos | sin
    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]: k_buffer[1:-1]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int32 or int64; -1 for padding tokens
    k_buffer: torch.Tensor      # [num_blocks + 2, block_size, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    q_ref: torch.Tensor
    k_ref: torch.Tensor
    k_buffer_ref: torch.Tensor
    v_buffer_ref: torch.Tensor


# How q, k and v lie in memory:
#   packed          views of one [num_tokens, (num_heads + 2 num_kv_heads) * head_dim] qkv,
#                   as the model passes them (16-byte aligned when head_dim is)
#   offset          the same rows, starting one element past a 16-byte boundary
#   odd_stride      [num_tokens, heads, head_dim + 1] rows cut to head_dim (odd head stride)
#   cos_sin_stride  packed, but cos_sin a view with rows head_dim + 2 floats apart
ROTARY_LAYOUTS = ("packed", "offset", "odd_stride", "cos_sin_stride")


def make_rotary_store_case(
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str = "packed",
    slot_dtype: torch.dtype = torch.int64,
    pos_dtype: torch.dtype = torch.int64,
    block_size: int = 16,
    max_position: int = 300,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> RotaryStoreCase:
    """Random q, k, v, positions and cos/sin in ``layout`` (above); the same ``seed`` gives
    the same values in every layout. About a quarter of the tokens, and token 2 when there
    is one, are padding (slot -1): rotated, not stored. The tensors are laid out on
    ``device`` itself, so the layout holds there."""
    from asyncgen._ops import reference

    assert layout in ROTARY_LAYOUTS, layout
    g = torch.Generator().manual_seed(seed)
    heads = num_heads + 2 * num_kv_heads
    values = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    if layout == "odd_stride":
        rows = torch.zeros(num_tokens, heads, head_dim + 1, dtype=dtype, device=device)
        qkv = rows[..., :head_dim]
    else:
        flat = torch.zeros(num_tokens * heads * head_dim + 1, dtype=dtype, device=device)
        qkv = (flat[1:] if layout == "offset" else flat[:-1]).view(num_tokens, heads, head_dim)
    qkv.copy_(values)
    # As the model splits its packed [num_tokens, heads * head_dim] rows.
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    angles = torch.rand(max_position, head_dim // 2, generator=g) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    if layout == "cos_sin_stride":
        cos_sin = torch.cat((cos_sin, torch.zeros(max_position, 2)), dim=-1).to(device)[:, :head_dim]
    else:
        cos_sin = cos_sin.to(device)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1
    if num_tokens > 2:
        slots[2] = -1
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buffer = torch.randn(shape, generator=g).to(dtype).to(device)
    v_buffer = torch.randn(shape, generator=g).to(dtype).to(device)
    positions, slots = positions.to(device), slots.to(device)

    q_ref, k_ref, kb_ref, vb_ref = q.clone(), k.clone(), k_buffer.clone(), v_buffer.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cos_sin)
    reference.store_kv_cache(k_ref, v.clone(), kb_ref[1:-1], vb_ref[1:-1], slots)
    return RotaryStoreCase(q, k, v, positions.to(pos_dtype), cos_sin, k_buffer[1:-1], v_buffer[1:-1],
                           slots.to(slot_dtype), k_buffer, v_buffer, q_ref, k_ref, kb_ref, vb_ref)

@dataclasses.dataclass
class ChunkCase:
    q: torch.Tensor                # [num_tokens, num_heads, head_dim], a strided view
    k_cache: torch.Tensor          # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unowned
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, width] int32, a strided view; padding -> an all-NaN block
    seq_lens: torch.Tensor         # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float


def make_chunk_case(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype,
    seed: int = 0,
) -> ChunkCase:
    """Prompt chunks: sequence i computes ``seqs[i][0]`` new tokens after ``seqs[i][1]``
    cached ones (both 0: an empty slot of a captured batch). Its new tokens' k and v are
    in the cache already, as the attention op expects."""
    g = torch.Generator().manual_seed(seed)
    lens = [q_len + cached for q_len, cached in seqs]
    tables, num_blocks, width = _shuffled_tables(lens, block_size, g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        for pos in range(n):
            owned[int(tables[b, pos // block_size]) * block_size + pos % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
    num_tokens = sum(q_len for q_len, _ in seqs)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    return ChunkCase(
        q=qkv[:, :num_heads],
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables[:, :width],
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=head_dim**-0.5,
    )
