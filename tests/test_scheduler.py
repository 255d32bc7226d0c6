"""Scheduler and block manager: exact block ids, chunking, preemption order, steps that
outlive their request (no torch)."""

from types import SimpleNamespace

import pytest

from asyncgen import SamplingParams
from asyncgen.engine.block_manager import BlockManager
from asyncgen.engine.core import EngineCore, RequestGroup
from asyncgen.engine.request import PLACEHOLDER, Request, RequestStatus
from asyncgen.engine.scheduler import Scheduler
from asyncgen.outputs import TokenLogprob

EOS = frozenset({2})


def make(req_id, prompt_len, max_tokens=8, first=10, **params):
    """A request whose prompt counts up from ``first`` (equal ``first`` = shared prefix)."""
    prompt = list(range(first, first + prompt_len))
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), EOS, max_tokens)


def step(s: Scheduler, token=7):
    out = s.schedule()
    s.update(out, {seq.req_id: token for seq in out.seqs if seq.sample})
    return out


def test_block_manager_allocates_and_frees_exact_ids():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("b", 4) == [2]
    assert bm.allocate("a", 8) == [0, 1]  # still two blocks
    assert bm.allocate("a", 9) == [0, 1, 3]
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate("b", 5)
    bm.free("a")
    assert bm.num_free_blocks == 3
    assert bm.allocate("b", 12) == [2, 0, 1]  # freed blocks are reused in order
    with pytest.raises(RuntimeError):
        bm.allocate("c", 100)


def test_prefill_then_decode_counters():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 6))
    out = step(s)
    (seq,) = out.seqs
    assert (seq.start_pos, len(seq.token_ids), seq.sample) == (0, 6, True)
    assert seq.block_ids == [0, 1]
    req = s.requests["a"]
    assert req.num_computed_tokens == 6 and req.num_tokens == 7
    out = step(s)
    assert [(q.start_pos, q.token_ids) for q in out.seqs] == [(6, [7])]


def test_chunked_prefill_splits_long_prompt_and_samples_only_at_the_end():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=5, max_model_len=64)
    s.add(make("a", 12))
    chunks = []
    for _ in range(3):
        out = step(s)
        chunks.append([(q.start_pos, len(q.token_ids), q.sample) for q in out.seqs])
    assert chunks == [[(0, 5, False)], [(5, 5, False)], [(10, 2, True)]]
    assert s.requests["a"].num_output_tokens == 1


def test_budget_shared_between_decode_and_new_prompt():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    s.add(make("a", 3))
    step(s)
    s.add(make("b", 20))
    out = step(s)
    assert [(q.req_id, len(q.token_ids)) for q in out.seqs] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_running():
    s = Scheduler(BlockManager(32, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    for name in "abc":
        s.add(make(name, 2))
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preempts_most_recently_admitted_and_recomputes_it():
    # 4 blocks of 4 tokens: a and b take 2 blocks each after their prompts of 8.
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 8, max_tokens=6))
    s.add(make("b", 8, max_tokens=6, first=100))
    step(s)
    assert s.block_manager.num_free_blocks == 0
    out = step(s)  # a needs a third block for token 8: b (newest) is preempted
    assert out.preempted_req_ids == ["b"]
    assert [q.req_id for q in out.seqs] == ["a"]
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_output_tokens == 1
    assert s.num_preemptions == 1
    while "a" in s.requests:
        step(s)
    assert "a" not in s.requests
    out = step(s)  # b comes back and recomputes prompt + its generated token
    assert [(q.req_id, q.start_pos, len(q.token_ids)) for q in out.seqs] == [("b", 0, 9)]


def _with_priority(req, priority):
    req.priority = priority
    return req


def test_priority_policy_admits_by_priority_then_arrival():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64, policy="priority")
    for name, prio in (("late", 5), ("urgent", -1), ("later", 5), ("normal", 0)):
        s.add(_with_priority(make(name, 3, max_tokens=2, first=10 * len(name)), prio))
    order = []
    while s.has_work:
        out = step(s)
        order += [q.req_id for q in out.seqs if q.req_id not in order]
    assert order == ["urgent", "normal", "late", "later"]
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler(BlockManager(4, 4), 1, 64, 64, policy="lifo")


def test_priority_policy_preempts_the_lowest_priority_not_the_newest():
    # 4 blocks of 4 tokens; b comes first, a later with a higher priority; prompts of 7
    # fill the pool once both decode, and b's next token needs a third block
    for policy, victim in (("fcfs", "a"), ("priority", "b")):
        s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, policy=policy)
        s.add(_with_priority(make("b", 7, max_tokens=6, first=100), 1 if policy == "priority" else 0))
        step(s)
        s.add(make("a", 7, max_tokens=6))
        step(s)
        assert s.block_manager.num_free_blocks == 0
        out = step(s)
        assert out.preempted_req_ids == [victim], policy
        assert [q.req_id for q in out.seqs] == ["b" if victim == "a" else "a"]
    # a preempted request keeps its place by priority among the waiting ones, ahead of a
    # later one of the same priority, and comes back first
    s.add(_with_priority(make("c", 4, max_tokens=2, first=200), 1))
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    while "a" in s.requests:
        step(s)
    out = step(s)
    assert [q.req_id for q in out.seqs][0] == "b"


def test_finish_on_eos_max_tokens_and_stop_token_ids():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("eos", 2))
    s.add(make("len", 2, max_tokens=2))
    s.add(make("stopid", 2, stop_token_ids=[9]))
    out = s.schedule()
    s.update(out, {"eos": 2, "len": 5, "stopid": 9})
    assert "eos" not in s.requests and "stopid" not in s.requests
    out = s.schedule()
    s.update(out, {"len": 5})
    assert "len" not in s.requests
    assert s.block_manager.num_free_blocks == 16


def test_min_tokens_and_ignore_eos_keep_going():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("min", 2, min_tokens=2))
    s.add(make("ign", 2, ignore_eos=True))
    out = s.schedule()
    s.update(out, {"min": 2, "ign": 2})
    assert set(s.requests) == {"min", "ign"}
    out = s.schedule()
    s.update(out, {"min": 2, "ign": 2})
    assert set(s.requests) == {"min", "ign"}
    out = s.schedule()
    s.update(out, {"min": 2, "ign": 2})
    assert set(s.requests) == {"ign"}


def test_abort_frees_blocks_and_skips_in_flight_result():
    s = Scheduler(BlockManager(8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 6))
    out = s.schedule()
    assert s.block_manager.num_free_blocks == 6
    assert s.abort("a")
    assert s.block_manager.num_free_blocks == 8
    assert s.update(out, {"a": 5}) == []  # the step that was running for it is ignored
    assert not s.abort("a")
    # An output with nothing to run is not executed: the news waits for the next real step.
    assert s.schedule().is_empty
    s.add(make("b", 2))
    out = s.schedule()
    assert out.finished_req_ids == ["a"] and [r.req_id for r in out.new_requests] == ["b"]


def test_max_model_len_ends_with_length():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=8)
    s.add(make("a", 6, max_tokens=100))
    step(s)
    step(s)
    assert "a" not in s.requests


# --- prefix caching -------------------------------------------------------------------------
def test_prefix_cache_shares_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 10))
    step(s)  # a computed 10 tokens: blocks 0, 1 full and keyed, block 2 partial
    assert bm.num_cached_blocks == 2
    s.add(make("b", 11))  # same first 10 tokens (make() counts up from 10), one more
    out = step(s)
    b_seq = next(q for q in out.seqs if q.req_id == "b")
    assert b_seq.block_ids[:2] == bm.table("a")[:2]  # shared, not recomputed
    assert b_seq.start_pos == 8 and b_seq.token_ids == list(range(18, 21))
    assert s.requests["b"].num_cached_tokens == 8
    assert bm.hit_rate == 8 / 21
    s.abort("a")
    assert bm.num_free_blocks == 8 - len(bm.table("b"))  # a's shared blocks still held by b
    s.abort("b")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # kept for reuse


def test_prefix_cache_keeps_one_token_to_compute_and_evicts_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate("a", 8) == [0, 1]
    bm.cache_full_blocks("a", list(range(8)), 8)
    bm.free("a")
    # An identical 8-token prompt: only the first block may be reused (token 7 must run).
    assert bm.match_prefix(list(range(8))) == [0]
    assert bm.match_prefix(list(range(9))) == [0, 1]
    assert bm.match_prefix([99] + list(range(1, 9))) == []
    # Unkeyed free blocks go first; then the least recently freed cached block (1 before 0:
    # the end of a prefix is evicted before its start).
    assert bm.allocate("x", 12) == [2, 3, 1]
    assert bm.match_prefix(list(range(9))) == [0]


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", list(range(8)), 8)
    assert bm.match_prefix(list(range(9))) == [] and bm.num_cached_blocks == 0


def test_n_samples_wait_for_the_first_then_share_its_prompt_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    lead, follow = make("r#0", 9), make("r#1", 9)
    follow.prefix_leader = lead
    s.add(lead)
    s.add(follow)
    out = step(s)
    assert [q.req_id for q in out.seqs] == ["r#0"]
    out = step(s)
    f = next(q for q in out.seqs if q.req_id == "r#1")
    assert f.start_pos == 8 and f.block_ids[:2] == bm.table("r#0")[:2]


# --- planning a step before the previous one's tokens are known -----------------------------
def test_run_ahead_plans_the_next_step_with_a_placeholder_then_fills_it():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 6, max_tokens=3))
    first = s.schedule()  # prefill, samples token 1
    second = s.schedule()  # planned before `first` finished: its input is still unknown
    (seq,) = second.seqs
    assert (seq.start_pos, seq.token_ids, seq.sample) == (6, [PLACEHOLDER], True)
    req = s.requests["a"]
    assert req.num_computed_tokens == 7 and req.num_confirmed_tokens == 0
    assert req.token_ids[6:] == [PLACEHOLDER, PLACEHOLDER]
    assert s.update(first, {"a": 40}) == [req]
    assert req.token_ids[6:] == [40, PLACEHOLDER] and req.num_confirmed_tokens == 6
    third = s.schedule()  # token 3 is the last (max_tokens=3) and still pending: not planned
    assert [q.token_ids for q in third.seqs] == [[PLACEHOLDER]]
    assert s.schedule().is_empty
    s.update(second, {"a": 41})
    s.update(third, {"a": 42})
    assert req.status is RequestStatus.FINISHED_LENGTH and req.output_token_ids == [40, 41, 42]


def test_run_ahead_stop_token_discards_the_step_already_planned():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 5, max_tokens=10))
    first, second = s.schedule(), s.schedule()
    req = s.requests["a"]
    assert s.update(first, {"a": 2}) == [req]  # EOS: finished, blocks back at once
    assert req.status is RequestStatus.FINISHED_STOPPED and req.output_token_ids == [2]
    assert "a" not in s.requests and s.block_manager.num_free_blocks == 16
    assert s.update(second, {"a": 9}) == []  # the step planned behind it is dropped
    assert req.output_token_ids == [2]
    s.add(make("b", 3))
    assert s.schedule().finished_req_ids == ["a"]  # the runner is told to forget it


def test_preemption_drops_a_pending_token_and_recomputes_it():
    s = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 8, max_tokens=10))
    s.add(make("b", 8, max_tokens=10, first=100))
    first = s.schedule()  # both prefill 8 tokens: all 4 blocks; both sample
    second = s.schedule()  # a's next token needs a 5th block: b (newest) is preempted
    assert [q.req_id for q in second.seqs] == ["a"] and second.preempted_req_ids == ["b"]
    b = s.requests["b"]
    assert b.status is RequestStatus.WAITING and b.token_ids == list(range(100, 108))
    got = s.update(first, {"a": 50, "b": 51})
    assert [r.request_id for r in got] == ["a"]  # b's token is dropped with its blocks
    assert b.token_ids == list(range(100, 108)) and b.num_computed_tokens == 0


def test_step_planned_for_an_aborted_request_skips_a_new_one_with_its_id():
    # Two steps of "a" are planned ahead; "a" is aborted and its id at once given to a new
    # request, which the next step admits. The old steps' tokens belong to nobody now.
    s = Scheduler(BlockManager(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s.add(make("a", 6, max_tokens=10))
    first, second = s.schedule(), s.schedule()
    assert s.abort("a")
    s.add(make("a", 9, first=100))
    third = s.schedule()
    new = s.requests["a"]
    assert new.status is RequestStatus.RUNNING and [(q.start_pos, q.sample) for q in third.seqs] == [(0, True)]
    assert s.update(first, {"a": 40}) == [] and s.update(second, {"a": 41}) == []
    assert new.token_ids == list(range(100, 109)) + [PLACEHOLDER] and new.num_confirmed_tokens == 0
    assert s.update(third, {"a": 42}) == [new]
    assert new.output_token_ids == [42] and new.num_confirmed_tokens == 9


def core_of(max_num_batched_tokens: int) -> EngineCore:
    """An engine core whose tokenizer decodes every token as one "t"."""
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "t" * len(ids))
    return EngineCore(tokenizer, num_blocks=16, block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=64, eos_token_ids=EOS)


def test_prompt_logprobs_of_a_step_planned_for_an_aborted_request_are_dropped():
    core = core_of(max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=4, prompt_logprobs=0)
    core.add(RequestGroup("x", None, list(range(10, 22)), params), 4)
    first, second = core.schedule(), core.schedule()  # the old prompt's chunks 0-3 and 4-7
    core.abort("x")
    new = RequestGroup("x", None, [5, 6, 7], params)
    core.add(new, 4)
    third = core.schedule()
    assert [(q.start_pos, q.prompt_logprobs) for q in third.seqs] == [(0, True)]
    # The old steps report positions the new, shorter prompt does not even have.
    for out, positions in ((first, range(1, 5)), (second, range(5, 9))):
        core.update(out, {}, None, {"x": [(p, TokenLogprob(10 + p, -1.0)) for p in positions]})
    assert new.prompt_logprobs == [None, None, None]
    core.update(third, {"x": 9}, None, {"x": [(1, TokenLogprob(6, -0.5)), (2, TokenLogprob(7, -0.25))]})
    assert new.prompt_logprobs == [None, TokenLogprob(6, -0.5), TokenLogprob(7, -0.25)]


def test_token_of_a_request_aborted_before_its_emit_reaches_no_new_request_with_its_id():
    core = core_of(max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    old = RequestGroup("x", None, [10, 11, 12], params)
    core.add(old, 4)
    out = core.schedule()
    reqs = core.update(out, {"x": 20})
    # Between update and emit the stream is aborted and its id reused at once.
    core.abort("x")
    assert [(c.token_ids, c.finish_reason) for c in old.queue] == [((20,), "abort")]
    new = RequestGroup("x", None, [30, 31], params)
    core.add(new, 4)
    core.emit(reqs)
    assert not new.queue and new.num_completion_tokens == 0 and len(old.queue) == 1


@pytest.mark.parametrize("max_tokens, reason", [(4, "abort"), (2, "length")])
def test_an_abort_between_update_and_emit_keeps_the_last_token_in_text_and_usage(max_tokens, reason):
    core = core_of(max_num_batched_tokens=64)
    group = RequestGroup("x", None, [10, 11, 12], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    core.add(group, max_tokens)
    core.emit(core.update(core.schedule(), {"x": 20}))
    core.update(core.schedule(), {"x": 21})  # (the second token ends the request at max_tokens=2)
    core.abort("x")  # before that token's emit
    chunks = list(group.queue)
    assert [c.token_ids for c in chunks] == [(20,), (21,)]
    assert "".join(c.text for c in chunks) == "tt"
    assert chunks[-1].finish_reason == reason and chunks[-1].usage.completion_tokens == 2
