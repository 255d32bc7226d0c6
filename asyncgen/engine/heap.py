"""Keeping the cyclic garbage collector off the heap that lives as long as the engine.

CPython's collector stops every thread for a pass over all tracked objects each time it
collects its oldest generation. Once an engine has started, that heap is large (torch,
transformers, the tokenizer, the model's modules, the host's own objects) and nearly all
of it lives until the process ends, yet every such pass walks all of it. On the H200 host
with a 7B model loaded, two passes of 270-310 ms each fell into a 6 s offline run, and no
step could be launched meanwhile (docs/BENCHMARKS.md, "the engine's pauses").

``gc.freeze()`` moves every object alive at that moment into a permanent generation that
the collector skips; objects made later (requests, chunks, per-step lists) are collected
as before. The freeze is process-wide, so engines share it through a count: each start
collects once and freezes what is alive (the first engine's heap, then each later one's
model too), and the last engine to close unfreezes, so that cycles among objects that were
alive at a start and have died since become collectable again.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze", "release"]

_lock = threading.Lock()
_holders = 0


def freeze() -> None:
    """Collects, then freezes every object alive; pair each call with :func:`release`."""
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1


def release() -> None:
    """Undoes one :func:`freeze`; the last one unfreezes the heap."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("heap.release() without a matching freeze()")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()
