"""The batched sampler against per-row expectations computed by hand."""

import math

import pytest
import torch

from asyncgen import SamplingParams
from asyncgen.worker.sampler import SamplingRow, sample


def row(prompt=(), output=(), stop=frozenset(), seed=None, **params):
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), frozenset(stop), gen)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    tokens, lps = sample(logits.clone(), [row(temperature=0) for _ in range(4)])
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 4


def test_temperatures_too_small_to_divide_by_are_greedy():
    logits = torch.randn(3, 50) * 30
    for t in (1e-38, 1e-30, 9e-6):
        tokens, _ = sample(logits.clone(), [row(temperature=t, seed=1) for _ in range(3)])
        assert tokens == logits.argmax(-1).tolist(), t
    assert SamplingParams(temperature=9e-6).is_greedy and not SamplingParams(temperature=1e-5).is_greedy


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(3, 100)
    expected = logits.argmax(-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        tokens, _ = sample(logits.clone(), [row(temperature=1.0, **params) for _ in range(3)])
        assert tokens == expected, params


def test_top_k_restricts_support():
    logits = torch.randn(1, 30)
    allowed = set(logits[0].topk(3).indices.tolist())
    seen = {sample(logits.clone(), [row(temperature=5.0, top_k=3)])[0][0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = {sample(logits.clone(), [row(top_p=0.75)])[0][0] for _ in range(300)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    tokens, _ = sample(logits, [row() for _ in range(4000)])
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_repeat_whatever_the_batch():
    logits = torch.randn(1, 64)
    alone = [sample(logits.clone(), [row(seed=42)])[0][0] for _ in range(1)]
    gen_a = row(seed=42)
    batch = torch.cat([torch.randn(3, 64), logits]).clone()
    rows = [row(), row(seed=7), row(), gen_a]
    assert sample(batch, rows)[0][3] == alone[0]
    # The same seed twice in a row yields the same sequence of draws.
    r1, r2 = row(seed=5), row(seed=5)
    seq1 = [sample(logits.clone(), [r1])[0][0] for _ in range(10)]
    seq2 = [sample(logits.clone(), [r2])[0][0] for _ in range(10)]
    assert seq1 == seq2


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, 10)
    logits[:, 2] = 5.0  # token 2 would win
    tokens, _ = sample(logits.clone(), [row(temperature=0, logit_bias={7: 100.0}), row(temperature=0, min_tokens=3, stop={2})])
    assert tokens[0] == 7
    assert tokens[1] != 2
    tokens, _ = sample(logits[:1].clone(), [row(temperature=0, min_tokens=1, stop={2}, output=[5])])
    assert tokens == [2]


def test_penalties():
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.0]])
    # repetition penalty on a token seen in the prompt: 3.0 / 2 = 1.5 < 2.9
    assert sample(logits.clone(), [row(temperature=0, repetition_penalty=2.0, prompt=[0])])[0] == [1]
    # frequency penalty: token 0 seen 3 times in the output: 3.0 - 0.1 * 3 = 2.7 < 2.9
    assert sample(logits.clone(), [row(temperature=0, frequency_penalty=0.1, output=[0, 0, 0])])[0] == [1]
    # presence penalty counts once: 3.0 - 0.05 = 2.95 > 2.9
    assert sample(logits.clone(), [row(temperature=0, presence_penalty=0.05, output=[0, 0, 0])])[0] == [0]
    # repetition penalty multiplies negative logits
    neg = torch.tensor([[-1.0, -1.5, -9.0]])
    assert sample(neg.clone(), [row(temperature=0, repetition_penalty=2.0, output=[0])])[0] == [1]


def test_logprobs_are_log_softmax_of_processed_logits():
    logits = torch.randn(2, 20)
    tokens, lps = sample(logits.clone(), [row(temperature=0, logprobs=3), row(temperature=0)])
    ref = logits[0].log_softmax(-1)
    assert lps[1] is None
    assert lps[0].token_id == tokens[0]
    assert math.isclose(lps[0].logprob, ref[tokens[0]].item(), rel_tol=1e-5)
    top_ids = [t for t, _ in lps[0].top]
    assert top_ids == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 2},
    {"n": 0}, {"max_tokens": 0}, {"repetition_penalty": 0}, {"presence_penalty": 3},
    {"frequency_penalty": -2.5}, {"stop": [""]}, {"logprobs": 21}, {"min_tokens": 5, "max_tokens": 2},
    {"logit_bias": {-1: 1.0}}, {"logit_bias": {3: 500.0}}, {"unknown_field": 1},
])
def test_invalid_sampling_params_name_the_field(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        SamplingParams(**bad)
    text = str(info.value)
    assert any(k in text for k in bad) or "min_tokens" in text
