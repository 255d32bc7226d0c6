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


def _one_sequence_cases():
    return [
        ScheduledSeq("a", [11, 12, 13, 14, 15], 6, [9, 2, 7], True),  # a chunk over a cached prefix, samples
        ScheduledSeq("a", [21, 22, 23], 0, [4], False),  # the first chunk of a longer prompt
        ScheduledSeq("a", list(range(30, 47)), 3, [8, 1, 6, 2, 5], True),  # spans four blocks, unaligned start
        ScheduledSeq("a", [77], 13, [3, 0, 5, 9], True),  # a decode
        ScheduledSeq("b", [PLACEHOLDER], 9, [5, 1, 8], True),  # a decode whose input is pending
        ScheduledSeq("p", [31, 32, 33, 34], 2, [6, 3], False, prompt_logprobs=True),  # a chunk reporting prompt logprobs
    ]


def test_a_step_of_one_sequence_gets_the_arrays_of_the_general_path():
    import numpy as np

    from types import SimpleNamespace

    for seq in _one_sequence_cases():
        runner = _runner(4)
        runner.states["p"] = SimpleNamespace(prompt_token_ids=[29, 30, 31, 32, 33, 34, 35, 36],
                                             params=SimpleNamespace(prompt_logprobs=2))
        one = runner._host_inputs(_step([seq]))
        many = runner._host_inputs_many([seq])
        for field in ("input_ids", "positions", "slot_mapping", "logits_idx", "fill_dst", "fill_src", "seq_lens",
                      "qsl", "tables"):
            a, b = getattr(one, field), getattr(many, field)
            assert a.dtype == b.dtype == np.int64, (seq, field)
            assert a.shape == b.shape and np.array_equal(a, b), (seq, field, a, b)
        for field in ("max_query_len", "sampling_ids", "sample_ends", "is_decode"):
            assert getattr(one, field) == getattr(many, field), (seq, field)
        assert (one.plp is None) == (many.plp is None) == (not seq.prompt_logprobs)
        if one.plp is not None:
            assert one.plp[0] == many.plp[0] == [("p", 3, 4, 2)]
            assert np.array_equal(one.plp[1], many.plp[1]) and np.array_equal(one.plp[2], many.plp[2])
            assert one.plp[2].tolist() == [32, 33, 34, 35]


def test_a_step_of_one_sequence_by_hand():
    seq = _one_sequence_cases()[2]  # 17 tokens at positions 3..19 in blocks [8, 1, 6, 2, 5] of 4
    inputs = _runner(4)._prepare(_step([seq]))
    assert inputs.input_ids.tolist() == list(range(30, 47))
    assert inputs.positions.tolist() == list(range(3, 20))
    assert inputs.meta.slot_mapping.tolist() == [35] + [4, 5, 6, 7] + [24, 25, 26, 27] + [8, 9, 10, 11] + [20, 21, 22, 23]
    assert inputs.meta.seq_lens.tolist() == [20]
    assert inputs.meta.query_start_loc.tolist() == [0, 17]
    assert inputs.logits_idx.tolist() == [16]
    assert inputs.sample_ends == [20] and not inputs.is_decode
    assert inputs.fill_dst is None


def test_one_pending_decode_takes_its_sample_from_the_last_launch():
    runner = _runner(4)
    inputs = runner._prepare(_step([_one_sequence_cases()[4]]))
    assert inputs.is_decode and inputs.fill_dst.tolist() == [0] and inputs.fill_src.tolist() == [3]
    runner._last_rows = {}
    try:
        runner._prepare(_step([_one_sequence_cases()[4]]))
    except RuntimeError as e:
        assert "'b'" in str(e)
    else:
        raise AssertionError("a pending token the last launch did not sample must raise")
