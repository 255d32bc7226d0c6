"""``best_of``: sample more sequences than returned, keep the n with the highest
cumulative logprob."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncgen import AsyncEngine, InvalidRequestError, SamplingParams

PROMPT = [5, 17, 3, 99, 40, 12, 7]


@pytest.mark.anyio
async def test_best_of_keeps_the_most_likely_samples(tiny_llama):
    async with AsyncEngine.from_pretrained(tiny_llama, max_model_len=128, num_kv_blocks=64) as engine:
        common = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
        # The same four seeded samples, all returned with their logprobs...
        every = await engine.generate(PROMPT, SamplingParams(n=4, logprobs=0, **common))
        scored = sorted(
            ((sum(lp.logprob for lp in o.logprobs), o.token_ids) for o in every.outputs), reverse=True
        )
        assert len({ids for _, ids in scored}) > 1  # the samples differ, so the choice matters
        assert all(o.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in o.logprobs)) for o in every.outputs)
        # ...and best_of=4, n=2 returns the two most likely of them, best first.
        best = await engine.generate(PROMPT, SamplingParams(n=2, best_of=4, **common))
        assert [o.token_ids for o in best.outputs] == [ids for _, ids in scored[:2]]
        assert [o.cumulative_logprob for o in best.outputs] == pytest.approx([t for t, _ in scored[:2]])
        assert [o.index for o in best.outputs] == [0, 1]
        assert all(o.logprobs is None for o in best.outputs)  # not asked for
        assert best.usage.completion_tokens == 4 * 8  # every sample was generated
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
async def test_best_of_is_validated_and_not_streamed(tiny_llama):
    with pytest.raises(ValidationError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    async with AsyncEngine.from_pretrained(tiny_llama, max_model_len=128, num_kv_blocks=64) as engine:
        with pytest.raises(InvalidRequestError, match="best_of"):
            engine.stream(PROMPT, SamplingParams(n=1, best_of=3))
        out = await engine.generate(PROMPT, SamplingParams(n=2, best_of=2, max_tokens=3, temperature=0))
        assert len(out.outputs) == 2  # best_of == n: a plain n=2 request
