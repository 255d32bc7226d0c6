"""The model runner's step inputs (``ModelRunner._prepare``), checked against values
written out by hand from the block-table arithmetic: every token's position and KV slot,
the attention metadata, the sampled rows and the placeholders to fill."""

from __future__ import annotations

import torch

from asyncgen.engine.request import PLACEHOLDER
from asyncgen.engine.scheduler import ScheduledSeq, SchedulerOutput


def _runner(block_size: int = 4):
    from asyncgen.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the inputs are under test: no model
    runner.block_size = block_size
    runner.device = torch.device("cpu")
    runner.states = {}
    runner._last_rows = {"b": 3, "c": 0}
    return runner


def _step(seqs) -> SchedulerOutput:
    return SchedulerOutput(seqs, [], [], sum(len(s.token_ids) for s in seqs), [])


def test_a_mixed_step_gets_each_tokens_position_slot_and_metadata():
    bs = 4
    seqs = [
        # a prompt chunk of 5 tokens over 6 cached ones, blocks out of order; samples
        ScheduledSeq("a", [11, 12, 13, 14, 15], 6, [9, 2, 7], True),
        ScheduledSeq("b", [PLACEHOLDER], 9, [5, 1, 8], True),  # a decode whose input is pending
        ScheduledSeq("c", [PLACEHOLDER], 4, [3, 6], True),
        ScheduledSeq("d", [21, 22, 23], 0, [4], False),  # the first chunk of a longer prompt
    ]
    inputs = _runner(bs)._prepare(_step(seqs))

    tokens = [(s, s.start_pos + j) for s in seqs for j in range(len(s.token_ids))]
    assert inputs.input_ids.tolist() == [t for s in seqs for t in s.token_ids]
    assert inputs.positions.tolist() == [p for _, p in tokens]
    assert inputs.meta.slot_mapping.tolist() == [s.block_ids[p // bs] * bs + p % bs for s, p in tokens]
    m = inputs.meta
    assert m.seq_lens.dtype == m.query_start_loc.dtype == m.block_tables.dtype == torch.int32
    assert m.seq_lens.tolist() == [11, 10, 5, 3]
    assert m.query_start_loc.tolist() == [0, 5, 6, 7, 10]
    assert m.block_tables.tolist() == [[9, 2, 7], [5, 1, 8], [3, 6, 0], [4, 0, 0]]
    assert (m.max_query_len, m.max_seq_len) == (5, 11)
    assert inputs.logits_idx.tolist() == [4, 5, 6]
    assert inputs.sampling_ids == ["a", "b", "c"]
    assert inputs.sample_ends == [11, 10, 5]
    assert not inputs.is_decode
    assert inputs.fill_dst.tolist() == [5, 6]  # the placeholders' rows ...
    assert inputs.fill_src.tolist() == [3, 0]  # ... take these rows of the last launch's samples
    assert inputs.plp is None


def test_a_decode_step_of_many_sequences():
    bs = 16
    seqs = [ScheduledSeq(f"s{i}", [100 + i], 10 + 2 * i, [i, 40 + i], True) for i in range(9)]
    inputs = _runner(bs)._prepare(_step(seqs))

    assert inputs.is_decode
    assert inputs.input_ids.tolist() == [100 + i for i in range(9)]
    assert inputs.positions.tolist() == [10 + 2 * i for i in range(9)]
    assert inputs.meta.slot_mapping.tolist() == [(i if 10 + 2 * i < bs else 40 + i) * bs + (10 + 2 * i) % bs for i in range(9)]
    assert inputs.meta.seq_lens.tolist() == [11 + 2 * i for i in range(9)]
    assert inputs.meta.query_start_loc.tolist() == list(range(10))
    assert inputs.meta.block_tables.tolist() == [[i, 40 + i] for i in range(9)]
    assert inputs.logits_idx.tolist() == list(range(9))
    assert inputs.fill_dst is None and inputs.fill_src is None
