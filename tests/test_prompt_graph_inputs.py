"""The packed inputs of a prompt-step CUDA graph (``_PromptGraphInputs``), on the CPU.

A prompt graph reads its inputs from one buffer that a step writes with one copy,
padding included. Here the graph is a stand-in that records what it would read at
replay, checked against values written out by hand: the step's tokens, then one padding
sequence up to the graph's token count (token 0 at position 0, slot -1), empty sequence
slots after it, the placeholders filled from the previous launch's samples, and the block
tables of the step's sequences (the other rows untouched)."""

from __future__ import annotations

import collections

import pytest
import torch

from asyncgen.engine.request import PLACEHOLDER
from asyncgen.engine.scheduler import NewRequestData, ScheduledSeq, SchedulerOutput
from asyncgen.sampling_params import SamplingParams
from asyncgen.worker import model_runner as mr

BS = 4
MAX_BLOCKS = 6
VOCAB = 32


class _Graph:
    """Records the graph inputs as the graph would read them when replayed."""

    def __init__(self, g: mr._PromptGraphInputs):
        self.g = g
        self.seen: list[dict] = []

    def replay(self) -> None:
        g = self.g
        self.seen.append({
            name: getattr(g, name).clone()
            for name in ("input_ids", "positions", "slot_mapping", "logits_idx", "seq_lens", "query_start_loc",
                         "block_tables")
        })


def _runner(keys):
    runner = mr.ModelRunner.__new__(mr.ModelRunner)  # only the inputs are under test: no model
    runner.block_size = BS
    runner.device = torch.device("cpu")
    runner.states, runner._pooling = {}, set()
    runner._graphs, runner._graph_sizes = {}, []
    runner._last_rows = {"b": 3, "c": 0}
    runner._last_tokens = torch.tensor([70, 71, 72, 73])  # the previous launch's samples, by row
    runner._unabsorbed, runner._deferred = collections.deque(), None  # no launch in flight
    runner._prompt_graph_keys = keys
    runner._prompt_inputs, runner._prompt_graphs = {}, {}
    for t, b in keys:
        g = mr._PromptGraphInputs(t, b, MAX_BLOCKS, runner.device)
        g.buf.fill_(5)  # what earlier steps left; only the block tables' other rows may keep it
        g.block_tables.fill_(9)
        logits = torch.zeros(b, VOCAB)
        logits[:, 17] = 1.0
        runner._prompt_inputs[t, b] = g
        runner._prompt_graphs[t, b] = (_Graph(g), logits)
    return runner


def _mixed_step() -> SchedulerOutput:
    seqs = [
        # a prompt chunk of 5 tokens over 6 cached ones (a prefix-cache hit), samples
        ScheduledSeq("a", [11, 12, 13, 14, 15], 6, [8, 2, 7], True),
        ScheduledSeq("b", [PLACEHOLDER], 9, [5, 1, 3], True),  # decodes whose inputs are pending
        ScheduledSeq("c", [PLACEHOLDER], 4, [3, 6], True),
    ]
    return SchedulerOutput(seqs, [], [], 7, [])


def _check_mixed_step(seen: dict, t: int, b: int, full_rows: bool) -> None:
    # position p of a sequence goes to block table[p // BS], offset p % BS
    slots = [2 * BS + 2, 2 * BS + 3, 7 * BS + 0, 7 * BS + 1, 7 * BS + 2, 3 * BS + 1, 6 * BS + 0]
    pad = t - 7
    assert seen["input_ids"].tolist() == [11, 12, 13, 14, 15, 73, 70] + [0] * pad
    assert seen["positions"].tolist() == [6, 7, 8, 9, 10, 9, 4] + [0] * pad
    assert seen["slot_mapping"].tolist() == slots + [-1] * pad
    assert seen["seq_lens"].tolist() == [11, 10, 5, pad] + [0] * (b - 4)
    assert seen["query_start_loc"].tolist() == [0, 5, 6, 7] + [t] * (b - 3)  # the padding sequence ends at t
    assert seen["logits_idx"].tolist() == [4, 5, 6] + [0] * (b - 3)
    tables = seen["block_tables"].tolist()
    if full_rows:
        assert tables[:3] == [[8, 2, 7, 0, 0, 0], [5, 1, 3, 0, 0, 0], [3, 6, 0, 0, 0, 0]]
    else:  # only the step's columns were written
        assert tables[:3] == [[8, 2, 7, 9, 9, 9], [5, 1, 3, 9, 9, 9], [3, 6, 0, 9, 9, 9]]
    assert tables[3:] == [[9] * MAX_BLOCKS] * (b - 3)  # earlier rows: valid ids, left alone


@pytest.mark.parametrize("full_rows", [True, False])
def test_a_mixed_step_is_written_into_the_graph_inputs_with_its_padding(monkeypatch, full_rows):
    if not full_rows:
        monkeypatch.setattr(mr, "_PACKED_TABLE_BYTES", 0)
    runner = _runner([(16, 8)])
    out = _mixed_step()
    logits = runner._replay_prompt((16, 8), runner._host_inputs(out))
    graph = runner._prompt_graphs[16, 8][0]
    assert len(graph.seen) == 1
    _check_mixed_step(graph.seen[0], 16, 8, full_rows)
    assert logits.shape == (3, VOCAB)


def test_a_smaller_step_after_a_larger_one_leaves_nothing_of_it_behind():
    runner = _runner([(16, 8)])
    big = SchedulerOutput([ScheduledSeq("x", list(range(1, 15)), 0, [1, 2, 3, 4], True)], [], [], 14, [])
    runner._replay_prompt((16, 8), runner._host_inputs(big))
    runner._replay_prompt((16, 8), runner._host_inputs(_mixed_step()))
    seen = runner._prompt_graphs[16, 8][0].seen[1]
    _check_mixed_step(seen, 16, 8, True)


def test_every_part_is_aligned_and_the_parts_do_not_overlap():
    for t, b in mr._prompt_graph_keys(2048, 256):
        g = mr._PromptGraphInputs(t, b, 33, torch.device("cpu"))  # an odd row width
        parts = [g.input_ids, g.positions, g.slot_mapping, g.logits_idx, g.fill_dst, g.fill_src, g.seq_lens,
                 g.query_start_loc, g.block_tables]
        spans = []
        for p in parts:
            start = p.data_ptr() - g.buf.data_ptr()
            assert start % 16 == 0
            spans.append((start, start + p.numel() * p.element_size()))
        assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:]))
        assert spans[-1][1] <= g.buf.numel() * 8
        assert g.packed_words(b) * 8 >= spans[-1][1]  # the whole table fits in a full copy
        assert g.slot_mapping.tolist() == [-1] * t  # a fresh graph writes nothing


def test_full_rows_of_an_odd_width_leave_the_next_row_intact():
    runner = _runner([])
    g = mr._PromptGraphInputs(16, 8, 5, runner.device)  # 5 ids a row: row 1 shares a word with row 0
    g.block_tables.fill_(9)
    runner._prompt_inputs[16, 8] = g
    runner._prompt_graphs[16, 8] = (_Graph(g), torch.zeros(8, VOCAB))
    runner._prompt_graph_keys = [(16, 8)]
    step = SchedulerOutput([ScheduledSeq("x", [1, 2, 3], 4, [6, 2], True)], [], [], 3, [])
    runner._replay_prompt((16, 8), runner._host_inputs(step))
    tables = runner._prompt_graphs[16, 8][0].seen[0]["block_tables"].tolist()
    assert tables[0] == [6, 2, 0, 0, 0]
    assert tables[1][0] in (0, 9) and tables[1][1:] == [9] * 4  # a valid id, never a stray value


def test_launch_replays_the_narrow_graph_for_a_prefix_hit_and_samples_its_row():
    runner = _runner([(16, 8), (16, 17)])
    greedy = SamplingParams(temperature=0, max_tokens=4)
    prompt = list(range(1, 12))
    new = NewRequestData("a", prompt, greedy, None, frozenset())
    out = SchedulerOutput([ScheduledSeq("a", prompt[8:], 8, [4, 0, 2], True)], [new], [], 3, [])
    launched = runner.launch(out)
    assert launched.sampling_ids == ["a"]
    assert runner.collect(launched).sampled == {"a": 17}
    assert len(runner._prompt_graphs[16, 8][0].seen) == 1 and not runner._prompt_graphs[16, 17][0].seen
    seen = runner._prompt_graphs[16, 8][0].seen[0]
    assert seen["input_ids"].tolist() == [9, 10, 11] + [0] * 13
    assert seen["seq_lens"].tolist() == [11, 13, 0, 0, 0, 0, 0, 0]
