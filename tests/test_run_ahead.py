"""Planning step N+1 before step N's tokens reach the host (run-ahead).

The engine launches the next step while the current one runs, feeding the device-side
sample in place of the not-yet-known token. These tests check that it really runs ahead,
that a request with a penalty (which reads earlier tokens on the host) runs ahead too,
its sampling enqueued once the previous token is known, and that tokens are the same as
transformers' either way.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncgen import AsyncEngine, SamplingParams

ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=64, block_size=16)


def _spy(engine) -> list[tuple[str, int]]:
    """Records ("launch", k) / ("collect", k) in the order the device thread runs them."""
    runner = engine._runner
    launch, collect = runner.launch, runner.collect
    events: list[tuple[str, int]] = []
    ids: dict[int, int] = {}
    keep = []  # the steps stay alive, so their ids are never reused

    def spy_launch(out):
        step = launch(out)
        if out.seqs:
            keep.append(step)
            ids[id(step)] = len(keep) - 1
            events.append(("launch", ids[id(step)]))
        return step

    def spy_collect(step):
        if id(step) in ids:
            events.append(("collect", ids[id(step)]))
        return collect(step)

    runner.launch, runner.collect = spy_launch, spy_collect
    return events


def _launched_before_collecting_previous(events) -> int:
    """How many steps were launched while the step before them was not yet collected."""
    collected: set[int] = set()
    count = 0
    for kind, k in events:
        if kind == "collect":
            collected.add(k)
        elif k > 0 and k - 1 not in collected:
            count += 1
    return count


async def _generate_together(engine, **requests) -> dict:
    """Runs the named (prompt, params) requests concurrently; their outputs by name."""
    results = {}

    async def run(name, prompt, params):
        results[name] = await engine.generate(prompt, params)

    async with anyio.create_task_group() as tg:
        for name, (prompt, params) in requests.items():
            tg.start_soon(run, name, prompt, params)
    return results


def _hf_greedy(model_dir, prompt_ids, max_new, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **kwargs,
        )
    return out[0, len(prompt_ids):].tolist()


PROMPTS = [[5, 17, 3, 99, 40, 12], [7, 7, 7], [300, 2, 11, 11, 64, 8, 120, 33, 5]]
REPEATING = [4127, 12521, 37192, 14529, 15637]  # greedy, the tiny model says one token twice


@pytest.mark.anyio
async def test_engine_runs_ahead_and_tokens_equal_transformers(tiny_llama):
    async with AsyncEngine.from_pretrained(tiny_llama, **ENGINE_ARGS) as engine:
        events = _spy(engine)
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
        results = [None] * len(PROMPTS)

        async def run(i):
            results[i] = await engine.generate(PROMPTS[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(run, i)
    # Nearly every decode step went out before its predecessor's tokens came back.
    assert _launched_before_collecting_previous(events) >= 15
    for prompt, res in zip(PROMPTS, results):
        assert list(res.token_ids) == _hf_greedy(tiny_llama, prompt, 20)


def _hf_penalised_greedy(model_dir, prompt_ids, max_new, rep=1.0, freq=0.0, pres=0.0) -> list[int]:
    """Greedy tokens with vLLM's penalties, applied to transformers' logits step by step:
    the repetition penalty over prompt and output tokens, then frequency and presence over
    the output's counts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            vocab = logits.shape[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=vocab).float()
            seen = (torch.bincount(torch.tensor(prompt_ids), minlength=vocab) + counts) > 0
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits -= freq * counts + pres * (counts > 0).float()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.anyio
async def test_penalty_requests_run_ahead_and_sample_once_the_previous_token_is_known(tiny_llama):
    """A penalty reads the previous step's token on the host. The step is launched ahead
    all the same and only its sampling waits for that token; the tokens are those of
    transformers with the penalties applied one step at a time."""
    async with AsyncEngine.from_pretrained(tiny_llama, **ENGINE_ARGS) as engine:
        events = _spy(engine)
        runner = engine._runner
        deferred = 0
        sample_deferred = runner._sample_deferred

        def count_deferred():
            nonlocal deferred
            deferred += 1
            sample_deferred()

        runner._sample_deferred = count_deferred
        plain = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)
        repetition = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0, repetition_penalty=1.5)
        counts = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0, frequency_penalty=1.5,
                                presence_penalty=1.0)
        results = await _generate_together(engine, plain=(PROMPTS[1], plain), repetition=(PROMPTS[1], repetition),
                                           counts=(REPEATING, counts))
        assert not runner._unabsorbed and runner._deferred is None
    # Every decode step went out before its predecessor's tokens came back, and those
    # with a penalised sequence (after each one's first token) sampled late.
    assert _launched_before_collecting_previous(events) >= 25
    assert deferred >= 19 - 1
    assert list(results["plain"].token_ids) == _hf_greedy(tiny_llama, PROMPTS[1], 30)
    assert list(results["repetition"].token_ids) == _hf_greedy(tiny_llama, PROMPTS[1], 20, repetition_penalty=1.5)
    assert list(results["repetition"].token_ids) == _hf_penalised_greedy(tiny_llama, PROMPTS[1], 20, rep=1.5)
    assert list(results["counts"].token_ids) == _hf_penalised_greedy(tiny_llama, REPEATING, 16, freq=1.5, pres=1.0)
    # Unpenalised, this prompt's greedy output repeats its first token at once: the
    # penalties, which read that first token on the host, changed the second.
    unpenalised = _hf_greedy(tiny_llama, REPEATING, 16)
    assert unpenalised[0] == unpenalised[1] and results["counts"].token_ids[1] != unpenalised[1]


def test_prompt_step_takes_the_smallest_captured_graph_that_holds_it():
    """A prompt step replays the graph with the fewest tokens, then the fewest sequence
    slots, that hold its tokens and its sequences plus the padding one."""
    from asyncgen.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the choice is under test: no model
    runner._prompt_graph_keys = [(16, 8), (16, 17), (128, 8), (128, 129), (1024, 257)]
    assert runner._prompt_graph_for(78, 1) == (128, 8)  # a chunk over a cached prefix: narrow
    assert runner._prompt_graph_for(16, 7) == (16, 8)
    assert runner._prompt_graph_for(16, 8) == (16, 17)  # no slot left for the padding in 8
    assert runner._prompt_graph_for(100, 60) == (128, 129)  # a prompt chunk among 59 decodes
    assert runner._prompt_graph_for(129, 1) == (1024, 257)
    assert runner._prompt_graph_for(1025, 1) is None  # eager
    assert runner._prompt_graph_for(10, 300) is None
    from asyncgen.worker.model_runner import _prompt_graph_keys

    runner._prompt_graph_keys = _prompt_graph_keys(2048, 256)
    assert runner._prompt_graph_for(150, 1) == (160, 8)  # a chat turn after a cached prefix
    assert runner._prompt_graph_for(150, 9) == (256, 256)  # the narrow sizes hold 7 sequences
    assert runner._prompt_graph_for(1070, 1) == (1152, 257)


def test_prompt_graphs_up_to_512_tokens_are_also_captured_with_8_slots():
    from asyncgen.worker.model_runner import _prompt_graph_keys

    keys = _prompt_graph_keys(max_num_batched_tokens=8192, max_num_seqs=256)
    assert keys[:6] == [(16, 8), (16, 16), (32, 8), (32, 32), (48, 8), (48, 48)]
    # Every 16 tokens up to 128, then every 128; the narrow graphs every 32 up to 512.
    assert sorted({t for t, b in keys if b > 8}) == [16, 32, 48, 64, 80, 96, 112, *range(128, 2049, 128)]
    assert sorted({t for t, b in keys if b == 8}) == [16, 32, 48, 64, 80, 96, 112, *range(128, 513, 32)]
    assert (512, 8) in keys and (512, 257) in keys and (160, 8) in keys and (160, 161) not in keys
    assert [k for k in keys if k[0] > 512] == [(t, 257) for t in range(640, 2049, 128)]
    assert keys == sorted(keys)
    # Few sequences allowed: no graph has more slots than a step can use, none is doubled.
    assert _prompt_graph_keys(max_num_batched_tokens=64, max_num_seqs=4) == [(16, 5), (32, 5), (48, 5), (64, 5)]
    few = _prompt_graph_keys(max_num_batched_tokens=256, max_num_seqs=4)
    assert [t for t, _ in few if t > 128] == [160, 192, 224, 256] and {b for _, b in few} == {5}
    assert _prompt_graph_keys(max_num_batched_tokens=8, max_num_seqs=4) == []


@pytest.mark.anyio
@pytest.mark.parametrize("num_requests", [1, 10])
async def test_a_few_sequences_get_their_tokens_before_the_next_launch(tiny_llama, num_requests):
    """With at most 8 sequences the loop emits a step's chunks before it launches the step
    after next (the one behind it keeps the device busy); with more it launches first."""
    async with AsyncEngine.from_pretrained(tiny_llama, **ENGINE_ARGS) as engine:
        runner, core = engine._runner, engine._core
        events: list[tuple[str, int]] = []
        launch, emit = runner.launch, core.emit

        def spy_launch(out):
            if out.seqs:
                events.append(("launch", sum(kind == "launch" for kind, _ in events)))
            return launch(out)

        def spy_emit(reqs):
            if reqs:
                events.append(("emit", len(reqs)))
            return emit(reqs)

        runner.launch, core.emit = spy_launch, spy_emit
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        async with anyio.create_task_group() as tg:
            for i in range(num_requests):
                tg.start_soon(engine.generate, [5 + i, 17, 3, 99], params)
    first_emit = events.index(("emit", num_requests))
    third_launch = events.index(("launch", 2))
    # The first step computed every prompt (one token each sampled); its chunks went out
    # before the third launch with one sequence, after it with ten.
    assert events[:2] == [("launch", 0), ("launch", 1)]
    if num_requests == 1:
        assert first_emit < third_launch
    else:
        assert third_launch < first_emit


@pytest.mark.anyio
async def test_structured_requests_run_ahead_and_end_without_leaving_their_grammar(tiny_llama, caplog):
    """A grammar's mask needs the previous token on the host, so its steps sample late; the
    step planned after the stop token (its token dropped) is no grammar error."""
    choices = ["a long answer of several tokens", "another answer, also long enough"]
    async with AsyncEngine.from_pretrained(tiny_llama, **ENGINE_ARGS) as engine:
        events = _spy(engine)
        params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"choice": choices})
        plain = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)
        with caplog.at_level("ERROR", logger="asyncgen"):
            outs = await _generate_together(engine, structured=(PROMPTS[0], params), plain=(PROMPTS[2], plain))
    assert outs["structured"].text in choices and outs["structured"].finish_reason == "stop"
    assert list(outs["plain"].token_ids) == _hf_greedy(tiny_llama, PROMPTS[2], 30)
    assert _launched_before_collecting_previous(events) >= 25
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


@pytest.mark.anyio
async def test_penalised_and_structured_requests_under_preemption_equal_their_runs_alone(tiny_llama):
    """A pool too small for the batch preempts sequences while their next step is in
    flight; a preempted sequence's history keeps the token sampled again for a position,
    never the dropped one, so penalties and grammars read what the request alone reads."""
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(20, 40000, (int(n),), generator=rng).tolist() for n in torch.randint(3, 30, (10,))]
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.5)
        if i % 2 == 0 else SamplingParams(max_tokens=24, temperature=0, structured_outputs={"json_object": True})
        for i in range(len(prompts))
    ]
    async with AsyncEngine.from_pretrained(tiny_llama, **ENGINE_ARGS) as engine:
        alone = [list((await engine.generate(p, sp)).token_ids) for p, sp in zip(prompts, params)]
    async with AsyncEngine.from_pretrained(tiny_llama, **dict(ENGINE_ARGS, num_kv_blocks=9)) as engine:
        together = await _generate_together(engine, **{str(i): (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))})
        preemptions = engine.stats().num_preemptions
    assert preemptions >= 2
    assert [list(together[str(i)].token_ids) for i in range(len(prompts))] == alone


def test_a_token_sampled_again_after_preemption_replaces_the_dropped_one_in_the_history(tiny_llama):
    """Step X samples output position 1; before X is collected the sequence is preempted
    and recomputed, and step Y samples position 1 again. X's token was dropped by the
    scheduler: the history (which penalties count) keeps Y's, whatever order they come in."""
    from asyncgen.config import EngineConfig
    from asyncgen.engine.request import PLACEHOLDER
    from asyncgen.engine.scheduler import NewRequestData, ScheduledSeq, SchedulerOutput
    from asyncgen.model.config import ModelConfig
    from asyncgen.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_llama, ModelConfig.from_dir(tiny_llama), EngineConfig(**ENGINE_ARGS), 256)
    runner.load()
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5)
    new = NewRequestData("r", prompt, params, None, frozenset())
    step0 = runner.launch(SchedulerOutput([ScheduledSeq("r", prompt, 0, [0], True)], [new], [], len(prompt), []))
    tok0 = runner.collect(step0).sampled["r"]
    history = prompt + [tok0]
    # X: position 1 in a decode step; Y: the sequence recomputed from scratch (other
    # blocks), position 1 again; both launched before X is collected.
    x = runner.launch(SchedulerOutput([ScheduledSeq("r", [tok0], len(prompt), [0], True)], [], [], 1, []))
    y = runner.launch(SchedulerOutput([ScheduledSeq("r", history, 0, [1], True)], [], [], len(history), []))
    runner.collect(x)
    # Z: position 2, its input Y's token, still in flight. Its penalty needs that token,
    # not X's: its sampling waits for Y.
    z = runner.launch(SchedulerOutput([ScheduledSeq("r", [PLACEHOLDER], len(history), [1], True)], [], [], 1, []))
    assert z.pending is None and z.deferred is not None
    tok1 = runner.collect(y).sampled["r"]
    tok2 = runner.collect(z).sampled["r"]
    assert runner.states["r"].output_token_ids == [tok0, tok1, tok2]
    assert not runner.states["r"].in_flight and not runner._unabsorbed and runner._deferred is None
