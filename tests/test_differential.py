"""Differential fuzzing of scheduling and KV bookkeeping: a greedy request's output must
not depend on what else the engine is doing.

Each case draws a random workload and random engine settings, runs the workload, and
compares every request with a reference: the same request alone (n=1), in a separate
engine whose pool is far larger than one sequence needs, with prefix caching off and a
token budget that never chunks a prompt.

The workload stresses the bookkeeping: prompts sharing prefixes of exact block multiples
and not, identical prompts, prompts that are prefixes of others or continue another's
output; a pool barely larger than the longest sequence (preemption); token budgets down
to 16 (chunked prefill); ``max_num_seqs`` down to 1; ``n`` > 1 and ``best_of`` (every
greedy sample equals the one greedy output); arrivals while others decode; requests
aborted, broken off or cancelled midway (what they received is a prefix of their
reference, and they change nobody else's output), some retried at once under the same
request_id; random priorities under the priority policy; embedding requests (their vector
must equal the prompt's alone, to fp32 rounding); logprobs and prompt logprobs; stop strings and stop token ids taken from the
reference's own output so that they end it midway; ``max_tokens=1``; a repetition
penalty and structured outputs (a JSON Schema, JSON mode, choices, a structural tag; both
stop the engine planning steps ahead while they run). Afterwards every
block is free and nothing is left of any request.

Batches of different shapes round differently in the last bits, so a greedy choice
between two tokens whose logprobs are closer than :data:`TIE` may flip; the reference
reports the top two at each position, and a divergence at such a near-tie ends that
request's comparison instead of failing it. A divergence anywhere else is a bug.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from pathlib import Path
from typing import Any, Optional

import anyio
import pytest

from asyncgen import AsyncEngine, SamplingParams

from conftest import save_tiny_model
from test_soak import soak

VOCAB = 512
IDS = range(20, VOCAB)  # prompt ids: clear of the tokenizer's special tokens (EOS among them)
MAX_MODEL_LEN = 128
MAX_PROMPT = 64
TOP = 2  # the reference reports this many top tokens a position, to recognise near-ties
TIE = 1e-3  # logprob gap below which two tokens count as tied
LOGPROB_TOL = 1e-4
COMMON = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, freeze_gc=False)
REFERENCE = dict(COMMON, num_kv_blocks=64, block_size=16, max_num_batched_tokens=2048, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-differential"), "llama", smollm2_path, vocab_size=VOCAB)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Each engine's device thread keeps the intra-op thread count it started with; one
    thread runs these tiny ops fastest on a shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- the workload ----------------------------------------------------------------------------
@dataclasses.dataclass
class Planned:
    name: str
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrive_step: int  # submitted once the engine has run this many steps (or gone idle)
    consumer: str  # "stream", "generate", "abort", "break", "cancel" or "embed" (engine.embed, params unused)
    after_chunks: int  # chunks read before "abort" / "break"
    delay: float  # seconds before "cancel"
    then: Optional["Planned"] = None  # submitted with the same request_id as soon as this one ended
    is_retry: bool = False
    priority: int = 0  # under the "priority" scheduling policy


@dataclasses.dataclass
class Case:
    seed: int
    settings: dict[str, Any]
    requests: list[Planned]

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {self.settings}"]
        for r in self.requests:
            p = r.params.model_dump(exclude_defaults=True)
            when = f"right after {r.request_id}" if r.is_retry else f"at step {r.arrive_step}"
            lines.append(f"  {r.name} (id {r.request_id}): prompt[{len(r.prompt)}]={r.prompt} {p} {when}, {r.consumer}"
                         + (f" after {r.after_chunks}" if r.consumer in ("abort", "break") else "")
                         + (f" after {r.delay:.3f} s" if r.consumer == "cancel" else ""))
        return "\n".join(lines)


def _draw_prompts(rng: random.Random, count: int, block_size: int) -> list[list[int]]:
    """Prompts sharing prefixes: block-aligned or one off, identical, one the head of another."""
    def fresh(n: int) -> list[int]:
        return [rng.choice(IDS) for _ in range(n)]

    prefixes = []
    for _ in range(rng.randint(1, 3)):
        blocks = rng.randint(1, 3)
        length = blocks * block_size + rng.choice((0, 0, -1, 1, rng.randint(-block_size + 1, block_size - 1)))
        prefixes.append(fresh(max(1, min(length, MAX_PROMPT - 4))))
    prompts: list[list[int]] = []
    for _ in range(count):
        kind = rng.choice(("fresh", "prefix", "prefix", "prefix", "copy", "head", "extend")) if prompts else "prefix"
        if kind == "fresh":
            p = fresh(rng.randint(1, 40))
        elif kind == "prefix":
            p = rng.choice(prefixes) + fresh(rng.choice((0, 1, rng.randint(1, 12))))
        elif kind == "copy":
            p = list(rng.choice(prompts))
        elif kind == "head":
            src = rng.choice(prompts)
            cut = rng.choice((rng.randint(1, len(src)), len(src) // block_size * block_size))
            p = src[: max(1, cut)]
        else:
            p = rng.choice(prompts) + fresh(rng.randint(1, block_size + 1))
        prompts.append(p[:MAX_PROMPT])
    return prompts


STRUCTURED = (
    {"json_object": True},
    {"choice": ["yes", "no", "not sure", "nothing at all"]},
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
        "type": "string", "maxLength": 4}, "maxItems": 3}}, "required": ["a"]}},
    # free text in which every "a" opens "a=<integer>;"
    {"structural_tag": {"triggers": ["a"], "structures": [{"begin": "a=", "schema": {"type": "integer"}, "end": ";"}]}},
)


def _draw_params(rng: random.Random) -> tuple[dict[str, Any], Optional[str], str]:
    """Sampling parameters (greedy), the stop to add once the plain output is known, and
    the consumer."""
    p: dict[str, Any] = {
        "temperature": rng.choice((0.0, 0.0, 0.0, 1e-6)),
        "max_tokens": 1 if rng.random() < 0.15 else rng.randint(2, 24),
        "ignore_eos": rng.random() < 0.5,
    }
    consumer = rng.choice(("stream", "stream", "stream", "generate", "abort", "break", "cancel"))
    r = rng.random()
    if r < 0.1:
        p["n"], p["best_of"] = rng.choice(((1, 2), (2, 3), (2, 2)))
        consumer = "generate"  # best_of is not streamed
    elif r < 0.35:
        p["n"] = rng.choice((2, 3))
    if rng.random() < 0.35:
        p["logprobs"] = rng.choice((0, 1, 3))
    if rng.random() < 0.15:
        p["prompt_logprobs"] = rng.choice((0, 2))
    if rng.random() < 0.08:
        p["repetition_penalty"] = 1.3
    if rng.random() < 0.12:
        p["structured_outputs"] = rng.choice(STRUCTURED)
        p["ignore_eos"] = False  # a structured output ends with its stop token
    stop = rng.choice(("token", "string")) if rng.random() < 0.3 else None
    return p, stop, consumer


def _draw_settings(rng: random.Random) -> dict[str, Any]:
    return {
        "block_size": rng.choice((8, 8, 16, 16, 32)),
        "max_num_batched_tokens": rng.choice((16, 16, 24, 32, 48, 2048)),
        "max_num_seqs": rng.choice((1, 2, 3, 4, 6, 256)),
        "enable_prefix_caching": rng.random() < 0.8,
    }


async def _plan_case(seed: int, reference: "Reference", num_requests: int) -> Case:
    rng = random.Random(seed)
    settings = _draw_settings(rng)
    bs = settings["block_size"]
    requests: list[Planned] = []
    prompts = _draw_prompts(rng, num_requests, bs)
    for i in range(1, len(prompts)):
        if rng.random() < 0.15:
            # An earlier prompt and the start of its output: cached blocks holding generated tokens.
            head = prompts[rng.randrange(i)]
            plain = await reference.run(head, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            prompts[i] = (head + list(plain.token_ids[: rng.randint(1, 24)]))[:MAX_PROMPT]
    for i, prompt in enumerate(prompts):
        p, stop, consumer = _draw_params(rng)
        p["max_tokens"] = min(p["max_tokens"], MAX_MODEL_LEN - len(prompt))
        if stop is not None:
            # Taken from the output without it, so that it ends the output midway.
            plain = (await reference.run(prompt, SamplingParams(**p))).outputs[0]
            j = rng.randrange(len(plain.token_ids))
            if stop == "token":
                p["stop_token_ids"] = [plain.token_ids[j]] + rng.sample(IDS, rng.randint(0, 2))
                if rng.random() < 0.3 and "structured_outputs" not in p:
                    p["min_tokens"] = rng.randint(0, min(j + 1, p["max_tokens"]))
            elif plain.text:
                a = rng.randrange(len(plain.text))
                p["stop"] = [plain.text[a : a + rng.randint(1, 3)]]
                p["include_stop_str_in_output"] = rng.random() < 0.5
        requests.append(Planned(
            f"r{i}", f"r{i}", prompt, SamplingParams(**p), 0 if i < 2 or rng.random() < 0.3 else rng.randint(1, 40),
            consumer, rng.randint(1, 4), rng.choice((0.0, rng.uniform(0.0, 0.05))),
        ))
    # Some interrupted requests are retried at once under the same request_id, while
    # steps planned for the old one may still be running.
    for first in [r for r in requests if r.consumer in ("abort", "break", "cancel")]:
        if rng.random() < 0.5:
            p, _, _ = _draw_params(rng)
            if rng.random() < 0.75:  # the same sequence ids as the old request's
                p["n"], p["best_of"] = first.params.n, first.params.best_of
            prompt = rng.choice(prompts)
            p["max_tokens"] = min(p["max_tokens"], MAX_MODEL_LEN - len(prompt))
            first.then = Planned(f"{first.name}'", first.request_id, prompt, SamplingParams(**p), 0,
                                 "generate" if "best_of" in p else rng.choice(("stream", "generate")), 0, 0.0,
                                 is_retry=True)
            requests.append(first.then)
    # A pool a few blocks larger than the longest sequence: preemption under load.
    need = max(-(-(len(r.prompt) + r.params.max_tokens) // bs) for r in requests)
    settings["num_kv_blocks"] = need + rng.choice((0, 1, 2, 3, 5, 8, 64))
    # Some cases schedule by random priorities (drawn apart, so the rest of a case is as
    # it was): the order of admission and the victims of preemption change, no output may.
    by_priority = random.Random(f"{seed}-priority")
    if by_priority.random() < 0.3:
        settings["scheduling_policy"] = "priority"
        for r in requests:
            r.priority = by_priority.choice((-1, 0, 0, 1, 2))
    # Some requests are embeddings instead (drawn apart too): no output may change, and
    # each vector must be the prompt's alone.
    by_embed = random.Random(f"{seed}-embed")
    for r in requests:
        if r.consumer in ("stream", "generate") and not r.is_retry and by_embed.random() < 0.15:
            r.consumer = "embed"
    return Case(seed, settings, requests)


# --- the reference -----------------------------------------------------------------------------
class Reference:
    """Each request alone (one at a time, n=1) in an engine of :data:`REFERENCE` settings,
    remembered by prompt and parameters."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._outputs: dict[tuple, Any] = {}

    async def embed(self, prompt: list[int]):
        key = (tuple(prompt), "embed")
        if key not in self._outputs:
            self._outputs[key] = await self.engine.embed(prompt, normalize=False)
        return self._outputs[key]

    async def run(self, prompt: list[int], params: SamplingParams):
        ref = params.model_copy(update={"n": 1, "best_of": None, "logprobs": max(TOP, params.logprobs or 0)})
        key = (tuple(prompt), ref.model_dump_json())
        if key not in self._outputs:
            out = await self.engine.generate(prompt, ref)
            assert out.outputs[0].finish_reason in ("stop", "length")
            self._outputs[key] = out
        return self._outputs[key]


# --- running a case ------------------------------------------------------------------------------
@dataclasses.dataclass
class Received:
    """One request's outputs by sample index, as streamed (or returned by generate())."""

    ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    text: dict[int, str] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list] = dataclasses.field(default_factory=dict)
    finish: dict[int, Optional[str]] = dataclasses.field(default_factory=dict)
    stop_reason: dict[int, Any] = dataclasses.field(default_factory=dict)
    cumulative: dict[int, Optional[float]] = dataclasses.field(default_factory=dict)
    usage: Any = None
    prompt_logprobs: Any = None
    num_prompt_logprobs_chunks: int = 0
    embedding: Any = None  # an "embed" request's vector


@dataclasses.dataclass
class Observed:
    """What the engine did during a case, besides its outputs."""

    num_preemptions: int = 0
    num_partial_prefills: int = 0  # prompt chunks scheduled that did not reach the prompt's end
    prefix_cache_hit_rate: float = 0.0
    max_batch: int = 0
    leaks: dict = dataclasses.field(default_factory=dict)


async def _wait_for_step(engine: AsyncEngine, step: int) -> None:
    while True:
        s = engine.stats()
        if s.num_steps >= step or (s.num_steps and not s.num_running and not s.num_waiting):
            return
        await anyio.sleep(0.002)


async def _consume(engine: AsyncEngine, r: Planned, got: dict[str, Received]) -> None:
    await _wait_for_step(engine, r.arrive_step)
    while r is not None:
        await _consume_one(engine, r, got[r.name])
        r = r.then


async def _consume_one(engine: AsyncEngine, r: Planned, got: Received) -> None:
    if r.consumer == "embed":
        got.embedding = (await engine.embed(r.prompt, request_id=r.request_id, priority=r.priority,
                                            normalize=False)).embedding
        return
    if r.consumer == "generate":
        out = await engine.generate(r.prompt, r.params, request_id=r.request_id, priority=r.priority)
        for o in out.outputs:
            got.ids[o.index], got.text[o.index] = list(o.token_ids), o.text
            if o.logprobs is not None:
                got.logprobs[o.index] = list(o.logprobs)
            got.finish[o.index], got.stop_reason[o.index] = o.finish_reason, o.stop_reason
            got.cumulative[o.index] = o.cumulative_logprob
        got.usage, got.prompt_logprobs = out.usage, out.prompt_logprobs
        got.num_prompt_logprobs_chunks = int(out.prompt_logprobs is not None)
        return

    async def read(stream) -> None:
        count = 0
        async for chunk in stream:
            i = chunk.index
            got.ids.setdefault(i, []).extend(chunk.token_ids)
            got.text[i] = got.text.get(i, "") + chunk.text
            if chunk.logprobs is not None:
                got.logprobs.setdefault(i, []).extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                assert i not in got.finish, f"{r.name}[{i}]: a second final chunk"
                got.finish[i], got.stop_reason[i] = chunk.finish_reason, chunk.stop_reason
            if chunk.usage is not None:
                got.usage = chunk.usage
            if chunk.prompt_logprobs is not None:
                got.prompt_logprobs = chunk.prompt_logprobs
                got.num_prompt_logprobs_chunks += 1
            count += 1
            if count == r.after_chunks:
                if r.consumer == "abort":
                    engine.abort(r.request_id)  # the stream goes on to its final chunks, "abort"
                elif r.consumer == "break":
                    return

    stream = engine.stream(r.prompt, r.params, request_id=r.request_id, priority=r.priority)
    with anyio.move_on_after(r.delay if r.consumer == "cancel" else None):
        async with stream:
            await read(stream)


async def run_case(model: Path, case: Case) -> tuple[dict[str, Received], Observed]:
    got = {r.name: Received() for r in case.requests}
    seen = Observed()
    async with AsyncEngine.from_pretrained(model, **COMMON, **case.settings) as engine:
        schedule = engine._core.scheduler.schedule

        def watched():  # counts what the steps did and changes nothing
            out = schedule()
            seen.num_partial_prefills += sum(1 for s in out.seqs if not s.sample)
            seen.max_batch = max(seen.max_batch, len(out.seqs))
            return out

        engine._core.scheduler.schedule = watched
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for r in case.requests:
                    if not r.is_retry:
                        tg.start_soon(_consume, engine, r, got)
        # Every stream has ended: every block must be back, though a step may still run.
        seen.leaks = soak.find_leaks(engine)
        # Ids of finished requests travel to the runner with the next step launched; one
        # being launched now has taken them from the scheduler but not yet delivered them.
        with anyio.move_on_after(1):
            while seen.leaks and soak.find_runner_leaks(engine):
                await anyio.sleep(0.01)
                seen.leaks = soak.find_leaks(engine)
        stats = engine.stats()
        seen.num_preemptions = stats.num_preemptions
        seen.prefix_cache_hit_rate = stats.prefix_cache_hit_rate
    return got, seen


# --- comparing ----------------------------------------------------------------------------------
def _near_tie(lp) -> bool:
    return lp.top[0][1] - lp.top[1][1] < TIE


def _compare_logprobs(where: str, got: list, ref: list, k: int, count: int) -> list[str]:
    """The first ``count`` entries of ``got`` (with ``k`` top tokens) against the reference's."""
    for pos in range(count):
        g, w = got[pos], ref[pos]
        if g is None and w is None:
            continue
        if g is None or w is None or g.token_id != w.token_id or abs(g.logprob - w.logprob) > LOGPROB_TOL:
            return [f"{where}: logprob at {pos}: {g} != reference {w}"]
        if len(g.top) != k:
            return [f"{where}: {len(g.top)} top logprobs at {pos}, asked for {k}"]
        for j, ((gi, gv), (wi, wv)) in enumerate(zip(g.top, w.top)):
            # Tokens tied with another in the reference's list, or with one past its end, may swap.
            tied = j + 1 >= len(w.top) or any(abs(wv - v) < TIE for t, v in w.top if t != wi)
            if abs(gv - wv) > LOGPROB_TOL or (gi != wi and not tied):
                return [f"{where}: top {j} at {pos}: {(gi, gv)} != reference {(wi, wv)}"]
    return []


def compare(r: Planned, got: Received, ref, tally: collections.Counter) -> list[str]:
    """What is wrong with one request's outputs against its reference (empty: nothing)."""
    p = r.params
    want = ref.outputs[0]
    finals = p.n if r.consumer == "generate" else p.num_sequences
    all_finals = sorted(got.finish) == list(range(finals))
    if r.consumer in ("stream", "generate", "abort") and not all_finals:
        return [f"{r.name}: final chunks for indices {sorted(got.finish)}, expected {finals}"]
    interrupted = not all_finals or any(f not in ("stop", "length") for f in got.finish.values())
    problems: list[str] = []
    tied = False
    for i in sorted(set(got.ids) | set(got.finish)):
        ids, reason, where = got.ids.get(i, []), got.finish.get(i), f"{r.name}[{i}]"
        complete = reason in ("stop", "length")
        if not complete and r.consumer in ("stream", "generate"):
            problems.append(f"{where}: ended with {reason!r} though nothing interrupted it")
        diverged = next((k for k, (a, b) in enumerate(zip(ids, want.token_ids)) if a != b), None)
        if diverged is not None and _near_tie(want.logprobs[diverged]):
            tally["ties"] += 1
            tied = True
            continue
        if diverged is not None:
            problems.append(f"{where}: token {diverged} is {ids[diverged]}, reference {want.token_ids[diverged]} "
                            f"(tokens {ids}, reference {list(want.token_ids)})")
            continue
        if len(ids) > len(want.token_ids) or (complete and len(ids) != len(want.token_ids)):
            problems.append(f"{where}: {len(ids)} tokens {ids} ({reason}), reference {len(want.token_ids)} "
                            f"{list(want.token_ids)} ({want.finish_reason})")
            continue
        lps = got.logprobs.get(i)
        if p.logprobs is None:
            if lps is not None:
                problems.append(f"{where}: logprobs it did not ask for")
        elif len(lps or ()) != len(ids):
            problems.append(f"{where}: {len(lps or ())} logprobs for {len(ids)} tokens")
        else:
            problems += _compare_logprobs(where, lps, want.logprobs, p.logprobs, len(ids))
        if not complete:
            tally["prefixes_compared"] += 1
            continue
        tally["outputs_compared"] += 1
        mine = (reason, got.stop_reason.get(i), got.text.get(i))
        theirs = (want.finish_reason, want.stop_reason, want.text)
        if mine != theirs:
            problems.append(f"{where}: (finish, stop_reason, text) {mine}, reference {theirs}")
        if (p.best_of or 0) > p.n:
            total = sum(lp.logprob for lp in want.logprobs)
            if got.cumulative.get(i) is None or abs(got.cumulative[i] - total) > LOGPROB_TOL * (1 + len(ids)):
                problems.append(f"{where}: cumulative logprob {got.cumulative.get(i)}, reference {total}")
    if not interrupted and not tied:
        usage = (got.usage.prompt_tokens, got.usage.completion_tokens) if got.usage is not None else None
        expected = (len(r.prompt), len(want.token_ids) * p.num_sequences)
        if usage != expected:
            problems.append(f"{r.name}: usage {usage}, expected (prompt, completion) {expected}")
    if p.prompt_logprobs is None:
        if got.prompt_logprobs is not None:
            problems.append(f"{r.name}: prompt logprobs it did not ask for")
    elif not interrupted:
        tally["prompt_logprobs_compared"] += 1
        plp = got.prompt_logprobs
        if got.num_prompt_logprobs_chunks != 1 or plp is None or len(plp) != len(r.prompt):
            problems.append(f"{r.name}: prompt logprobs {plp!r} in {got.num_prompt_logprobs_chunks} chunks")
        else:
            problems += _compare_logprobs(f"{r.name} prompt", list(plp), list(ref.prompt_logprobs), p.prompt_logprobs,
                                          len(r.prompt))
    if not problems and not interrupted:
        tally["n>1" if p.num_sequences > 1 else "n=1"] += 1
        tally["best_of"] += (p.best_of or 0) > p.n
        tally["max_tokens=1"] += p.max_tokens == 1
        tally["stop_string"] += isinstance(want.stop_reason, str)
        tally["stop_token"] += isinstance(want.stop_reason, int)
        tally["structured"] += p.structured_outputs is not None
    return problems


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.anyio
@pytest.mark.parametrize("penalty", [1.0, 1.5])
async def test_a_request_id_reused_right_after_an_abort_gets_only_its_own_tokens(tiny_model, penalty):
    """The consumer runs between two steps, the next one already planned for the old request;
    the new request with its id joins the step after that. (Once, the old request's token
    landed in the new one's prompt, or the engine died.) With a repetition penalty the new
    request's sampling reads its own output tokens, which must not include the old one's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, repetition_penalty=penalty)
    prompt = list(range(100, 140))
    async with AsyncEngine.from_pretrained(tiny_model, **REFERENCE) as ref_engine:
        want = await ref_engine.generate(prompt, params)
    async with AsyncEngine.from_pretrained(tiny_model, **COMMON, num_kv_blocks=32) as engine:
        for after in range(1, 5):
            old = engine.stream([30, 31, 32], SamplingParams(max_tokens=50, ignore_eos=True), request_id="x")
            async with old:
                count = 0
                async for _ in old:
                    count += 1
                    if count == after:
                        break
            got = await engine.generate(prompt, params, request_id="x")
            assert got.token_ids == want.token_ids, after
            assert [lp.logprob for lp in got.outputs[0].logprobs] == pytest.approx(
                [lp.logprob for lp in want.outputs[0].logprobs], abs=LOGPROB_TOL)
            assert got.usage.completion_tokens == len(want.token_ids)
        assert soak.find_leaks(engine) == {}


@pytest.mark.anyio
async def test_seeded_samples_are_the_same_when_preemption_drops_them(tiny_model):
    """A preempted request loses the token its step in flight drew and draws it again:
    from the generator state of the first draw, so a seeded request sampled at
    temperature 1 gets the tokens it gets alone."""
    rng = random.Random(0)
    prompts = [[rng.choice(IDS) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=30, ignore_eos=True) for i in range(8)]
    async with AsyncEngine.from_pretrained(tiny_model, **REFERENCE) as engine:
        alone = [(await engine.generate(p, sp)).token_ids for p, sp in zip(prompts, params)]
    got: list = [None] * len(prompts)
    async with AsyncEngine.from_pretrained(tiny_model, **COMMON, num_kv_blocks=10, block_size=8) as engine:

        async def one(i: int) -> None:
            got[i] = await engine.generate(prompts[i], params[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    assert sum(out.metrics.num_preemptions for out in got) >= 4
    assert [out.token_ids for out in got] == alone


async def fuzz(model: Path, seeds, num_requests: int) -> collections.Counter:
    """Runs a case per seed; fails listing every case that went wrong, with its plan."""
    failures = []
    tally: collections.Counter = collections.Counter()
    async with AsyncEngine.from_pretrained(model, **REFERENCE) as ref_engine:
        reference = Reference(ref_engine)
        for seed in seeds:
            case = await _plan_case(seed, reference, num_requests)
            try:
                got, seen = await run_case(model, case)
            except Exception as e:  # a stuck or failing engine: report the case that did it
                failures.append(f"{case.describe()}\n{_error_text(e)}")
                continue
            problems = [f"left behind: {seen.leaks}"] if seen.leaks else []
            for r in case.requests:
                if r.consumer == "embed":
                    want = (await reference.embed(r.prompt)).embedding
                    vec = got[r.name].embedding
                    if vec is None or len(vec) != len(want) or max(abs(a - b) for a, b in zip(vec, want)) > 1e-4:
                        problems.append(f"{r.name}: embedding {vec and vec[:4]}..., reference {want[:4]}...")
                    tally["embeddings"] += 1
                    continue
                problems += compare(r, got[r.name], await reference.run(r.prompt, r.params), tally)
                tally["interrupted"] += any(f not in ("stop", "length") for f in got[r.name].finish.values())
                tally["retries"] += r.is_retry
            if problems:
                failures.append(case.describe() + "\n" + "\n".join(problems))
            tally["cases"] += 1
            tally["preempting_cases"] += seen.num_preemptions > 0
            tally["chunking_cases"] += seen.num_partial_prefills > 0
            tally["prefix_hit_cases"] += seen.prefix_cache_hit_rate > 0
            tally["batching_cases"] += seen.max_batch > 1
            tally["priority_cases"] += case.settings.get("scheduling_policy") == "priority"
    assert not failures, f"{len(failures)} of {len(seeds)} cases differ from their reference:\n\n" + "\n\n".join(failures)
    print(f"differential: {dict(tally)}")
    return tally


def _error_text(e: BaseException) -> str:
    """The distinct errors inside ``e`` (a task group's), each with its cause."""
    inner = getattr(e, "exceptions", None)  # an exception group (not a builtin before Python 3.11)
    if inner:
        return "\n".join(dict.fromkeys(_error_text(x) for x in inner))
    cause = f" (from {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
    return f"{type(e).__name__}: {e}{cause}"


def assert_covered(tally: collections.Counter) -> None:
    """The workload really did what it claims, and near-ties excused little of it."""
    for what in ("preempting_cases", "chunking_cases", "prefix_hit_cases", "batching_cases", "interrupted", "retries",
                 "prefixes_compared", "prompt_logprobs_compared", "n>1", "best_of", "max_tokens=1", "stop_string",
                 "stop_token", "structured", "priority_cases", "embeddings"):
        assert tally[what] > 0, (what, dict(tally))
    assert tally["ties"] <= max(2, tally["outputs_compared"] // 50), dict(tally)


@pytest.mark.anyio
async def test_greedy_outputs_equal_each_request_alone(tiny_model, anyio_backend):
    first = {"asyncio": 0, "trio": 1000}[anyio_backend]
    assert_covered(await fuzz(tiny_model, range(first, first + 16), num_requests=8))


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the default test runs both loops
async def test_greedy_outputs_equal_each_request_alone_many_cases(tiny_model, anyio_backend):
    assert_covered(await fuzz(tiny_model, range(10_000, 10_100), num_requests=12))
