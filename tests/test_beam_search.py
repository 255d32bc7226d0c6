"""Beam search on the real SmolLM2: the sequences and scores equal transformers' beam
search on the same weights; the OpenAI layer's use_beam_search; refusals; cancellation."""

from __future__ import annotations

import anyio
import pytest
import torch
from pydantic import ValidationError

from asyncgen import AsyncEngine, BeamSearchParams, InvalidRequestError, PromptTooLongError
from conftest import assert_idle

CHAT = [{"role": "user", "content": "Answer with one word: what color is the sky?"}]
# (prompt or None for CHAT, beam width, new tokens, length penalty, early stopping)
CASES = [
    ("The capital of France is", 3, 8, 1.0, False),
    ("List three prime numbers:", 4, 10, 1.0, False),
    (None, 3, 12, 1.0, False),   # every sequence ends with <|im_end|>, at different lengths
    (None, 3, 12, 2.0, True),    # longer ones favoured; stop once 3 have ended
    (None, 2, 12, 0.5, "never"),
]


@pytest.fixture(scope="module")
def hf_beams(hf_smollm2):
    """transformers' beam search of each case: (generated ids of each returned sequence,
    without the padding after an end-of-sequence token; their scores)."""
    model, tok = hf_smollm2
    out = []
    with torch.no_grad():
        for prompt, width, new, penalty, early in CASES:
            if prompt is None:
                text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
                ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            else:
                ids = tok(prompt, return_tensors="pt").input_ids
            g = model.generate(ids, num_beams=width, num_return_sequences=width, max_new_tokens=new, do_sample=False,
                               length_penalty=penalty, early_stopping=early, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
            seqs = []
            for row in g.sequences[:, ids.shape[1]:].tolist():
                if tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id) + 1]
                seqs.append(row)
            out.append((seqs, g.sequences_scores.tolist()))
    return out


@pytest.mark.anyio
async def test_beam_search_equals_transformers(smollm2_path, hf_beams, hf_smollm2):
    _, tok = hf_smollm2
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=128) as engine:
        for (prompt, width, new, penalty, early), (want, scores) in zip(CASES, hf_beams):
            params = BeamSearchParams(beam_width=width, max_tokens=new, length_penalty=penalty, early_stopping=early)
            if prompt is None:
                out = await engine.beam_search(messages=CHAT, params=params)
            else:
                out = await engine.beam_search(prompt, params)
            assert [list(s.token_ids) for s in out.sequences] == want, (prompt, penalty)
            assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-3)
            for i, s in enumerate(out.sequences):
                assert s.index == i and len(s.logprobs) == len(s.token_ids)
                assert s.cumulative_logprob == pytest.approx(sum(s.logprobs))
                assert s.score == pytest.approx(s.cumulative_logprob / len(s.token_ids) ** penalty)
                assert s.finish_reason == ("stop" if s.token_ids[-1] == tok.eos_token_id else "length")
                assert s.text == tok.decode(s.token_ids, skip_special_tokens=True)
            assert out.text == out.sequences[0].text
            assert out.usage.completion_tokens == sum(len(s.token_ids) for s in out.sequences)
            if prompt is None:
                assert any(s.finish_reason == "stop" for s in out.sequences)
        assert_idle(engine)


@pytest.mark.anyio
async def test_beam_search_through_the_openai_layer(smollm2_path):
    from asyncgen.openai import BadRequestError

    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        want = await engine.beam_search("The capital of France is", BeamSearchParams(beam_width=3, max_tokens=6))
        got = await client.completions.create(model=client.model, prompt="The capital of France is", n=3, max_tokens=6,
                                              temperature=0.7, extra_body={"use_beam_search": True,
                                                                           "return_token_ids": True})
        assert [c.text for c in got.choices] == [s.text for s in want.sequences]
        assert [c.token_ids for c in got.choices] == [list(s.token_ids) for s in want.sequences]
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert got.usage.completion_tokens == want.usage.completion_tokens
        echoed = await client.completions.create(model=client.model, prompt="The capital of France is", n=3,
                                                 max_tokens=6, echo=True, extra_body={"use_beam_search": True})
        assert [c.text for c in echoed.choices] == ["The capital of France is" + s.text for s in want.sequences]
        # two prompts: n choices each, numbered prompt by prompt
        two = await client.completions.create(model=client.model, prompt=["The capital of France is", "Hi"], n=2,
                                              max_tokens=4, extra_body={"use_beam_search": True})
        assert [c.index for c in two.choices] == [0, 1, 2, 3]
        for k, prompt in enumerate(["The capital of France is", "Hi"]):
            each = await engine.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=4))
            assert [c.text for c in two.choices[2 * k : 2 * k + 2]] == [s.text for s in each.sequences]
        chat_want = await engine.beam_search(messages=CHAT, params=BeamSearchParams(beam_width=2, max_tokens=12,
                                                                                    length_penalty=0.5))
        chat = await client.chat.completions.create(model=client.model, messages=CHAT, n=2, max_tokens=12,
                                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
        assert [c.message.content for c in chat.choices] == [s.text for s in chat_want.sequences]
        assert [c.finish_reason for c in chat.choices] == [s.finish_reason for s in chat_want.sequences]
        for extra, param in ((dict(stream=True), "stream"), (dict(logprobs=2), "logprobs"), (dict(stop=["."]), "stop"),
                             (dict(presence_penalty=0.5), "presence_penalty"), (dict(n=11), "n"),
                             (dict(extra_body={"use_beam_search": True, "structured_outputs": {"choice": ["a"]}}),
                              "structured_outputs")):
            kwargs = dict(model=client.model, prompt="Hi", max_tokens=4, extra_body={"use_beam_search": True})
            kwargs.update(extra)
            with pytest.raises(BadRequestError) as e:
                await client.completions.create(**kwargs)
            assert e.value.param == param, extra
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model=client.model, messages=CHAT, max_completion_tokens=4,
                                                 logprobs=True, extra_body={"use_beam_search": True})
        assert e.value.param == "logprobs"
        with pytest.raises(BadRequestError) as e:
            await client.completions.create(model=client.model, prompt="Hi", max_tokens=4,
                                            extra_body={"length_penalty": 0.5})
        assert e.value.param == "length_penalty"
        assert_idle(engine)


@pytest.mark.anyio
async def test_beam_search_refusals_and_cancellation(smollm2_path):
    with pytest.raises(ValidationError, match="beam_width"):
        BeamSearchParams(beam_width=11)
    with pytest.raises(ValidationError, match="beam_width"):
        BeamSearchParams(max_tokens=4)
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=128) as engine:
        with pytest.raises(InvalidRequestError, match="beam_width"):
            await engine.beam_search("Hi")
        with pytest.raises(PromptTooLongError, match="max_model_len"):
            await engine.beam_search("Hi", {"beam_width": 2, "max_tokens": 600})
        with pytest.raises(ValidationError, match="length_penalty"):
            await engine.beam_search("Hi", {"beam_width": 2, "length_penalty": float("nan")})
        with pytest.raises(InvalidRequestError, match="priority"):  # raised as it is, not in a group
            await engine.beam_search("Hi", {"beam_width": 2}, priority=1)
        # cancelled mid-search: its requests are aborted and every block comes back
        with anyio.move_on_after(0.3):
            await engine.beam_search("Write a long story about a dragon.", BeamSearchParams(beam_width=4, max_tokens=200))
        for _ in range(100):
            s = engine.stats()
            if (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_total_blocks):
                break
            await anyio.sleep(0.02)
        assert_idle(engine)
        out = await engine.beam_search("Hi", {"beam_width": 2, "max_tokens": 3, "ignore_eos": True})
        assert len(out.sequences) == 2 and all(len(s.token_ids) == 3 for s in out.sequences)
        # a length penalty whose power leaves a float's range scores through logs
        for penalty, score in ((1e3, 0.0), (-1e3, float("-inf"))):
            out = await engine.beam_search("Hi", {"beam_width": 2, "max_tokens": 3, "ignore_eos": True,
                                                  "length_penalty": penalty})
            assert [s.score for s in out.sequences] == [score, score] and all(
                len(s.token_ids) == 3 for s in out.sequences)


def test_length_penalised_scores():
    from asyncgen.engine.beam_search import _penalized

    assert _penalized(-3.0, 4, 1.0) == -0.75 and _penalized(-3.0, 4, -2.0) == -48.0
    assert _penalized(-3.0, 1000, 200.0) == 0.0 and _penalized(-3.0, 1000, -200.0) == float("-inf")
    assert _penalized(-3.0, 2, 1e308) == 0.0 and _penalized(0.0, 5, -1e308) == 0.0
