"""Prefetching the next linear layer's weight into L2 while the kernels before it run.

At small batches a decode step reads every weight once and does little else with it, so
its time is the weight bytes over memory bandwidth plus whatever leaves memory idle: the
short kernels between the products (norms, rotary, the cache write, attention over a
short context) and the gaps between launches. :class:`WeightPrefetch` fills those
stretches. Where a product ends, the model asks for the next product's weight; the
request runs on a side stream, so the kernels in between start at once, and by the time
the product runs its first bytes (or, for a weight that fits, all of it) are in L2::

    main   qkv ─┬─ rotary ─ cache write ─ attention ─ o_proj ─┬─ norm ─ gate_up ...
    side        └─ prefetch o_proj ─────────────────┘          └─ prefetch gate_up ...

A prefetch writes nothing: outputs are the same with it or without it, bit for bit. It
pays only where memory would otherwise idle; at large batches the kernels between the
products are memory-bound themselves, and the model runner uses it only for the decode
steps where it measured faster (``ModelRunner``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

__all__ = ["PREFETCH_TARGETS", "WeightPrefetch"]

# The linear layers a forward pass can prefetch, by the last part of their name.
PREFETCH_TARGETS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


class WeightPrefetch:
    """Issues L2 prefetches of linear layers' weights on ``stream``.

    ``op(tensor, max_bytes)`` is the backend's ``prefetch_l2``. Each :meth:`ahead` asks for
    up to ``max_bytes`` of one layer's weight tensors (the same share of each, from its
    start) after everything already enqueued on the current stream; :meth:`join` makes the
    current stream wait for the prefetches, and must come before a CUDA graph capture
    ends. Without a ``stream`` (the CPU tests) the requests run in line.
    """

    def __init__(
        self,
        op: Callable[[torch.Tensor, int], None],
        max_bytes: int,
        stream: Optional["torch.cuda.Stream"] = None,
        targets: Iterable[str] = PREFETCH_TARGETS,
    ):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        unknown = set(targets) - PREFETCH_TARGETS
        if unknown:
            raise ValueError(f"unknown prefetch targets {sorted(unknown)}; expected some of {sorted(PREFETCH_TARGETS)}")
        self.op, self.max_bytes, self.stream = op, max_bytes, stream
        self.targets = frozenset(targets)
        self._forked = False

    def ahead(self, layer) -> None:
        """Prefetches the start of ``layer``'s weight (a ``LinearBase``) if it is a target."""
        if layer.prefix.rsplit(".", 1)[-1] not in self.targets or self.max_bytes == 0:
            return
        tensors = layer.method.weight_tensors(layer)
        total = sum(t.numel() * t.element_size() for t in tensors)
        if total == 0:
            return
        share = min(1.0, self.max_bytes / total)
        if self.stream is None:
            for t in tensors:
                self.op(t, int(t.numel() * t.element_size() * share))
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for t in tensors:
                self.op(t, int(t.numel() * t.element_size() * share))
        self._forked = True

    def join(self) -> None:
        """The current stream waits for every prefetch issued so far."""
        if self._forked:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._forked = False
