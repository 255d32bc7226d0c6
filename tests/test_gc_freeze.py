"""freeze_gc: a started engine keeps the cyclic collector off the heap alive at its start,
shares the process-wide freeze with other engines, and gives it up when the last one
closes; what is made afterwards is still collected."""

from __future__ import annotations

import gc

import pytest

from asyncgen import AsyncEngine, SamplingParams
from asyncgen.engine import heap

pytestmark = pytest.mark.anyio


def _walked_by_a_full_pass() -> int:
    """Objects the collector walks when it collects its oldest generation."""
    return sum(len(gc.get_objects(generation)) for generation in range(3))


def _engine(path, **kwargs):
    return AsyncEngine.from_pretrained(path, max_model_len=128, num_kv_blocks=64, **kwargs)


async def test_a_running_engine_takes_its_start_heap_out_of_full_passes(tiny_llama):
    assert gc.get_freeze_count() == 0, "an earlier test left the heap frozen"
    before = _walked_by_a_full_pass()
    async with _engine(tiny_llama) as engine:
        frozen = gc.get_freeze_count()
        assert frozen > before // 2  # the heap that existed at start, and the model
        assert _walked_by_a_full_pass() < before // 10
        out = await engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 4
        assert gc.get_freeze_count() <= frozen  # serving freezes nothing more (frozen objects may die)
    assert gc.get_freeze_count() == 0


async def test_objects_made_while_frozen_are_still_collected(tiny_llama):
    async with _engine(tiny_llama):
        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        ref_count_before = len(gc.get_objects())
        del a, b
        assert gc.collect() >= 2
        assert len(gc.get_objects()) < ref_count_before


async def test_the_last_engine_to_close_unfreezes(tiny_llama):
    first = _engine(tiny_llama)
    second = _engine(tiny_llama)
    await first.start()
    await second.start()
    try:
        assert gc.get_freeze_count() > 0
        await first.aclose()
        assert gc.get_freeze_count() > 0  # the second engine still runs
        await first.aclose()  # closing twice releases once
        assert gc.get_freeze_count() > 0
    finally:
        await second.aclose()
    assert gc.get_freeze_count() == 0


async def test_freeze_gc_false_leaves_the_collector_alone(tiny_llama):
    async with _engine(tiny_llama, freeze_gc=False):
        assert gc.get_freeze_count() == 0


def test_an_unmatched_release_is_an_error():
    with pytest.raises(RuntimeError, match="without a matching freeze"):
        heap.release()
