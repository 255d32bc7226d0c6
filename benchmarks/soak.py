"""Soak: thousands of random requests, a share of them cancelled at random await points;
afterwards nothing may be left behind.

Every request draws its prompt (random token ids, some starting with one of a few shared
prefixes so that prefix-cache blocks are shared and evicted), its sampling parameters
(``n`` of 1 to 3, greedy or sampled, seeded or not, random ``max_tokens``, stop strings,
stop token ids, ``ignore_eos``, logprobs, penalties, structured outputs) and how its
consumer behaves:

=========  ==========================================================================
complete   reads to the end (``engine.stream`` bare or in ``async with``, or
           ``engine.generate``); every completion must end with "stop" or "length",
           "length" exactly at ``max_tokens``, "stop" only on a stop string, stop token
           or EOS it asked for, and the usage must add up
deadline   reads inside a cancel scope with a random deadline
break      leaves the ``async for`` after a random number of chunks (inside
           ``async with stream`` or bare)
abort      another task calls ``engine.abort(request_id)`` after a random delay; the
           stream must end with "abort" (or have finished first)
drop       a stream that is never iterated, one closed with ``aclose()`` after its first
           chunk, or one abandoned after its first chunk without closing
=========  ==========================================================================

Consumers also await at random points between chunks (``sleep(0)`` or a short sleep),
so cancellations land both inside ``__anext__`` and in the consumer's own code. Arrivals
come in bursts under a concurrency cap, the KV pool is small enough to force preemption,
and the token budget small enough to chunk prompts.

Afterwards (:func:`find_leaks`): every KV block is free, nothing runs or waits, the
engine's request maps (``_core.groups``, its sequence map, ``scheduler.requests``, the
block tables) are empty, and the model runner holds no state for requests that are gone.
No consumer may still be waiting (a stuck stream) after ``--timeout`` seconds.

    python benchmarks/soak.py                      # 10,000 requests, tiny random model, CPU
    python benchmarks/soak.py --num-requests 500 --backend trio --model DIR

Without ``--model`` it builds a 2-layer random-weight Llama with SmolLM2's tokenizer
(``asyncgen.fetch.smollm2()``) and a 512-token vocabulary (``--vocab-size``) in a
temporary directory, so steps are cheap and the run measures the engine's bookkeeping,
not the model. Run it from the repository root with asyncgen importable
(``pip install -e .``, or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import anyio

CANCEL_MODES = ("deadline", "break", "abort", "drop")
STOP_STRINGS = ("e", "a ", "the", "\n", ".", "ing", "!", "on")


@dataclasses.dataclass
class RequestPlan:
    index: int
    prompt: list[int]
    params: dict[str, Any]
    mode: str  # "complete" or one of CANCEL_MODES
    variant: str  # how the mode is carried out
    delay: float  # deadline / abort delay (s)
    after_chunks: int  # chunks read before breaking or dropping
    body_awaits: float  # chance of an await between chunks


@dataclasses.dataclass
class SoakReport:
    num_requests: int = 0
    seconds: float = 0.0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    modes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    finish_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    num_stuck: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)  # unexpected exceptions or wrong outputs
    leaks: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    prefix_cache_hit_rate: Optional[float] = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("outcomes", "modes", "finish_reasons"):
            d[k] = dict(getattr(self, k))
        return d


# --- the workload ------------------------------------------------------------------------------
def plan_requests(num_requests: int, seed: int, vocab: list[int], max_model_len: int,
                  cancel_fraction: float = 0.3) -> list[RequestPlan]:
    rng = random.Random(seed)
    prefixes = [[rng.choice(vocab) for _ in range(rng.randrange(16, 40))] for _ in range(3)]
    plans = []
    for i in range(num_requests):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.4 else []
        prompt += [rng.choice(vocab) for _ in range(rng.randrange(1, 24))]
        max_tokens = rng.randrange(1, 25)
        prompt = prompt[: max_model_len - max_tokens]
        params: dict[str, Any] = {
            "n": rng.choice((1, 1, 1, 1, 2, 3)),
            "max_tokens": max_tokens,
            "temperature": rng.choice((0.0, 0.7, 1.0)),
            "ignore_eos": rng.random() < 0.5,
        }
        if rng.random() < 0.5:
            params["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            params["stop"] = rng.sample(STOP_STRINGS, rng.randrange(1, 3))
            params["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.1:
            params["stop_token_ids"] = [rng.choice(vocab) for _ in range(3)]
        if rng.random() < 0.1:
            params["min_tokens"] = rng.randrange(0, max_tokens + 1)
        if rng.random() < 0.05:
            params["logprobs"] = 2
        if rng.random() < 0.1:  # penalties: sampled only once the previous token is on the host
            params[rng.choice(("repetition_penalty", "frequency_penalty", "presence_penalty"))] = rng.choice((0.5, 1.3))
        if rng.random() < 0.05:  # structured outputs: no ignore_eos or min_tokens with them
            params["structured_outputs"] = rng.choice(({"json_object": True}, {"choice": ["yes", "no", "maybe"]}))
            params["ignore_eos"] = False
            params.pop("min_tokens", None)
        if rng.random() < cancel_fraction:
            mode = rng.choice(CANCEL_MODES)
        else:
            mode = "complete"
        variant = {
            "complete": rng.choice(("bare", "with", "generate")),
            "deadline": rng.choice(("bare", "with")),
            "break": rng.choice(("bare", "with")),
            "abort": rng.choice(("bare", "with")),
            "drop": rng.choice(("never_iterated", "aclose", "abandoned")),
        }[mode]
        plans.append(RequestPlan(
            i, prompt, params, mode, variant, delay=rng.choice((0.0, rng.uniform(0, 0.02), rng.uniform(0, 0.3))),
            after_chunks=rng.randrange(0, 4), body_awaits=rng.choice((0.0, 0.3, 1.0)),
        ))
    return plans


def _check_complete(plan: RequestPlan, finals: dict[int, Any], ids: dict[int, list[int]], usage: Any) -> list[str]:
    """What is wrong with a request that was read to its end (empty: nothing)."""
    p = plan.params
    problems = []
    if sorted(finals) != list(range(p["n"])):
        return [f"request {plan.index}: final chunks for indices {sorted(finals)}, expected {p['n']}"]
    for i, chunk in finals.items():
        n_tok = len(ids[i])
        if chunk.finish_reason == "length":
            if n_tok != p["max_tokens"]:
                problems.append(f"request {plan.index}[{i}]: 'length' after {n_tok} tokens, max_tokens {p['max_tokens']}")
        elif chunk.finish_reason == "stop":
            reason = chunk.stop_reason
            ok = (
                (reason is None and not p["ignore_eos"])
                or (isinstance(reason, str) and reason in p.get("stop", ()))
                or (isinstance(reason, int) and reason in p.get("stop_token_ids", ()))
            )
            if not ok:
                problems.append(f"request {plan.index}[{i}]: 'stop' with stop_reason {reason!r} it did not ask for")
            if not isinstance(reason, str) and 0 < p.get("min_tokens", 0) >= n_tok:
                problems.append(
                    f"request {plan.index}[{i}]: a stop token ended it after {n_tok} tokens, min_tokens {p['min_tokens']}"
                )
        else:
            problems.append(f"request {plan.index}[{i}]: finish_reason {chunk.finish_reason!r} without a cancellation")
    if usage is not None and usage.completion_tokens != sum(len(v) for v in ids.values()):
        problems.append(f"request {plan.index}: usage.completion_tokens {usage.completion_tokens} != tokens streamed")
    return problems


async def _consume(engine, plan: RequestPlan, rng: random.Random, report: SoakReport, tg) -> None:
    from asyncgen import SamplingParams

    params = SamplingParams(**plan.params)
    request_id = f"soak-{plan.index}"
    finals: dict[int, Any] = {}
    ids: dict[int, list[int]] = collections.defaultdict(list)
    usage = None
    outcome = plan.mode

    def take(chunk) -> None:
        nonlocal usage
        ids[chunk.index].extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            finals[chunk.index] = chunk
            report.finish_reasons[chunk.finish_reason] += 1
        if chunk.usage is not None:
            usage = chunk.usage

    async def maybe_await() -> None:
        if plan.body_awaits and rng.random() < plan.body_awaits:
            await (anyio.sleep(0) if rng.random() < 0.7 else anyio.sleep(rng.uniform(0, 0.005)))

    async def read(stream, limit: Optional[int] = None) -> bool:
        """Reads chunks; True if it stopped at ``limit`` before the end."""
        count = 0
        async for chunk in stream:
            take(chunk)
            count += 1
            if limit is not None and count > limit:
                return True
            await maybe_await()
        return False

    async def read_stream(limit: Optional[int] = None) -> bool:
        stream = engine.stream(plan.prompt, params, request_id=request_id)
        if plan.variant == "with":
            async with stream:
                return await read(stream, limit)
        return await read(stream, limit)

    if plan.mode == "complete":
        if plan.variant == "generate":
            out = await engine.generate(plan.prompt, params, request_id=request_id)
            for o in out.outputs:
                ids[o.index] = list(o.token_ids)
                finals[o.index] = o
                report.finish_reasons[o.finish_reason] += 1
            usage = out.usage
        else:
            await read_stream()
        report.errors.extend(_check_complete(plan, finals, ids, usage))
    elif plan.mode == "deadline":
        with anyio.move_on_after(plan.delay) as scope:
            await read_stream()
        outcome = "deadline_hit" if scope.cancelled_caught else "deadline_missed"
    elif plan.mode == "break":
        outcome = "broke_early" if await read_stream(plan.after_chunks) else "ended_before_break"
    elif plan.mode == "abort":
        async def aborter() -> None:
            await anyio.sleep(plan.delay)
            engine.abort(request_id)

        tg.start_soon(aborter)
        await read_stream()
        reasons = {c.finish_reason for c in finals.values()}
        if len(finals) != plan.params["n"]:
            report.errors.append(
                f"request {plan.index}: aborted stream ended with {len(finals)} of {plan.params['n']} final chunks"
            )
        outcome = "aborted" if "abort" in reasons else "finished_before_abort"
    elif plan.mode == "drop":
        stream = engine.stream(plan.prompt, params, request_id=request_id)
        if plan.variant != "never_iterated":
            chunk = await stream.__anext__()
            take(chunk)
            if plan.variant == "aclose":
                await stream.aclose()
        del stream
    report.outcomes[outcome] += 1


async def run_soak(engine, plans: list[RequestPlan], *, seed: int = 0, max_concurrency: int = 48,
                   timeout: float = 120.0, progress: bool = False) -> SoakReport:
    """Runs every plan against ``engine``; counts outcomes, unexpected errors and stuck
    consumers, then waits for the engine to go idle and looks for leaks."""
    rng = random.Random(seed + 1)
    report = SoakReport(num_requests=len(plans))
    for plan in plans:
        report.modes[plan.mode] += 1
    limiter = anyio.Semaphore(max_concurrency)
    before = engine.stats()
    t0 = time.perf_counter()

    async def guarded(plan: RequestPlan, tg) -> None:
        try:
            with anyio.fail_after(timeout):
                await _consume(engine, plan, rng, report, tg)
        except TimeoutError:
            report.num_stuck += 1
            report.errors.append(f"request {plan.index} ({plan.mode}/{plan.variant}): no end after {timeout} s")
        except Exception as e:
            report.errors.append(f"request {plan.index} ({plan.mode}/{plan.variant}): {type(e).__name__}: {e}")
        finally:
            limiter.release()

    async with anyio.create_task_group() as tg:
        for k, plan in enumerate(plans):
            await limiter.acquire()
            tg.start_soon(guarded, plan, tg)
            if rng.random() < 0.1:  # bursts, then short pauses
                await anyio.sleep(rng.uniform(0, 0.004))
            if progress and (k + 1) % 1000 == 0:
                print(f"  {k + 1} requests started, {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    # Abandoned streams are collected (and aborted) by the garbage collector; aborts
    # from other threads are applied before the next step. Give both a moment.
    gc.collect()
    with anyio.move_on_after(timeout):
        while engine._core.scheduler.has_work or engine._core.groups:
            await anyio.sleep(0.01)
            gc.collect()
    report.seconds = time.perf_counter() - t0
    after = engine.stats()
    report.num_generation_tokens = after.num_generation_tokens - before.num_generation_tokens
    report.num_preemptions = after.num_preemptions - before.num_preemptions
    report.num_steps = after.num_steps - before.num_steps
    report.prefix_cache_hit_rate = getattr(after, "prefix_cache_hit_rate", None)
    report.leaks = find_leaks(engine)
    return report


def find_leaks(engine) -> dict[str, Any]:
    """Everything a finished workload left behind in the engine (empty: nothing)."""
    core = engine._core
    sched = core.scheduler
    bm = core.block_manager
    s = engine.stats()
    leaks: dict[str, Any] = {}
    if s.num_free_blocks != s.num_total_blocks:
        leaks["blocks_in_use"] = s.num_total_blocks - s.num_free_blocks
    if s.num_running or s.num_waiting:
        leaks["running_waiting"] = (s.num_running, s.num_waiting)
    for name, mapping in (
        ("core.groups", core.groups),
        ("core._group_of", getattr(core, "_group_of", {})),
        ("scheduler.requests", sched.requests),
        ("block_manager._tables", getattr(bm, "_tables", {})),
    ):
        if mapping:
            leaks[name] = sorted(mapping)[:10]
    leaks.update(find_runner_leaks(engine))
    return leaks


def find_runner_leaks(engine) -> dict[str, Any]:
    """Model-runner state of requests that are gone: every entry must belong to a live
    request or to one whose end the runner has not been told yet."""
    states = getattr(engine._runner, "states", None)
    if states is None:
        return {}
    sched = engine._core.scheduler
    pending = set(getattr(sched, "_finished_ids", ())) | set(sched.requests)
    stale = sorted(set(states) - pending)
    return {"runner.states": stale[:10], "runner.states_count": len(stale)} if stale else {}


# --- a tiny model --------------------------------------------------------------------------------
def build_tiny_model(directory: Path, tokenizer_dir: Path, vocab_size: int = 512) -> Path:
    """A 2-layer random-weight Llama (hidden size 64) with the tokenizer of ``tokenizer_dir``.

    The model uses only the first ``vocab_size`` token ids (0: all of the tokenizer's);
    a small vocabulary keeps the sampler, whose cost per step grows with it, cheap.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=vocab_size or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wide weights, so that sampled text varies and stop strings hit
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1 if p.dim() == 1 else 0.15)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def engine_options(max_model_len: int = 128) -> dict[str, Any]:
    """A small pool and budget: preemption and chunked prefill happen under load."""
    return dict(device="cpu", dtype="float32", max_model_len=max_model_len, num_kv_blocks=48,
                max_num_seqs=32, max_num_batched_tokens=64)


def vocabulary(engine) -> list[int]:
    special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
    return [i for i in range(engine.vocab_size) if i not in special]


async def soak_main(model: Path, num_requests: int, seed: int, timeout: float) -> SoakReport:
    from asyncgen import AsyncEngine, SamplingParams

    async with AsyncEngine.from_pretrained(model, **engine_options()) as engine:
        plans = plan_requests(num_requests, seed, vocabulary(engine), engine.max_model_len)
        report = await run_soak(engine, plans, seed=seed, timeout=timeout, progress=True)
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        if len(out.token_ids) != 4:
            report.errors.append("the engine no longer serves after the soak")
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny random Llama)")
    ap.add_argument("--vocab-size", type=int, default=512,
                    help="vocabulary of the built tiny model (0: the tokenizer's full 49,152)")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a consumer counts as stuck")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="intra-op threads (1 by default: tiny ops on a shared CPU slow down with more)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)  # before the engine's device thread starts
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from asyncgen.fetch import smollm2

            model = build_tiny_model(Path(tmp) / "tiny", smollm2(), args.vocab_size)
        report = anyio.run(soak_main, model, args.num_requests, args.seed, args.timeout, backend=args.backend)
    d = report.as_dict()
    print(f"{report.num_requests} requests in {report.seconds:.1f} s ({args.backend}, torch threads {args.torch_threads})")
    print(f"modes:          {d['modes']}")
    print(f"outcomes:       {d['outcomes']}")
    print(f"finish reasons: {d['finish_reasons']} (per completion)")
    print(f"tokens generated {report.num_generation_tokens}, steps {report.num_steps}, preemptions {report.num_preemptions}, "
          f"prefix-cache hit rate {report.prefix_cache_hit_rate}")
    print(f"stuck streams:  {report.num_stuck}")
    print(f"errors:         {len(report.errors)}" + "".join(f"\n  {e}" for e in report.errors[:20]))
    print(f"leaks:          {report.leaks or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps(d, indent=1, default=str))
    return 1 if report.errors or report.num_stuck or report.leaks else 0


if __name__ == "__main__":
    sys.exit(main())
