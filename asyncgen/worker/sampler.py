"""Turns the logits of a step into one token per sampling sequence, in one batched pass.

Per row, in this order (the order vLLM documents): stop tokens masked until
``min_tokens``; ``logit_bias`` added; repetition / frequency / presence penalties
(logprobs are computed here); tokens a structured output, ``allowed_token_ids`` or
``bad_words`` rule out masked (``SamplingRow.allowed``);
greedy rows take the argmax here; the others are divided by their temperature, filtered
by min_p, top_k and top_p, and sampled with the exponential-race form of the Gumbel-max
trick (``argmax(p / E)``, ``E ~ Exp(1)``), drawing ``E`` from the row's own generator when
it has a seed, so a seeded row gets the same tokens whatever else is in the batch.

:func:`sample_async` only enqueues device work: nothing in it waits for the device, so
the model runner can launch the next step before this one's tokens reach the host.
:meth:`PendingSample.result` waits for them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams

__all__ = ["PendingSample", "SamplingRow", "sample", "sample_async"]


@dataclasses.dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: frozenset[int]
    generator: Optional[torch.Generator]
    num_generated: Optional[int] = None  # output tokens so far (default: len(output_token_ids))
    # structured outputs, allowed_token_ids, bad_words: [vocab] bool on the host, True = may come next
    allowed: Optional[torch.Tensor] = None

    @property
    def num_output(self) -> int:
        return len(self.output_token_ids) if self.num_generated is None else self.num_generated


def _dev(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device (a pageable
    host-to-device copy would synchronise the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


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
    padded = padded.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else padded
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


class PendingSample:
    """A step's sampled tokens (and logprobs), on their way to the host."""

    def __init__(self, tokens: torch.Tensor, rows: list[SamplingRow], lp: Optional[tuple]):
        self._rows = rows
        self._wanted = lp[0] if lp else []
        parts = [tokens] + ([t for t in lp[1:] if t is not None] if lp else [])
        self._has_top = bool(lp) and lp[3] is not None
        self._event = None
        if tokens.device.type == "cuda":
            parts = [t.to("cpu", non_blocking=True) for t in parts]  # into pinned memory
            self._event = torch.cuda.Event()
            self._event.record()
        self._host = parts

    def result(self) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """Waits for the device; the tokens and each row's :class:`TokenLogprob` (or None)."""
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[0].tolist()
        logprobs: list[Optional[TokenLogprob]] = [None] * len(self._rows)
        if self._wanted:
            chosen_lp = self._host[1].tolist()
            ranks = self._host[2].tolist()
            top_ids = self._host[3].tolist() if self._has_top else None
            top_lp = self._host[4].tolist() if self._has_top else None
            for j, i in enumerate(self._wanted):
                kk = self._rows[i].params.logprobs
                top = tuple(zip(top_ids[j][:kk], top_lp[j][:kk])) if kk else ()
                logprobs[i] = TokenLogprob(tokens[i], chosen_lp[j], top, ranks[j])
        return tokens, logprobs


def _logprobs(processed: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> Optional[tuple]:
    """Device tensors for the rows that asked for logprobs: ``(rows, chosen [W], rank [W],
    top ids [W, k], top logprobs [W, k])`` (top ones None when no row wants any); None if
    no row asked."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return None
    idx = _dev(wanted, torch.int64, processed.device)
    lp = processed.index_select(0, idx).log_softmax(dim=-1)  # [W, vocab]
    chosen_lp = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1)
    rank = token_ranks(lp, chosen_lp)
    k = max(rows[i].params.logprobs for i in wanted)
    if k == 0:
        return wanted, chosen_lp, rank, None, None
    top_lp, top_ids = lp.topk(k, dim=-1)
    return wanted, chosen_lp, rank, top_ids, top_lp


def token_ranks(lp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[W] ranks of the chosen tokens among each row's logprobs ``lp`` [W, vocab], as vLLM
    counts them: the tokens at least as likely as the chosen one, itself included."""
    return (lp >= chosen.unsqueeze(1)).sum(dim=1)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[Optional[TokenLogprob]]]:
    """One token per row of ``logits`` [N, vocab] (fp32; modified in place), and each
    row's :class:`TokenLogprob` where its params ask for logprobs (else None)."""
    return sample_async(logits, rows)[1].result()


@torch.inference_mode()
def sample_async(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, PendingSample]:
    """Enqueues sampling: the tokens as a device tensor [N] (for the next step's inputs)
    and the :class:`PendingSample` that brings them, and logprobs, to the host."""
    tokens, processed = _sample_tokens(logits, rows)
    return tokens, PendingSample(tokens, rows, _logprobs(processed, tokens, rows))


def _mask_disallowed(logits: torch.Tensor, guided: list[int], allowed: list[torch.Tensor]) -> torch.Tensor:
    """A copy of ``logits`` with the tokens each guided row's mask rules out at -inf."""
    width = logits.shape[1]
    masks = torch.zeros(len(guided), width, dtype=torch.bool)
    for j, m in enumerate(allowed):
        n = min(width, m.shape[0])
        masks[j, :n] = m[:n]
    if logits.device.type == "cuda":
        masks = masks.pin_memory().to(logits.device, non_blocking=True)
    idx = _dev(guided, torch.int64, logits.device)
    out = logits.clone()
    out[idx] = logits.index_select(0, idx).masked_fill(~masks, float("-inf"))
    return out


def _sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled token ids [N] and the logits after penalties (for logprobs)."""
    n, vocab = logits.shape
    device = logits.device

    # Stop tokens may not end a sequence shorter than min_tokens.
    for i, r in enumerate(rows):
        if r.params.min_tokens and r.num_output < r.params.min_tokens and r.stop_token_ids:
            ids = [t for t in r.stop_token_ids if t < vocab]
            if ids:
                logits[i].index_fill_(0, _dev(ids, torch.int64, device), float("-inf"))

    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = [t for t in r.params.logit_bias if t < vocab]
            if ids:
                bias = _dev([r.params.logit_bias[t] for t in ids], logits.dtype, device)
                logits[i].index_add_(0, _dev(ids, torch.int64, device), bias)

    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if any(x != 0.0 for x in freq) or any(x != 0.0 for x in pres) or any(x != 1.0 for x in rep):
        out_counts = _token_mask([r.output_token_ids for r in rows], vocab, device)
        if any(x != 1.0 for x in rep):
            seen = (_token_mask([r.prompt_token_ids for r in rows], vocab, device) + out_counts) > 0
            penalty = _dev(rep, logits.dtype, device).unsqueeze(1).expand_as(logits)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        logits -= _dev(freq, logits.dtype, device).unsqueeze(1) * out_counts
        logits -= _dev(pres, logits.dtype, device).unsqueeze(1) * (out_counts > 0)

    processed = logits  # what logprobs are computed from; later steps make new tensors
    guided = [i for i, r in enumerate(rows) if r.allowed is not None]
    if guided:
        logits = _mask_disallowed(logits, guided, [rows[i].allowed for i in guided])
    greedy = [r.params.is_greedy for r in rows]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        return tokens, processed

    # Only the sampling rows go through temperature, filters and the exponential race.
    idx = [i for i, g in enumerate(greedy) if not g]
    srows = [rows[i] for i in idx]
    idx_t = _dev(idx, torch.int64, device) if len(idx) < n else None
    sub = logits.index_select(0, idx_t) if idx_t is not None else logits
    temps = _dev([r.params.temperature for r in srows], sub.dtype, device)
    sub = sub / temps.unsqueeze(1)
    min_p = [r.params.min_p for r in srows]
    if any(p > 0 for p in min_p):
        probs = sub.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _dev(min_p, sub.dtype, device).unsqueeze(1)
        sub = sub.masked_fill(probs < threshold, float("-inf"))
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in srows]
    top_p = [r.params.top_p for r in srows]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        sub = _apply_top_k_top_p(
            sub,
            _dev(top_k, torch.int64, device) if use_k else None,
            _dev(top_p, sub.dtype, device) if use_p else None,
        )
    probs = sub.softmax(dim=-1)
    race = torch.empty_like(probs)
    seeded = [j for j, r in enumerate(srows) if r.generator is not None]
    if len(seeded) < len(srows):
        race.exponential_()
    for j in seeded:
        race[j].exponential_(generator=srows[j].generator)
    sampled = (probs / race).argmax(dim=-1)
    if idx_t is not None:
        tokens.index_copy_(0, idx_t, sampled)
    else:
        tokens = sampled
    return tokens, processed
