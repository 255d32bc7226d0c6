"""The ``"cuda"`` backend: the compiled csrc extension (``asyncgen._C``) for the KV-cache
write (alone and fused with rotary) and decode attention, Triton for the rest.

The extension is built in place by ``python3 setup.py build_ext --inplace`` (or
``pip install -e . --no-build-isolation``) on a machine with the CUDA toolkit and a CUDA
build of torch; its ops live under ``torch.ops.asyncgen_C``. This module imports without
it: :func:`is_available` says whether it loaded, :func:`ops` raises ``RuntimeError``
saying how to build it.

Routing (the launchers keep the reference signatures and raise ``ValueError`` naming
the argument on bad input):

- ``store_kv_cache``: csrc when key and cache share a 2- or 4-byte dtype and each cache
  block is contiguous; Triton otherwise.
- ``rotary_store_kv`` (what the attention layer calls): one csrc kernel for the rotary
  of q and k and the cache write when the cos/sin cache is fp32 and the caches' blocks
  are contiguous in q's dtype, at any token count when its 16-byte form takes the tensors
  (q, k, v as views of the packed qkv rows), else at up to
  :data:`ROTARY_STORE_FUSED_MAX_TOKENS` tokens; the Triton rotary and ``store_kv_cache``
  otherwise.
- ``dense_gemv`` / ``quant_gemv_4bit``: csrc matrix-vector products for up to
  :data:`GEMV_MAX_ROWS` rows (decode at small batch); the ``*_supported`` functions say
  whether a call's tensors fit the kernels (the linear layers fall back otherwise). The
  layers check their weight once (``*_weight_ok``), each input with
  :func:`gemv_input_ok`, and call the ``launch_*`` forms, which skip the Python checks.
  :func:`choose_dense_gemv` times the dense one against cuBLAS per weight shape.
  ``gated=True`` gives the SiLU-and-multiply of a gate|up product from the same kernel.
- Dense products above the GEMV's rows: ``F.linear`` (cuBLAS's pick), or at the row counts
  of the CUDA graphs where another cuBLASLt algorithm was faster, that one
  (:func:`choose_dense_algos`, ``asyncgen/_ops/cublaslt.py``).
- ``rotary_attention`` (what the attention layer calls): for decode-only batches of up to
  :data:`ROTARY_DECODE_FUSED_MAX_SEQS` sequences that the csrc decode kernel takes
  (below), with int64 positions and slots and at most 8 query heads per kv head, one csrc
  kernel rotates q and the new k as it reads them, stores
  the new k and v and attends; when the context is split, the last partition to finish
  combines the partitions (``split_counters``, the model's int32 buffer of zeros).
  Otherwise ``rotary_store_kv`` then ``paged_attention``.
- ``paged_attention``: csrc for decode-only batches (every query length 1) with fp16 or
  bf16, head_dim 64/128/256, block_size a multiple of 16 and int32 block tables and
  lengths; the csrc prompt-chunk kernel (tensor cores, sm_80+) for the other batches of
  more than :data:`CHUNK_ATTENTION_MIN_SEQS` sequences (a prompt chunk among decodes)
  with fp16 or bf16, head_dim 64/128, at most 8 query heads per kv head, a power-of-two
  block_size up to 32, no sliding window and int32 tables, lengths and starts; on sm_90
  with head_dim 128, its warpgroup variant for prompt steps of at most
  :data:`CHUNK_WGMMA_MAX_SEQS` sequences with query tiles enough to fill the GPU (a
  prompt from scratch); Triton for the rest (short chunks of few sequences such as a
  prefix-cache hit, other shapes).
  ``max_query_len`` / ``max_seq_len`` hints avoid a host sync; without them they are
  computed from the device tensors (a sync), so pass them on the hot path and under
  CUDA graphs. ``max_seq_len`` must bound ``seq_lens`` from above: it sizes the split-K
  partitions, and the launch configuration depends only on it and the shapes.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from . import Ops, compose_rotary_attention

__all__ = [
    "GEMV_MAX_ROWS", "GEMV_WARPS_PER_ROW", "choose_dense_gemv", "graph_time_ms", "dense_gemv",
    "dense_gemv_supported", "dense_gemv_weight_ok", "gemv_input_ok", "is_available", "launch_dense_gemv", "launch_quant_gemv_4bit", "ops", "quant_gemv_4bit",
    "QUANT_KERNELS", "QUANT_MMA_MAX_ROWS", "quant_gemv_4bit_max_rows", "quant_gemv_4bit_supported", "quant_gemv_4bit_weight_ok",
    "GemmScratch", "QUANT_GEMM_CONFIGS", "QUANT_GEMM_WS_CONFIGS", "has_wgmma", "launch_quant_gemm_4bit", "quant_gemm_4bit_weight_ok",
    "quant_gemm_config_indices", "quant_gemm_pieces", "stream_gemm_plan",
    "LT_MAX_ROWS", "choose_dense_algos",
]

BUILD_HINT = (
    "the csrc extension asyncgen._C is not built; on a machine with the CUDA toolkit (nvcc) "
    "and a CUDA build of torch run `python3 setup.py build_ext --inplace` in the repository "
    "root (or `pip install -e . --no-build-isolation`)"
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_DECODE_DTYPES = (torch.float16, torch.bfloat16)
_DECODE_HEAD_DIMS = (64, 128, 256)
_TILE = 16  # the decode kernel's token tile; block_size must be a multiple
_GQA_TRITON_FROM = 512  # num_seqs * num_kv_heads from which Triton's GQA decode is faster
_MAX_DECODE_SEQS = 65535


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    """(the extension module or None, why it is missing); tried once."""
    try:
        from .. import _C
    except (ImportError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"
    _register_fakes()
    return _C, ""


def _extension() -> ModuleType | None:
    return _load()[0]


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile can trace through the ops."""
    register = getattr(torch.library, "register_fake", None)
    if register is None:  # torch < 2.4
        return
    for name in ("store_kv_cache", "rotary_store_kv", "paged_attention_decode", "rotary_paged_attention_decode",
                 "chunk_attention", "dense_gemv", "quant_gemv_4bit", "quant_gemm_4bit"):
        try:
            register(f"asyncgen_C::{name}")(lambda *args, **kwargs: None)
        except RuntimeError:  # already registered
            pass


def is_available() -> bool:
    """Whether the extension imports and a CUDA device is present. Never raises."""
    try:
        return _extension() is not None and torch.cuda.is_available()
    except Exception:  # a broken CUDA setup counts as unavailable
        return False


def ops() -> Ops:
    """The op bundle: csrc attention and cache write, Triton norm/rotary/activation."""
    if _extension() is None:
        raise RuntimeError(f"{BUILD_HINT} ({_load()[1]})")
    if not torch.cuda.is_available():
        raise RuntimeError("the cuda ops backend needs a CUDA device, and torch sees none")
    from . import triton_backend

    t = triton_backend.ops()
    return Ops("cuda", t.rms_norm, t.rotary_embedding, t.silu_and_mul, store_kv_cache, paged_attention,
               rotary_store_kv, rotary_attention)


# ----------------------------------------------------------------------------------------
# Checks


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def _check_same_cuda_device(**tensors: torch.Tensor) -> None:
    first, device = None, None
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}; the cuda backend needs CUDA tensors")
        if device is None:
            first, device = name, t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors must share a device")


def _check_hint(name: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")


def _block_contiguous(cache: torch.Tensor) -> bool:
    """[num_blocks, block_size, num_kv_heads, head_dim] with each block contiguous."""
    _, _, num_kv_heads, head_dim = cache.shape
    return cache.stride(3) == 1 and cache.stride(2) == head_dim and cache.stride(1) == num_kv_heads * head_dim


@functools.lru_cache(maxsize=None)
def _tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` has the ``mma.sync`` tensor cores the csrc kernels use (sm_80+)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _caches_aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Both caches as the csrc attention kernels read them: each block contiguous, 16-byte
    aligned, with a block stride that is a multiple of 8 elements."""
    return all(_block_contiguous(c) and c.stride(0) % 8 == 0 and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache))


# ----------------------------------------------------------------------------------------
# Launchers


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key[t]`` / ``value[t]`` to flat slot ``slot_mapping[t]`` of the caches,
    skipping slots of -1; see the reference. Slots must be below
    ``num_blocks * block_size`` (not checked on the device)."""
    _check_tensor("key", key, 3, _FLOAT_DTYPES)
    _check_tensor("value", value, 3, (key.dtype,))
    _check_tensor("k_cache", k_cache, 4, _FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, 4, (k_cache.dtype,))
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
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
    _check_same_cuda_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if (
        key.dtype == k_cache.dtype
        and _block_contiguous(k_cache)
        and _block_contiguous(v_cache)
        and slot_mapping.is_contiguous()
        and _extension() is not None
    ):
        torch.ops.asyncgen_C.store_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    from . import triton_backend

    triton_backend.ops().store_kv_cache(key, value, k_cache, v_cache, slot_mapping)


# The fused rotary + cache-write kernel comes in two forms (csrc/cache_kernels.cuh), and its
# launcher picks one. The element-wise form moves single elements; on an H200 (7B shapes,
# docs/BENCHMARKS.md) it took 2.66 us a layer for one decode token against 3.60 for the
# Triton rotary plus the csrc cache write, but 6.3 us for a 78-token prompt chunk, where
# the rotary kernel alone took 2.9. So where only that form applies (unaligned q, k or v,
# see _rotary_store_vectorized) the fused kernel takes up to this many tokens and the two
# kernels the rest. The vectorized form moves 16-byte vectors, as the two kernels do, and
# takes every token count: on an H200 (tests/gpu/check_csrc_ops.py --rotary-store-only) it
# took 1.95 us a layer at one token, 2.75 at 78 and 4.42 at 256, against 3.62, 4.49 and
# 6.11 for the two kernels and 2.58, 4.65 and 10.39 for the element-wise form.
ROTARY_STORE_FUSED_MAX_TOKENS = 8


def _rotary_store_vectorized(q, k, v, cos_sin_cache, k_cache, v_cache) -> bool:
    """Whether the fused kernel's launcher takes its vectorized form, as
    ``rotary_store_vec_ok`` in csrc/cache_kernels.cuh decides: every base pointer 16-byte
    aligned, each half of head_dim and every q/k/v and cache block stride whole 16-byte
    vectors of q's dtype, cos/sin rows a multiple of 4 floats apart."""
    if not (q.dim() == k.dim() == v.dim() == 3 and cos_sin_cache.dim() == 2 and k_cache.dim() == v_cache.dim() == 4):
        return False
    vec = 16 // q.element_size()
    num_tokens, num_heads, head_dim = q.shape
    tasks = num_tokens * (num_heads + 2 * k.shape[1]) * (head_dim // (2 * vec))
    return (
        head_dim % (2 * vec) == 0
        and cos_sin_cache.stride(0) % 4 == 0
        and k_cache.stride(0) % vec == 0
        and v_cache.stride(0) % vec == 0
        and all(s % vec == 0 for t in (q, k, v) for s in t.stride()[:2])
        and all(t.data_ptr() % 16 == 0 for t in (q, k, v, cos_sin_cache, k_cache, v_cache))
        and tasks < 2**31 - 128  # the kernel counts its tasks, and its grid rounds them up a block, in an int
    )


def _rotary_store_fusable(positions, q, k, v, k_cache, v_cache, cos_sin_cache, slot_mapping) -> bool:
    """Whether the fused kernel takes the call (its shapes are checked after)."""
    return (
        all(isinstance(t, torch.Tensor) for t in (positions, q, k, v, k_cache, v_cache, cos_sin_cache, slot_mapping))
        and q.dim() == 3
        and k_cache.dim() == 4
        and v_cache.dim() == 4
        and cos_sin_cache.dtype == torch.float32
        and k_cache.dtype == q.dtype
        and _block_contiguous(k_cache)
        and _block_contiguous(v_cache)
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and (q.shape[0] <= ROTARY_STORE_FUSED_MAX_TOKENS
             or _rotary_store_vectorized(q, k, v, cos_sin_cache, k_cache, v_cache))
        and _extension() is not None
    )


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
    """Rotary embedding of ``q`` and ``k`` in place, then the cache write of the rotated
    ``k`` and of ``v`` (see the reference): one csrc kernel at any token count when its
    vectorized form takes the tensors, at up to :data:`ROTARY_STORE_FUSED_MAX_TOKENS`
    tokens otherwise; else the Triton rotary and :func:`store_kv_cache`, which check their own
    arguments; those also take what the fused kernel does not (a cos/sin cache other than
    fp32, caches whose blocks are not contiguous)."""
    if not _rotary_store_fusable(positions, q, k, v, k_cache, v_cache, cos_sin_cache, slot_mapping):
        from . import triton_backend

        triton_backend.ops().rotary_embedding(positions, q, k, cos_sin_cache)
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return
    _check_tensor("positions", positions, 1, _INDEX_DTYPES)
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k", k, 3, (q.dtype,))
    _check_tensor("v", v, 3, (q.dtype,))
    _check_tensor("cos_sin_cache", cos_sin_cache, 2, _FLOAT_DTYPES)
    _check_tensor("v_cache", v_cache, 4, (k_cache.dtype,))
    _check_tensor("slot_mapping", slot_mapping, 1, _INDEX_DTYPES)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q has odd head_dim {head_dim}; rotate-half needs an even head_dim")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must have shape [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, {k.shape[1]}, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"positions and slot_mapping must have shape ({num_tokens},), got {tuple(positions.shape)} and "
            f"{tuple(slot_mapping.shape)}"
        )
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache must have {head_dim} columns (cos | sin), got {tuple(cos_sin_cache.shape)}")
    _check_same_cuda_device(q=q, k=k, v=v, positions=positions, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
                            v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens:
        torch.ops.asyncgen_C.rotary_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


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
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached keys and values; see
    the reference. Returns ``out`` (allocated when not given) of q's shape and dtype.

    ``max_query_len`` (the largest query count of any sequence; 1 = decode-only) and
    ``max_seq_len`` (an upper bound on ``seq_lens``) pick the kernel and its launch
    configuration without reading the device; either one left out is computed with a
    host sync.
    """
    _check_tensor("q", q, 3, _FLOAT_DTYPES)
    _check_tensor("k_cache", k_cache, 4, (q.dtype,))
    _check_tensor("v_cache", v_cache, 4, (q.dtype,))
    _check_tensor("block_tables", block_tables, 2, _INDEX_DTYPES)
    _check_tensor("seq_lens", seq_lens, 1, _INDEX_DTYPES)
    _check_tensor("query_start_loc", query_start_loc, 1, _INDEX_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_head_dim} but q has {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"q's num_heads ({num_heads}) must be a multiple of k_cache's num_kv_heads ({num_kv_heads})")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have {num_seqs} rows (one per sequence), got {tuple(block_tables.shape)}")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got {tuple(query_start_loc.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale must be a float, got {scale!r}")
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    _check_hint("max_query_len", max_query_len, 0)
    _check_hint("max_seq_len", max_seq_len, 0)
    if out is not None:
        _check_tensor("out", out, 3, (q.dtype,))
        if tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
                   query_start_loc=query_start_loc)
    _check_same_cuda_device(**tensors, **({"out": out} if out is not None else {}))

    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    # One query per sequence exactly when there are as many tokens as sequences and none
    # has more than one (query lengths are >= 0 and sum to num_tokens).
    if max_query_len is None and num_tokens == num_seqs:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # host sync
    if max_query_len == 1 and num_tokens == num_seqs and _decode_supported(q, k_cache, v_cache, block_tables,
                                                                           seq_lens, out):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # host sync
        torch.ops.asyncgen_C.paged_attention_decode(
            out, q, k_cache, v_cache, block_tables, seq_lens, float(scale), max_seq_len, sliding_window or 0
        )
        return out

    # Prompt steps of few sequences with query tiles enough to fill the GPU (a prompt from
    # scratch, a few hundred tokens after a cached prefix) take the warpgroup prompt-chunk
    # kernel where the device has it; shorter chunks stay with Triton's split kernel.
    if (
        num_seqs <= CHUNK_WGMMA_MAX_SEQS and (max_query_len is None or max_query_len > 1)
        and sliding_window is None and head_dim == _CHUNK_WGMMA_HEAD_DIM
        and -(-num_tokens // (_CHUNK_WGMMA_ROWS // (num_heads // num_kv_heads))) * num_kv_heads
        >= CHUNK_WGMMA_MIN_BLOCKS
        and has_wgmma(q.device)
        and _chunk_supported(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    ):
        torch.ops.asyncgen_C.chunk_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                             None, float(scale), 1, 1)
        return out

    # Batches of many sequences (a prompt chunk among decodes, prompt graphs with a slot per
    # sequence) take the csrc prompt-chunk kernel. Decode-only batches the decode kernel
    # left (wide GQA batches) stay with Triton's decode kernel: a prompt-chunk block would
    # hold one token's rows.
    if (
        num_seqs > CHUNK_ATTENTION_MIN_SEQS and (max_query_len is None or max_query_len > 1)
        and sliding_window is None and _chunk_supported(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    ):
        torch.ops.asyncgen_C.chunk_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                             None, float(scale), 1)
        return out

    from . import triton_backend

    return triton_backend.ops().paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, out,
        max_query_len=max_query_len, max_seq_len=max_seq_len,
    )


# The prompt-chunk kernel (csrc/chunk_attention.cuh): 64 query rows a block, 4 warps,
# tiles of 32 keys.
_CHUNK_KEYS = 32  # the cache's block_size must divide it
_CHUNK_HEAD_DIMS = (64, 128)
_CHUNK_MAX_GROUP = 8
# Batches of more sequences than this take it. On an H200 (7B, fp16, us per call in CUDA
# graphs, tests/gpu/check_csrc_ops.py --chunk-only; docs/BENCHMARKS.md) a 512-token chunk
# among 63 decodes took 211.8 against Triton's 384.6, while Triton was faster for few
# sequences: 27.6 against 64.8 for a 78-token chunk over 992 cached tokens (8 slots), 83.0
# against 103.7 for 1,070 tokens from scratch, 74.1 against 89.2 for 4 prompts of 512.
CHUNK_ATTENTION_MIN_SEQS = 8


# The warpgroup prompt-chunk kernel (csrc/chunk_attention_wgmma.cuh, sm_90): head_dim 128,
# 128 query rows (token, head pairs) a block. It takes prompt steps of up to
# CHUNK_WGMMA_MAX_SEQS sequences whose query blocks, counted as if one sequence held every
# token (a graph's launch is fixed before its lengths are known), times the kv heads are
# at least CHUNK_WGMMA_MIN_BLOCKS. On an H200 (7B, fp16, us per call in CUDA graphs,
# tests/gpu/check_csrc_ops.py --chunk-only; docs/BENCHMARKS.md) it took 67.2 against
# Triton's 79.9 for 1,070 tokens from scratch, 40.7 against 52.4 for 300 tokens over 992
# cached (96 blocks), and 32.3 against 25.8 for 78 over 992 (32 blocks: Triton splits the
# context, and the kernel's splits did not make it faster).
_CHUNK_WGMMA_HEAD_DIM = 128
_CHUNK_WGMMA_ROWS = 128
CHUNK_WGMMA_MAX_SEQS = 8
CHUNK_WGMMA_MIN_BLOCKS = 64


def _chunk_supported(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out) -> bool:
    """Whether the csrc prompt-chunk kernel takes these (else Triton): fp16/bf16 on sm_80+,
    head_dim 64/128, at most 8 query heads per kv head, a power-of-two block_size up to
    32, int32 tables, lengths and starts, 16-byte aligned rows. The caller has checked the
    shapes against each other."""
    head_dim = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    return (
        _extension() is not None
        and q.dtype in _DECODE_DTYPES
        and head_dim in _CHUNK_HEAD_DIMS
        and group <= _CHUNK_MAX_GROUP
        and k_cache.shape[1] & (k_cache.shape[1] - 1) == 0 and k_cache.shape[1] <= _CHUNK_KEYS
        and _tensor_cores(q.device)
        and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
        and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
        and query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous()
        and q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0
        and out.stride(2) == 1 and out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0 and out.data_ptr() % 4 == 0
        and _caches_aligned(k_cache, v_cache)
    )


# The fused decode kernel rotates and stores a kv head's new token in the one block that
# reads it, which holds at most this many query heads.
_ROTARY_DECODE_MAX_GROUP = 8
# Up to this many sequences rotary_attention takes the fused decode kernel. On an H200 (7B,
# us per layer call, tests/gpu/check_csrc_ops.py; docs/BENCHMARKS.md) it took 11.3 against
# 15.0 for one sequence at 384 tokens and 27.8 against 32.9 for four at 1,024, tied at
# eight (90.7 against 90.8), and at 64 sequences it was no faster (153.9 against 149.5 and
# 154.6 in two runs): there every block's cache write and barrier come before its reads,
# and a batch that fills the GPU has nothing to gain from the fewer launches.
ROTARY_DECODE_FUSED_MAX_SEQS = 8


def _rotary_decode_fusable(positions, q, k, v, cos_sin_cache, slot_mapping, split_counters) -> bool:
    """Whether rotary_paged_attention_decode takes what the decode kernel already takes."""
    num_seqs, num_heads, head_dim = q.shape
    return (
        isinstance(positions, torch.Tensor) and isinstance(slot_mapping, torch.Tensor)
        and isinstance(cos_sin_cache, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        and k.dim() == 3 and tuple(k.shape) == tuple(v.shape) and k.shape[0] == num_seqs and k.shape[2] == head_dim
        and num_heads % k.shape[1] == 0 and num_heads // k.shape[1] <= _ROTARY_DECODE_MAX_GROUP
        and k.dtype == q.dtype and v.dtype == q.dtype and k.stride(2) == 1 and v.stride(2) == 1
        and positions.dtype == torch.int64 and positions.dim() == 1 and positions.shape[0] == num_seqs
        and positions.is_contiguous()
        and slot_mapping.dtype == torch.int64 and slot_mapping.dim() == 1 and slot_mapping.shape[0] == num_seqs
        and slot_mapping.is_contiguous()
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
        and cos_sin_cache.stride(1) == 1
        and (split_counters is None or (split_counters.dtype == torch.int32 and split_counters.dim() == 1
                                        and split_counters.is_contiguous()))
    )


# What rotary_attention runs where the fused decode kernel does not take the call.
_rotary_store_then_attention = compose_rotary_attention(rotary_store_kv, paged_attention)


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
) -> torch.Tensor:
    """:func:`rotary_store_kv` then :func:`paged_attention` (see the reference). A
    decode-only step (``max_query_len=1``) of at most :data:`ROTARY_DECODE_FUSED_MAX_SEQS`
    sequences that the csrc decode kernel takes, with int64
    positions and slots, an fp32 cos/sin cache and at most 8 query heads per kv head, runs
    as one kernel: it rotates q and the new k as it reads them, stores the new k and v,
    then attends (``split_counters``: that kernel's split-K combine, else a second
    kernel). q and k are left as they came. Everything else runs the two ops, which check
    their own arguments."""
    if (
        max_query_len == 1
        and isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] <= ROTARY_DECODE_FUSED_MAX_SEQS
        and isinstance(seq_lens, torch.Tensor) and q.shape[0] == seq_lens.shape[0]
        and isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4
        and isinstance(v_cache, torch.Tensor) and tuple(v_cache.shape) == tuple(k_cache.shape)
        and isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2
        and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
        and k_cache.shape[3] == q.shape[2] and q.shape[1] % max(k_cache.shape[2], 1) == 0
        and _rotary_decode_fusable(positions, q, k, v, cos_sin_cache, slot_mapping, split_counters)
        and k.shape[1] == k_cache.shape[2]
        and (sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
                                        and sliding_window >= 1))
        and _decode_supported(q, k_cache, v_cache, block_tables, seq_lens, q)
    ):
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"scale must be a float, got {scale!r}")
        _check_hint("max_seq_len", max_seq_len, 0)
        tensors = dict(q=q, k=k, v=v, positions=positions, cos_sin_cache=cos_sin_cache, k_cache=k_cache,
                       v_cache=v_cache, slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens)
        _check_same_cuda_device(**tensors, **({"split_counters": split_counters} if split_counters is not None else {}))
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())  # host sync
        torch.ops.asyncgen_C.rotary_paged_attention_decode(
            out, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
            split_counters, float(scale), max_seq_len, sliding_window or 0,
        )
        return out
    return _rotary_store_then_attention(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
        scale, sliding_window, max_query_len=max_query_len, max_seq_len=max_seq_len,
    )


def _decode_supported(q, k_cache, v_cache, block_tables, seq_lens, out) -> bool:
    """Whether the csrc decode kernel takes these and is the faster choice (else Triton).

    Measured on an H200 (docs/BENCHMARKS.md): csrc wins by 5-7x for one or few
    sequences and ties Triton for large multi-head batches, but Triton's GQA tiles win
    (1.5-1.8x) once grouped-query batches fill the GPU (num_seqs * num_kv_heads >= 512).
    """
    head_dim = q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if q.shape[1] != num_kv_heads and q.shape[0] * num_kv_heads >= _GQA_TRITON_FROM:
        return False
    return (
        _extension() is not None
        and q.dtype in _DECODE_DTYPES
        and head_dim in _DECODE_HEAD_DIMS
        and k_cache.shape[1] % _TILE == 0
        and q.shape[0] <= _MAX_DECODE_SEQS
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1
        and seq_lens.dtype == torch.int32
        and seq_lens.is_contiguous()
        and _caches_aligned(k_cache, v_cache)
        and out.stride(2) == 1
    )


# ----------------------------------------------------------------------------------------
# GEMV (csrc/gemv.cuh)

GEMV_MAX_ROWS = 8  # the most rows of x the csrc GEMV kernels take
GEMV_WARPS_PER_ROW = (1, 2, 4, 8)  # warps the dense GEMV may give each output feature
QUANT_MMA_MAX_ROWS = 64  # the most rows of x the csrc 4-bit kernel takes on tensor cores
# The default shared-memory limit (bytes) within which the 4-bit kernels' staged data must
# fit: the tensor-core kernel's scales and zeros (128 bytes per group), the one-row
# kernel's x and weight ring.
_SMEM_LIMIT = 48 * 1024


def _groups_aligned8(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Scales and zeros as the csrc 4-bit kernels load them: 4 columns (8 bytes) at a time."""
    return all(t.data_ptr() % 8 == 0 and t.stride(0) % 4 == 0 for t in (scales, zeros))


def _aligned_rows(t: torch.Tensor) -> bool:
    """2-D, contiguous rows starting 16-byte aligned, each row 16-byte aligned."""
    return t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def gemv_input_ok(x: torch.Tensor, dtype: torch.dtype, k: int, max_rows: int = GEMV_MAX_ROWS) -> bool:
    """Whether ``x`` is an input the csrc GEMVs take: [1..max_rows, k] of ``dtype`` on
    CUDA with 16-byte aligned rows. The per-call half of the ``*_supported`` checks; the
    layers check their weights once."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 1 <= x.shape[0] <= max_rows
        and x.shape[1] == k
        and x.dtype == dtype
        and _aligned_rows(x)
    )


def dense_gemv_weight_ok(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`dense_gemv` takes this weight (and bias), for any input it takes."""
    return (
        _extension() is not None
        and weight.is_cuda
        and weight.dtype in _DECODE_DTYPES
        and weight.dim() == 2
        and weight.shape[1] % 8 == 0
        and _aligned_rows(weight)
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
    )


def dense_gemv_supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`dense_gemv` takes these (else use ``F.linear``)."""
    return (
        dense_gemv_weight_ok(weight, bias)
        and gemv_input_ok(x, weight.dtype, weight.shape[1])
        and x.device == weight.device
    )


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
    *, warps_per_row: int = 1, gated: bool = False,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 1 to :data:`GEMV_MAX_ROWS` rows of ``x`` [M, K]
    (``weight`` [N, K]); fp32 accumulation. ``warps_per_row`` (one of
    :data:`GEMV_WARPS_PER_ROW`): how many warps share each output feature's row.
    ``gated``: ``weight`` is gate | up (2 D rows) and the result [M, D] is
    ``silu(gate) * up``, each rounded as ``silu_and_mul`` of the product rounds them (at
    most 4 warps a row). Raises ``ValueError`` where :func:`dense_gemv_supported` is false
    or ``warps_per_row`` is not one of those."""
    if warps_per_row not in GEMV_WARPS_PER_ROW or (gated and warps_per_row > 4):
        raise ValueError(f"warps_per_row must be one of {GEMV_WARPS_PER_ROW} (at most 4 gated), got {warps_per_row!r}")
    if gated and weight.dim() == 2 and weight.shape[0] % 2 != 0:
        raise ValueError(f"gated needs an even number of weight rows (gate | up), got {weight.shape[0]}")
    if not dense_gemv_supported(x, weight, bias):
        raise ValueError(
            f"dense_gemv takes 1-{GEMV_MAX_ROWS} rows of fp16/bf16 x [M, K] with K % 8 == 0 and weight [N, K] of "
            f"x's dtype, both 16-byte aligned rows on one CUDA device; got x {tuple(x.shape)} {x.dtype}, "
            f"weight {tuple(weight.shape)} {weight.dtype}"
        )
    return launch_dense_gemv(x, weight, bias, out, warps_per_row=warps_per_row, gated=gated)


def launch_dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
    *, warps_per_row: int = 1, gated: bool = False,
) -> torch.Tensor:
    """:func:`dense_gemv` without the Python checks, for callers that checked the weight
    once (:func:`dense_gemv_weight_ok`) and each input (:func:`gemv_input_ok`). The op
    still validates its arguments in C++."""
    if out is None:
        n = weight.shape[0] // 2 if gated else weight.shape[0]
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    torch.ops.asyncgen_C.dense_gemv(out, x, weight, bias, warps_per_row, gated)
    return out


def quant_gemv_4bit_weight_ok(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`quant_gemv_4bit` takes this packed weight: 4 bits, fp16 scales and
    zeros, groups of consecutive rows (no ``g_idx``), N % 4 == 0, aligned rows."""
    k = qweight.shape[0] * 8 if qweight.dim() == 2 else -1
    size = group_size if group_size > 0 else k
    return (
        _extension() is not None
        and bits == 4
        and g_idx is None
        and qweight.is_cuda
        and qweight.dtype == torch.int32
        and scales.dtype == torch.float16
        and zeros.dtype == torch.float16
        and size % 8 == 0
        and qweight.shape[1] % 4 == 0
        and _aligned_rows(qweight)
        and scales.stride(1) == 1
        and zeros.stride(1) == 1
        and (bias is None or (bias.dtype == torch.float16 and bias.is_contiguous()))
    )


def quant_gemv_4bit_max_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> int:
    """How many rows of ``x`` :func:`quant_gemv_4bit` takes with this packed weight: 0 where
    :func:`quant_gemv_4bit_weight_ok` is false; :data:`QUANT_MMA_MAX_ROWS` where its
    tensor-core kernel applies (an sm_80+ GPU, K and the group size multiples of 32,
    8-byte aligned scales and zeros, at most 384 groups); else :data:`GEMV_MAX_ROWS`."""
    if not quant_gemv_4bit_weight_ok(qweight, scales, zeros, bits, group_size, g_idx, bias):
        return 0
    k = qweight.shape[0] * 8
    size = group_size if group_size > 0 else k
    mma = (
        _tensor_cores(qweight.device)
        and k % 32 == 0
        and size % 32 == 0
        and k % size == 0
        and (k // size) * 128 <= _SMEM_LIMIT
        and _groups_aligned8(scales, zeros)
    )
    return QUANT_MMA_MAX_ROWS if mma else GEMV_MAX_ROWS


def quant_gemv_4bit_supported(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`quant_gemv_4bit` takes these: a weight it takes, and fp16 ``x`` (and
    ``out``) fitting :func:`gemv_input_ok` with :func:`quant_gemv_4bit_max_rows` rows;
    else the Triton kernels run."""
    rows = quant_gemv_4bit_max_rows(qweight, scales, zeros, bits, group_size, g_idx, bias)
    return (
        rows > 0
        and gemv_input_ok(x, torch.float16, qweight.shape[0] * 8, rows)
        and (out is None or (out.dtype == torch.float16 and out.stride(1) == 1))
    )


def quant_gemv_4bit(
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
    """``x[:, perm] @ W + bias`` for 1 to :func:`quant_gemv_4bit_max_rows` rows of fp16
    ``x``, with the arguments of :func:`asyncgen._ops.triton_quant_gemm.quant_gemm`.
    Raises ``ValueError`` where :func:`quant_gemv_4bit_supported` is false."""
    if not quant_gemv_4bit_supported(x, qweight, scales, zeros, bits, group_size, g_idx, bias, out):
        rows = quant_gemv_4bit_max_rows(qweight, scales, zeros, bits, group_size, g_idx, bias)
        raise ValueError(
            f"quant_gemv_4bit takes 4-bit codes without g_idx, fp16 x/scales/zeros, 1-{max(rows, GEMV_MAX_ROWS)} "
            f"rows ({QUANT_MMA_MAX_ROWS} on tensor cores with K and the group size multiples of 32), "
            f"N % 4 == 0 and 16-byte aligned rows; got bits={bits}, g_idx={'set' if g_idx is not None else None}, "
            f"x {tuple(x.shape)} {x.dtype}, qweight {tuple(qweight.shape)}, scales {scales.dtype}"
        )
    return launch_quant_gemv_4bit(x, qweight, scales, zeros, group_size, perm, bias, out=out)


QUANT_KERNELS = {"either": 0, "cuda_cores": 1, "tensor_cores": 2}  # the op's ``kernel`` argument


def _quant_io(x: torch.Tensor, qweight: torch.Tensor, perm: torch.Tensor | None,
              out: torch.Tensor | None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit launchers' x (its columns gathered by ``perm`` where given) and output
    (a new [M, N] tensor of x's dtype where none is given; [M, N / 2] ``gated``)."""
    if perm is not None:
        x = x.index_select(1, perm)
    if out is None:
        n = qweight.shape[1] // 2 if gated else qweight.shape[1]
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return x, out


def launch_quant_gemv_4bit(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    kernel: int = 0,
    gated: bool = False,
) -> torch.Tensor:
    """:func:`quant_gemv_4bit` without the Python checks, for callers that checked the
    weight once (:func:`quant_gemv_4bit_max_rows`) and each input (:func:`gemv_input_ok`).
    Gathers ``x[:, perm]`` first when given. ``kernel`` (a value of
    :data:`QUANT_KERNELS`) picks the CUDA-core or the tensor-core kernel; 0 takes tensor
    cores where they apply. ``gated`` (one row, a weight :func:`quant_gemv1_gated_ok`
    takes): the weight's columns are gate | up and the result [1, N / 2] is
    ``silu(gate) * up``, from the one-row kernel. The op still validates its arguments in
    C++."""
    x, out = _quant_io(x, qweight, perm, out, gated)
    k = qweight.shape[0] * 8
    torch.ops.asyncgen_C.quant_gemv_4bit(
        out, x, qweight, scales, zeros, group_size if group_size > 0 else k, bias, kernel, gated
    )
    return out


def quant_gemv1_gated_ok(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> bool:
    """Whether the one-row 4-bit kernel takes this gate | up weight in its gated form (a
    weight :func:`quant_gemv_4bit_weight_ok` takes): N a multiple of 8, K and the group
    size multiples of 16, 8-byte aligned scales and zeros, K within its shared memory."""
    k = qweight.shape[0] * 8
    size = group_size if group_size > 0 else k
    # Its smallest gated block: 256 threads, 2 pairs of packed rows deep, then x (gemv.cuh).
    smem = 2 * 2 * 256 * 16 + 16 * (k // 8 + k // 64 + 1)
    return (
        qweight.shape[1] % 8 == 0 and k % 16 == 0 and size % 16 == 0 and k % size == 0 and smem <= _SMEM_LIMIT
        and _groups_aligned8(scales, zeros)
    )


# The launch shapes of kernel 2, the warpgroup kernel with producer warps (csrc/quant_ws.cuh;
# w is then its consumer warps, and the block has 4 more). The engine times them beside the
# others unless ASYNCGEN_QUANT_WS=0 (below).
QUANT_GEMM_WS_CONFIGS = tuple(
    (warps, splits, 2) for warps in (4, 8) for splits in (1, 2, 3, 4, 6, 8)
) + ((8, -1, 2), (4, -2, 2))
# The tiled 4-bit GEMM's launch shapes, (warps a block, K splits, kernel), that the engine
# times per weight shape and row count (QuantLinearMethod.choose_kernels): a block of w warps
# owns 32 w columns, with s splits s blocks share each column range's K. Kernel 0 is the
# mma.sync one (csrc/quant_gemm.cuh); where the device has it (:func:`has_wgmma`), 1 is
# the warpgroup kernel (csrc/quant_wgmma.cuh) and 2 the one with producer warps. Splits -b
# (the warpgroup kernels only) launch b blocks an SM that share the product's column blocks
# x stages evenly (a balanced launch, :func:`stream_gemm_plan`).
QUANT_GEMM_CONFIGS = tuple(
    (warps, splits, kernel) for kernel in (0, 1) for warps in (4, 8) for splits in (1, 2, 3, 4, 6, 8, 12, 16)
) + ((8, -1, 1), (4, -2, 1)) + (QUANT_GEMM_WS_CONFIGS if os.environ.get("ASYNCGEN_QUANT_WS") != "0" else ())
_GEMM_STAGE_K = 64  # K rows per stage of the tiled GEMM; K and the group size are multiples of it


class GemmScratch:
    """The split tiled GEMM's fp32 workspace and its counters (int32, left at zero by each
    launch) on one device, for launches that never run at once: one per model, whose
    steps run on one stream (two engines' models in one process each need their own). A
    buffer that has to grow is replaced and the old one kept alive, since CUDA graphs
    captured with it still use it."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.workspace: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []

    def buffers(self, floats: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(workspace of at least ``floats`` fp32, counters of at least ``blocks`` zeros)."""
        if self.workspace is None or self.workspace.numel() < floats:
            if self.workspace is not None:
                self._retired.append(self.workspace)
                floats = max(floats, 2 * self.workspace.numel())
            self.workspace = torch.empty(floats, dtype=torch.float32, device=self.device)
        if self.counters is None or self.counters.numel() < blocks:
            if self.counters is not None:
                self._retired.append(self.counters)
            self.counters = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=self.device)
        return self.workspace, self.counters


_default_scratch: dict[torch.device, GemmScratch] = {}  # for callers that pass none


def has_wgmma(device: torch.device | str) -> bool:
    """Whether ``device`` runs the warpgroup 4-bit GEMM: an sm_90 GPU and an extension built
    with sm_90a code (``setup.py``'s default)."""
    ext = _extension()
    return bool(ext is not None and getattr(ext, "has_wgmma", False)
                and torch.cuda.get_device_capability(device) == (9, 0))


def quant_gemm_config_indices(device: torch.device | str) -> list[int]:
    """The indices into :data:`QUANT_GEMM_CONFIGS` of the launch shapes ``device`` runs."""
    wgmma = has_wgmma(device)
    return [i for i, (_, _, uses_wgmma) in enumerate(QUANT_GEMM_CONFIGS) if wgmma or not uses_wgmma]


# Units a balanced launch adds after each column block for its store (kStreamStoreUnits).
_STREAM_STORE_UNITS = 4


@functools.lru_cache(maxsize=None)
def stream_gemm_plan(n: int, k: int, warps: int, blocks_wanted: int) -> tuple[int, int]:
    """A balanced launch's (blocks, most blocks sharing one column block) for an N x K
    product, as ``plan_stream_gemm`` (csrc/quant_gemm.cuh) computes it: the column blocks'
    stages (of 64 K rows), column block by column block, dealt to G = min(units,
    blocks_wanted) blocks in runs even over a line with :data:`_STREAM_STORE_UNITS` more
    units after each column block (none where a block's share of the line would not exceed
    them), so that a run that also stores the column block it finishes is shorter."""
    col_blocks, stages = -(-n // (32 * warps)), k // _GEMM_STAGE_K
    units = col_blocks * stages
    blocks = min(units, blocks_wanted)
    if blocks <= 0:
        return 0, 0
    extra = _STREAM_STORE_UNITS if col_blocks * (stages + _STREAM_STORE_UNITS) // blocks > _STREAM_STORE_UNITS else 0
    period = stages + extra
    line = col_blocks * period

    def block_of(u: int) -> int:
        v = u // stages * period + u % stages
        return ((v + 1) * blocks - 1) // line

    most = max(block_of(cb * stages + stages - 1) - block_of(cb * stages) + 1 for cb in range(col_blocks))
    return blocks, most


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def quant_gemm_pieces(n: int, k: int, warps: int, splits: int, device: torch.device | str) -> int:
    """How many blocks at most share one column block's K in a launch of the tiled GEMM
    with ``warps`` and ``splits`` (:data:`QUANT_GEMM_CONFIGS`) on ``device``: the fp32
    partials its workspace holds per output element (1: none)."""
    if splits > 0:
        return splits
    return stream_gemm_plan(n, k, warps, -splits * _multiprocessor_count(torch.device(device)))[1]


def quant_gemm_4bit_weight_ok(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                              group_size: int) -> bool:
    """Whether the tiled 4-bit GEMM (:func:`launch_quant_gemm_4bit`) takes a weight that
    :func:`quant_gemv_4bit_weight_ok` takes: an sm_80+ GPU, K and the group size multiples
    of 64, N % 8 == 0, and 16-byte aligned rows of scales and zeros."""
    k = qweight.shape[0] * 8
    size = group_size if group_size > 0 else k
    return (
        _tensor_cores(qweight.device)
        and k % _GEMM_STAGE_K == 0
        and size % _GEMM_STAGE_K == 0
        and k % size == 0
        and qweight.shape[1] % 8 == 0
        and all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (scales, zeros))
    )


def launch_quant_gemm_4bit(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    warps: int = 4,
    splits: int = 1,
    wgmma: int = 0,
    scratch: GemmScratch | None = None,
) -> torch.Tensor:
    """``x[:, perm] @ W + bias`` by the tiled tensor-core GEMM (``csrc/quant_gemm.cuh``, or with
    ``wgmma`` 1 its warpgroup version, ``csrc/quant_wgmma.cuh``, and with 2 that version with
    producer warps, ``csrc/quant_ws.cuh``, where :func:`has_wgmma`) for
    1 to :data:`QUANT_MMA_MAX_ROWS` rows, for callers that checked the weight
    (:func:`quant_gemm_4bit_weight_ok`) and the input (:func:`gemv_input_ok`). ``warps``,
    ``splits`` and ``wgmma`` are one of :data:`QUANT_GEMM_CONFIGS`; with ``splits`` > 1 (or a balanced
    launch whose blocks share a column block) the partials go to
    ``scratch`` (default: one per device, for launches that never run at once, see
    :class:`GemmScratch`). The op still validates its arguments in C++."""
    x, out = _quant_io(x, qweight, perm, out)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    workspace = counters = None
    pieces = quant_gemm_pieces(n, k, warps, splits, x.device)
    if pieces > 1:
        if scratch is None:
            scratch = _default_scratch.get(x.device) or _default_scratch.setdefault(x.device, GemmScratch(x.device))
        workspace, counters = scratch.buffers(pieces * x.shape[0] * n, -(-n // (32 * warps)))
    torch.ops.asyncgen_C.quant_gemm_4bit(
        out, x, qweight, scales, zeros, group_size if group_size > 0 else k, bias, workspace, counters, warps, splits,
        int(wgmma),
    )
    return out


def graph_time_ms(fn, items, passes: int = 3) -> float:
    """Per-item device time of ``fn(item)`` over ``items``, captured once as a CUDA graph
    and replayed (best of ``passes``), so that launch costs on the host do not hide the
    kernels' own time."""
    for item in items[:2]:
        fn(item)  # compiles and tunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            fn(item)
    graph.replay()
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / len(items))
    return best


@torch.inference_mode()
def choose_dense_gemv(layers, rows=(1, 2, 4, 8)) -> dict[tuple, tuple[int, int]]:
    """For each distinct weight shape among ``layers`` (modules with a ``weight`` [N, K]
    and ``gemv_rows`` / ``gemv_warps_per_row`` attributes), times :func:`dense_gemv`
    against ``F.linear`` at each row count in ``rows`` and sets ``gemv_rows`` to the
    largest count up to which the csrc kernel won every time (0: never). At the first
    count the kernel is timed with each of :data:`GEMV_WARPS_PER_ROW` warps a row, and
    the fastest is the layer's ``gemv_warps_per_row`` (timed against ``F.linear`` from
    then on). Each timing replays one CUDA graph through all the layers of that shape in
    turn, so the weights come from memory as in a forward pass rather than from L2, and
    the host's launch costs do not hide a 10 us kernel's own time (timed eagerly, the
    choice between 2, 4 and 8 warps for o_proj changed from run to run on an H200). Run
    before CUDA graphs are captured; the result only changes which kernel computes, not
    what.
    Returns {(N, K, dtype): (gemv_rows, gemv_warps_per_row)}.
    """
    by_shape: dict[tuple, list] = {}
    for layer in layers:
        w = layer.weight
        by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(layer)
    chosen: dict[tuple, tuple[int, int]] = {}
    for key, group in by_shape.items():
        best, split = 0, 1
        for i, m in enumerate(sorted(rows)):
            x = torch.randn(m, key[1], dtype=key[2], device=group[0].weight.device)
            if not all(dense_gemv_supported(x, g.weight, g.bias) for g in group):
                break
            if i == 0:
                times = {w: graph_time_ms(lambda g, w=w: dense_gemv(x, g.weight, g.bias, warps_per_row=w), group)
                         for w in GEMV_WARPS_PER_ROW}
                split = min(times, key=times.get)
                ours = times[split]
            else:
                ours = graph_time_ms(lambda g: dense_gemv(x, g.weight, g.bias, warps_per_row=split), group)
            theirs = graph_time_ms(lambda g: torch.nn.functional.linear(x, g.weight, g.bias), group)
            if ours >= theirs:
                break
            best = m
        chosen[key] = (best, split)
        for layer in group:
            layer.gemv_rows = best
            layer.gemv_warps_per_row = split
    return chosen


# Row counts up to which choose_dense_algos times cuBLASLt's algorithms (beyond them, the
# products are compute-bound and cuBLAS's own pick was as fast on the H200:
# docs/BENCHMARKS.md), the workspace the candidates may use, and the gain an algorithm
# must show over F.linear to be taken (graph timings repeat to about 1 %).
LT_MAX_ROWS = 256
LT_WORKSPACE_BYTES = 8 << 20
LT_MIN_GAIN = 0.03


@torch.inference_mode()
def choose_dense_algos(layers, rows, workspace: torch.Tensor) -> dict[tuple, dict[int, int]]:
    """For each distinct weight shape among ``layers`` (dense linear layers on a CUDA
    device) and each row count in ``rows`` up to :data:`LT_MAX_ROWS` above the layer's
    ``gemv_rows``, times every cuBLASLt algorithm for the product (each first checked
    against ``F.linear`` on random input) against ``F.linear`` itself, through one CUDA
    graph over all the layers of that shape, and routes the row count to the fastest
    algorithm where it wins by :data:`LT_MIN_GAIN` (``layer.lt_routes[rows]``, an
    :class:`asyncgen._ops.cublaslt.LtRoute` using ``workspace``). Run before CUDA graphs
    are captured; only which kernels compute changes, not what (up to rounding).
    Returns {(N, K, dtype, has_bias): {rows: the algorithm's rank in cuBLASLt's order}}.
    """
    from . import cublaslt

    if not layers or not cublaslt.available():
        return {}
    by_shape: dict[tuple, list] = {}
    for layer in layers:
        w = layer.weight
        by_shape.setdefault((w.shape[0], w.shape[1], w.dtype, layer.bias is not None), []).append(layer)
    device = layers[0].weight.device
    chosen: dict[tuple, dict[int, int]] = {}
    for key, group in by_shape.items():
        n, k, dtype, has_bias = key
        picks = chosen[key] = {}
        gen = torch.Generator(device=device).manual_seed(n * 31 + k)
        for m in sorted({m for m in rows if group[0].gemv_rows < m <= LT_MAX_ROWS}):
            x = torch.randn(m, k, generator=gen, device=device, dtype=torch.float32).to(dtype)
            plan = cublaslt.LtMatmul(m, n, k, dtype, has_bias, device.index or 0)
            first = group[0]
            ref = torch.nn.functional.linear(x, first.weight, first.bias).float()
            out = torch.empty(m, n, dtype=dtype, device=device)
            if not all(plan.accepts(out, x, g.weight, g.bias) for g in group):
                continue
            theirs = graph_time_ms(lambda g: torch.nn.functional.linear(x, g.weight, g.bias), group)
            best = None
            for algo in plan.algos(workspace_bytes=workspace.numel()):
                route = cublaslt.LtRoute(plan, algo, workspace)
                try:
                    got = route(x, first.weight, first.bias).float()
                except RuntimeError:  # the library declined this algorithm for these pointers
                    continue
                if not (got - ref).norm() <= 1e-2 * ref.norm():
                    continue
                ours = graph_time_ms(lambda g, r=route: r(x, g.weight, g.bias), group)
                if best is None or ours < best[0]:
                    best = (ours, route)
            if best is not None and best[0] < (1 - LT_MIN_GAIN) * theirs:
                picks[m] = best[1].algo.rank
                for layer in group:
                    layer.lt_routes[m] = best[1]
    return chosen
