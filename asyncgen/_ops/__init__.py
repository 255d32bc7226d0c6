"""Kernels behind typed launchers, grouped into interchangeable backends.

A backend is an :class:`Ops` bundle with the same seven functions, each defined by its
plain-torch reference in :mod:`asyncgen._ops.reference` (``rotary_store_kv`` is rotary
then the cache write, and ``rotary_attention`` those then attention, which a backend may
fuse):

- ``"torch"``: the references themselves (bf16 prompts' attention in bf16 on the CPU, see
  ``reference.paged_attention``); runs anywhere (the CPU path).
- ``"triton"``: Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1`` for tests).
- ``"cuda"``: the compiled csrc extension for attention, the cache write and the fused
  rotary + cache write (+ decode attention), Triton for the rest; only where the
  extension was built.

The model receives one ``Ops`` at construction; nothing here is global state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

__all__ = ["Ops", "get_ops"]

BACKENDS = ("torch", "triton", "cuda")


@dataclasses.dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    store_kv_cache: Callable
    paged_attention: Callable
    rotary_store_kv: Callable
    rotary_attention: Callable


def get_ops(backend: str) -> Ops:
    """The op bundle of ``backend`` (one of :data:`BACKENDS`); imports it lazily."""
    if backend == "torch":
        from . import reference as r

        # exact=False: bf16 prompts' attention in bf16 on the CPU (see r.paged_attention).
        return Ops("torch", r.rms_norm, r.rotary_embedding, r.silu_and_mul, r.store_kv_cache,
                   functools.partial(r.paged_attention, exact=False), r.rotary_store_kv,
                   functools.partial(r.rotary_attention, exact=False))
    if backend == "triton":
        from . import triton_backend

        return triton_backend.ops()
    if backend == "cuda":
        from . import cuda_backend

        return cuda_backend.ops()
    raise ValueError(f"unknown ops backend {backend!r}; expected one of {BACKENDS}")


def compose_rotary_attention(rotary_store_kv: Callable, paged_attention: Callable) -> Callable:
    """``rotary_attention`` (see the reference) as a backend's ``rotary_store_kv`` followed
    by its ``paged_attention``."""

    def rotary_attention(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                         query_start_loc, scale, sliding_window=None, *, max_query_len=None, max_seq_len=None,
                         split_counters=None):
        rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                               max_query_len=max_query_len, max_seq_len=max_seq_len)

    return rotary_attention


def cuda_backend_available() -> bool:
    """Whether the compiled csrc extension imports and a CUDA device is present."""
    try:
        from . import cuda_backend
    except ImportError:
        return False
    return cuda_backend.is_available()
