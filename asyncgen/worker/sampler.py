"""Turns the logits of a step into one token per sampling sequence, in one batched pass.

Per row, in this order (the order vLLM documents): stop tokens masked until
``min_tokens``; ``logit_bias`` added; repetition / frequency / presence penalties;
greedy rows take the argmax here; the others are divided by their temperature, filtered
by min_p, top_k and top_p, and sampled with the exponential-race form of the Gumbel-max
trick (``argmax(p / E)``, ``E ~ Exp(1)``), drawing ``E`` from the row's own generator when
it has a seed, so a seeded row gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams

__all__ = ["SamplingRow", "sample"]


@dataclasses.dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: frozenset[int]
    generator: Optional[torch.Generator]


def _token_mask(rows: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[N, vocab] counts of each token id in each row's list."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(rows), width), vocab, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            padded[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    padded = padded.to(device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top_k and its top_p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Keep the last top_k of the ascending order: threshold at index vocab - k.
        k = top_k.clamp(1, vocab)
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(processed: torch.Tensor, tokens: list[int], rows: list[SamplingRow]) -> list[Optional[TokenLogprob]]:
    """Log-probabilities of the sampled tokens (and top-k) for the rows that asked."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[Optional[TokenLogprob]] = [None] * len(rows)
    if not wanted:
        return result
    idx = torch.tensor(wanted, device=processed.device)
    lp = processed[idx].log_softmax(dim=-1)  # [W, vocab]
    chosen = torch.tensor([tokens[i] for i in wanted], device=processed.device)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    k = max(rows[i].params.logprobs for i in wanted)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
    top_lp = top_lp.tolist() if k > 0 else None
    top_ids = top_ids.tolist() if k > 0 else None
    for j, i in enumerate(wanted):
        kk = rows[i].params.logprobs
        top = tuple(zip(top_ids[j][:kk], top_lp[j][:kk])) if kk else ()
        result[i] = TokenLogprob(tokens[i], chosen_lp[j], top)
    return result


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[Optional[TokenLogprob]]]:
    """One token per row of ``logits`` [N, vocab] (fp32; modified in place), and each
    row's :class:`TokenLogprob` where its params ask for logprobs (else None)."""
    n, vocab = logits.shape
    device = logits.device

    # Stop tokens may not end a sequence shorter than min_tokens.
    for i, r in enumerate(rows):
        if r.params.min_tokens and len(r.output_token_ids) < r.params.min_tokens and r.stop_token_ids:
            ids = [t for t in r.stop_token_ids if t < vocab]
            logits[i, ids] = float("-inf")

    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = [t for t in r.params.logit_bias if t < vocab]
            if ids:
                bias = torch.tensor([r.params.logit_bias[t] for t in ids], dtype=logits.dtype)
                logits[i, ids] += bias.to(device)

    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if any(x != 0.0 for x in freq) or any(x != 0.0 for x in pres) or any(x != 1.0 for x in rep):
        out_counts = _token_mask([r.output_token_ids for r in rows], vocab, device)
        if any(x != 1.0 for x in rep):
            seen = (_token_mask([r.prompt_token_ids for r in rows], vocab, device) + out_counts) > 0
            penalty = torch.tensor(rep, dtype=logits.dtype, device=device).unsqueeze(1).expand_as(logits)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        logits -= torch.tensor(freq, dtype=logits.dtype, device=device).unsqueeze(1) * out_counts
        logits -= torch.tensor(pres, dtype=logits.dtype, device=device).unsqueeze(1) * (out_counts > 0)

    processed = logits  # what logprobs are computed from; later steps make new tensors
    greedy = [r.params.temperature == 0.0 for r in rows]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        tokens = tokens.tolist()
        return tokens, _logprobs(processed, tokens, rows)

    # Only the sampling rows go through temperature, filters and the exponential race.
    idx = [i for i, g in enumerate(greedy) if not g]
    srows = [rows[i] for i in idx]
    sub = logits[torch.tensor(idx, device=device)] if len(idx) < n else logits
    temps = torch.tensor([r.params.temperature for r in srows], dtype=sub.dtype, device=device)
    sub = sub / temps.unsqueeze(1)
    min_p = [r.params.min_p for r in srows]
    if any(p > 0 for p in min_p):
        probs = sub.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, dtype=sub.dtype, device=device).unsqueeze(1)
        sub = sub.masked_fill(probs < threshold, float("-inf"))
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in srows]
    top_p = [r.params.top_p for r in srows]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        sub = _apply_top_k_top_p(
            sub,
            torch.tensor(top_k, device=device) if use_k else None,
            torch.tensor(top_p, dtype=sub.dtype, device=device) if use_p else None,
        )
    probs = sub.softmax(dim=-1)
    race = torch.empty_like(probs)
    seeded = [j for j, r in enumerate(srows) if r.generator is not None]
    if len(seeded) < len(srows):
        race.exponential_()
    for j in seeded:
        race[j].exponential_(generator=srows[j].generator)
    sampled = (probs / race).argmax(dim=-1)
    if len(idx) < n:
        tokens[torch.tensor(idx, device=device)] = sampled
    else:
        tokens = sampled
    tokens = tokens.tolist()
    return tokens, _logprobs(processed, tokens, rows)
