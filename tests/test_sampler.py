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


def test_logprobs_rank_the_sampled_token_as_vllm_does():
    """rank: 1 + the tokens at least as likely as the sampled one, itself counted once;
    greedy tokens rank 1, and a sampled token outside the top k still has its rank."""
    logits = torch.randn(6, 300)
    rows = [row(temperature=0, logprobs=1)] + [row(temperature=5.0, seed=s, logprobs=1) for s in range(5)]
    tokens, lps = sample(logits.clone(), rows)
    ranks = []
    for i, lp in enumerate(lps):
        ref = logits[i].log_softmax(-1)
        assert lp.rank == int((ref >= ref[tokens[i]]).sum()) == 1 + int((ref > ref[tokens[i]]).sum()), i
        ranks.append(lp.rank)
    assert ranks[0] == 1 and max(ranks[1:]) > 1  # at temperature 5 the samples leave the top 1


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


def test_token_filter_masks_allowed_ids_and_the_last_token_of_bad_words():
    from asyncgen.worker.guided import TokenFilter

    width = 12
    f = TokenFilter(None, [(3,), (5, 6, 7), (6, 8)], width)
    assert f.reads_history
    never = f.mask([], 0, None)
    assert not never[3] and never.sum() == width - 1  # a one-token word: always
    assert f.mask([1, 5, 6], 3, None).tolist() == [i not in (3, 7, 8) for i in range(width)]  # 5 6 -> 7, 6 -> 8
    assert not f.mask([6], 1, None)[8]
    assert f.mask([1, 5, 6, 9], 4, None).tolist() == [i != 3 for i in range(width)]  # the output ends with 9
    # only the first `generated` tokens count (the rest were dropped by a preemption)
    assert not f.mask([5, 6, 0, 0], 2, None)[7] and f.mask([5, 6, 0, 0], 4, None)[7]
    # with a structured output's mask: narrowed, and never emptied by a ban
    grammar = torch.zeros(width, dtype=torch.bool)
    grammar[[3, 4]] = True
    assert f.mask([], 0, grammar).tolist() == [i == 4 for i in range(width)]
    grammar[4] = False
    assert f.mask([], 0, grammar) is grammar  # only the banned word left: the grammar wins (logged)
    # allowed ids, and a ban among them
    g = TokenFilter([2, 3, 9], [(9,)], width)
    assert not g.reads_history and g.mask([], 0, None).tolist() == [i in (2, 3) for i in range(width)]
    h = TokenFilter([9], [(9,)], width)
    assert h.mask([], 0, None).tolist() == [i == 9 for i in range(width)]  # the ban would leave nothing
    assert TokenFilter(None, [], width).mask([], 0, None) is None


def test_sampling_takes_only_tokens_the_row_allows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[7, 11, 40]] = True
    rows = [row(temperature=0), row(temperature=0), row(temperature=2.0)]
    rows[1].allowed = allowed
    rows[2].allowed = allowed
    for _ in range(20):
        tokens, _ = sample(logits.clone(), rows)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] == max((7, 11, 40), key=lambda t: float(logits[1, t]))
        assert tokens[2] in (7, 11, 40)


def test_sample_seeds_are_unsigned_and_keep_distinct_seeds_apart():
    from asyncgen.engine.core import sample_seed

    seeds = [0, 1, 5, -1, 5 - 2**63, 2**63 - 1, -2**63]
    for index in range(3):
        mapped = [sample_seed(s, index) for s in seeds]
        assert len(set(mapped)) == len(seeds) and all(0 <= m < 2**64 for m in mapped)
        for m in mapped:
            torch.Generator().manual_seed(m)  # in the range torch takes
    assert sample_seed(7, 0) == 7  # a non-negative seed's first sample uses it as it is
