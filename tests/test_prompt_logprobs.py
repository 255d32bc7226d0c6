"""``prompt_logprobs``: the logprob of every prompt token (and its position's top k),
equal to transformers' log-softmax of the same weights' logits, however the prompt is
chunked, with prefix caching on, and for n > 1."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from asyncgen import AsyncEngine, InvalidRequestError, SamplingParams

PROMPT = [5, 17, 3, 99, 40, 12, 7, 7, 7, 300, 2, 11, 11, 64, 8, 120, 33, 5, 61, 70, 19, 4, 4,
          250, 81, 9, 9, 140, 6, 52, 77, 13, 410, 3, 28, 95, 15, 15, 200, 1]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(dim=-1)  # row p predicts position p + 1


def check(prompt_lps, hf, k):
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    for pos in range(1, len(PROMPT)):
        lp = prompt_lps[pos]
        row = hf[pos - 1]
        assert lp.token_id == PROMPT[pos]
        assert lp.logprob == pytest.approx(row[PROMPT[pos]].item(), abs=1e-4), pos
        want_lp, want_ids = row.topk(k)
        assert [t for t, _ in lp.top] == want_ids.tolist(), pos
        assert [v for _, v in lp.top] == pytest.approx(want_lp.tolist(), abs=1e-4)
        # vLLM's rank: 1 + the tokens more likely than the prompt's (to the logprobs' tolerance)
        v = row[PROMPT[pos]]
        assert int((row > v + 1e-4).sum()) + 1 <= lp.rank <= int((row >= v - 1e-4).sum()), pos


@pytest.mark.anyio
@pytest.mark.parametrize("budget", [64, 16])  # the whole prompt in one step; chunks of 16 tokens
async def test_prompt_logprobs_equal_transformers(tiny_llama, hf_logprobs, budget):
    async with AsyncEngine.from_pretrained(
        tiny_llama, max_model_len=256, num_kv_blocks=64, block_size=8, max_num_batched_tokens=budget
    ) as engine:
        params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3)
        first = await engine.generate(PROMPT, params)
        check(first.prompt_logprobs, hf_logprobs, 3)
        # The same prompt again: its blocks are in the prefix cache, yet every position is
        # reported (the request computes its prompt instead of reusing the cache).
        again = await engine.generate(PROMPT, params)
        check(again.prompt_logprobs, hf_logprobs, 3)
        assert again.token_ids == first.token_ids
        # n > 1: reported once, on the request; the other samples share the cached prompt.
        many = await engine.generate(PROMPT, SamplingParams(n=3, max_tokens=2, temperature=0, prompt_logprobs=0))
        assert all(lp.top == () for lp in many.prompt_logprobs[1:])
        assert [lp.logprob for lp in many.prompt_logprobs[1:]] == pytest.approx(
            [lp.logprob for lp in first.prompt_logprobs[1:]], abs=1e-5
        )
        plain = await engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))
        assert plain.prompt_logprobs is None


@pytest.mark.anyio
async def test_prompt_logprobs_arrive_on_the_first_chunk_and_are_validated(tiny_llama, hf_logprobs):
    async with AsyncEngine.from_pretrained(tiny_llama, max_model_len=256, num_kv_blocks=64) as engine:
        chunks = [c async for c in engine.stream(PROMPT, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2))]
        carrying = [i for i, c in enumerate(chunks) if c.prompt_logprobs is not None]
        assert carrying == [0]
        check(chunks[0].prompt_logprobs, hf_logprobs, 2)
        with pytest.raises(ValidationError, match="prompt_logprobs"):
            engine.stream(PROMPT, {"prompt_logprobs": 21})
        with pytest.raises(InvalidRequestError):
            engine.stream(PROMPT, "prompt_logprobs=2")  # not a SamplingParams
