"""Beam search on top of the engine's requests.

Each step sends every running sequence (prompt + its tokens so far) as a one-token greedy
request that asks for the ``2 * beam_width`` most likely next tokens and their logprobs;
the engine batches them like any other requests, and prefix caching shares the full KV
blocks of their common prompt. The candidates are ranked as transformers ranks them:
across all sequences by cumulative logprob, the best ``2 * beam_width`` kept; an
end-of-sequence token among the first ``beam_width`` of those finishes its sequence, and
the first ``beam_width`` others run on. Cancelling the caller cancels the step's requests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Optional

from ..outputs import BeamSearchOutput, BeamSearchSequence, Usage
from ..sampling_params import BeamSearchParams, SamplingParams
from .gather import gather

if TYPE_CHECKING:
    from .async_engine import AsyncEngine


@dataclasses.dataclass(frozen=True)
class _Beam:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cumulative: float

    def then(self, token: int, logprob: float) -> "_Beam":
        return _Beam(self.token_ids + (token,), self.logprobs + (logprob,), self.cumulative + logprob)


def _penalized(cumulative: float, length: int, length_penalty: float) -> float:
    """``cumulative / length ** length_penalty``; where the power leaves a float's range,
    through logs, so that no length penalty overflows (a score past the range is -inf, one
    too near 0 is 0)."""
    try:
        return cumulative / length ** length_penalty
    except (OverflowError, ZeroDivisionError):
        pass
    if cumulative == 0.0:
        return 0.0
    try:
        size = math.exp(math.log(abs(cumulative)) - length_penalty * math.log(length))
    except OverflowError:
        size = math.inf
    return math.copysign(size, cumulative)


def _score(beam: _Beam, length_penalty: float) -> float:
    return _penalized(beam.cumulative, len(beam.token_ids), length_penalty)


async def _next_tokens(engine: "AsyncEngine", prompt_ids: list[int], beams: list[_Beam],
                       params: SamplingParams, priority: int) -> list[tuple[tuple[int, float], ...]]:
    """The most likely next tokens of each beam, with their logprobs, most likely first.
    The first request that fails cancels the others, and its error is raised as it is."""
    outs = await gather([
        functools.partial(engine.generate, prompt_ids + list(beam.token_ids), params, priority=priority)
        for beam in beams
    ])
    return [out.outputs[0].logprobs[0].top for out in outs]


async def beam_search(engine: "AsyncEngine", prompt: Optional[str], prompt_ids: list[int],
                      params: BeamSearchParams, priority: int = 0) -> BeamSearchOutput:
    width, penalty = params.beam_width, params.length_penalty
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    eos = frozenset() if params.ignore_eos else engine.eos_token_ids
    running = [_Beam((), (), 0.0)]
    finished: list[tuple[float, _Beam]] = []  # (score, beam), best first, at most `width`
    for step in range(1, params.max_tokens + 1):
        tops = await _next_tokens(engine, prompt_ids, running, step_params, priority)
        candidates = sorted(
            ((beam.cumulative + lp, i, tok, lp) for i, (beam, top) in enumerate(zip(running, tops)) for tok, lp in top),
            key=lambda c: c[0], reverse=True,
        )[: 2 * width]
        next_running = []
        last = step == params.max_tokens  # then only the first `width` candidates are kept, finished or not
        for rank, (_, i, tok, lp) in enumerate(candidates):
            beam = running[i].then(tok, lp)
            if tok in eos:
                if rank < width:
                    finished.append((_score(beam, penalty), beam))
            elif len(next_running) < width and (rank < width or not last):
                next_running.append(beam)
        finished = sorted(finished, key=lambda f: f[0], reverse=True)[:width]
        running = next_running
        if not running or _done(running, finished, step, params):
            running = []  # the finished ones are the result
            break
    for beam in running:  # out of steps: the running ones are scored as they are
        finished.append((_score(beam, penalty), beam))
    best = sorted(finished, key=lambda f: f[0], reverse=True)[:width]
    tok = engine.tokenizer
    sequences = tuple(
        BeamSearchSequence(
            i, tok.decode(list(beam.token_ids), skip_special_tokens=True), beam.token_ids, beam.logprobs,
            beam.cumulative, score, "stop" if beam.token_ids[-1] in eos else "length",
        )
        for i, (score, beam) in enumerate(best)
    )
    usage = Usage(len(prompt_ids), sum(len(s.token_ids) for s in sequences))
    return BeamSearchOutput(prompt, tuple(prompt_ids), sequences, usage)


def _done(running: list[_Beam], finished: list[tuple[float, _Beam]], step: int, params: BeamSearchParams) -> bool:
    """Whether the search may stop before ``max_tokens`` (transformers' rules)."""
    if len(finished) < params.beam_width:
        return False
    if params.early_stopping is True:
        return True
    length = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else step
    best_possible = _penalized(running[0].cumulative, length, params.length_penalty)
    return best_possible <= finished[-1][0]
