"""Token masks on the runner's side: structured outputs, ``allowed_token_ids`` and
``bad_words``.

A request with ``structured_outputs`` gets a :class:`SequenceGuide`: the grammar's state
after each of its output tokens, and from the state the mask of tokens that may come
next (:meth:`asyncgen.structured.TokenGuide.allowed`), plus the request's stop tokens
once the output is complete. Masks are cached per grammar and state, so requests that
share a schema share them; the vocabulary's bytes are read from the tokenizer the first
time a request needs them. A request with ``allowed_token_ids`` or ``bad_words`` gets a
:class:`TokenFilter`, which narrows that mask (or makes one).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from ..sampling_params import StructuredOutputsParams

__all__ = ["GuideFactory", "SequenceGuide", "TokenFilter"]

log = logging.getLogger(__name__)

_MASK_BYTES = 128 << 20  # a grammar's cached masks, one byte per vocabulary entry each
_GRAMMARS_KEPT = 32  # grammars whose token guides (and masks) are kept for later requests


class _SharedGuide:
    """One grammar over the vocabulary: its token guide and a cache of masks by state."""

    def __init__(self, grammar, vocabulary, width: int):
        from ..structured import TokenGuide

        self.grammar = grammar
        self.tokens = TokenGuide(grammar, vocabulary)
        self.token_bytes = vocabulary.token_bytes
        self.width = width
        self._masks: dict = {}

    def allowed_mask(self, state) -> tuple[torch.Tensor, bool]:
        """The mask of the tokens the grammar allows after ``state``, and whether it has any."""
        hit = self._masks.get(state)
        if hit is None:
            allowed = self.tokens.allowed_mask(state)
            n = min(self.width, allowed.shape[0])
            mask = torch.zeros(self.width, dtype=torch.bool)
            mask[:n] = torch.from_numpy(allowed[:n])
            if len(self._masks) >= max(64, _MASK_BYTES // self.width):
                self._masks.clear()
            hit = self._masks[state] = (mask, bool(mask.any()))
        return hit

    def stops_only(self, stops: torch.Tensor) -> torch.Tensor:
        """A mask that allows ``stops`` alone."""
        mask = torch.zeros(self.width, dtype=torch.bool)
        mask[stops] = True
        return mask


class GuideFactory:
    """Makes each structured request's :class:`SequenceGuide`; ``token_bytes`` gives the
    vocabulary's bytes (index = token id, None for tokens never allowed) when first needed;
    ``width`` is the logits' width (the model's vocabulary, maybe padded). Called on the
    device thread only."""

    def __init__(self, token_bytes: Callable[[], list[Optional[bytes]]], width: int):
        self._token_bytes = token_bytes
        self._width = width
        self._vocabulary = None
        self._shared: dict[str, _SharedGuide] = {}

    def __call__(self, spec: StructuredOutputsParams, stop_token_ids: frozenset[int]) -> "SequenceGuide":
        key = spec.key
        shared = self._shared.get(key)
        if shared is None:
            if self._vocabulary is None:
                from ..structured import Vocabulary

                self._vocabulary = Vocabulary(self._token_bytes())
            shared = _SharedGuide(spec.grammar, self._vocabulary, self._width)
            if len(self._shared) >= _GRAMMARS_KEPT:  # the oldest goes (live requests keep theirs)
                del self._shared[next(iter(self._shared))]
            self._shared[key] = shared
        return SequenceGuide(shared, stop_token_ids)


class SequenceGuide:
    """One sequence's grammar states, one per output token so far."""

    def __init__(self, shared: _SharedGuide, stop_token_ids: frozenset[int]):
        self._shared = shared
        self._states = [shared.grammar.initial]
        stops = [t for t in stop_token_ids if t < shared.width]
        self._stops = torch.tensor(stops, dtype=torch.int64)
        self._stop_set = stop_token_ids

    def mask(self, output_token_ids: Sequence[int], generated: int) -> torch.Tensor:
        """The tokens allowed after the first ``generated`` output tokens ([width] bool, on
        the host): the grammar's, and the stop tokens where the output is complete."""
        states = self._states
        del states[generated + 1 :]  # tokens a preemption dropped
        grammar = self._shared.grammar
        tokens_bytes = self._shared.token_bytes
        while len(states) <= generated and states[-1] is not None:
            tok = output_token_ids[len(states) - 1]
            data = tokens_bytes[tok] if tok < len(tokens_bytes) else None
            states.append(None if data is None else grammar.advance(states[-1], data))
        state = states[-1] if len(states) > generated else None
        if state is None and generated and output_token_ids[generated - 1] in self._stop_set:
            # The output has ended; a step planned before that was known samples a token
            # that will be dropped.
            return self._shared.stops_only(self._stops)
        if state is None:  # a token the grammar did not allow (never sampled under the mask)
            log.error("structured output left its grammar at output token %d; only stop tokens are allowed", generated)
            return self._shared.stops_only(self._stops)
        mask, any_allowed = self._shared.allowed_mask(state)
        complete = grammar.accepts(state)
        if complete or not any_allowed:
            if not complete:
                log.error("structured output has no token to continue with; only stop tokens are allowed")
            mask = mask.clone()
            mask[self._stops] = True
        return mask


class TokenFilter:
    """One sequence's ``allowed_token_ids`` and ``bad_words`` as a mask over the logits'
    ``width``. ``bad_words`` are token sequences: the last token of each is masked where
    the output ends with the others (a one-token word is masked everywhere)."""

    def __init__(self, allowed_token_ids: Optional[Sequence[int]], bad_words: Sequence[Sequence[int]], width: int):
        self._allowed = None
        if allowed_token_ids:
            self._allowed = torch.zeros(width, dtype=torch.bool)
            self._allowed[[t for t in allowed_token_ids if t < width]] = True
        single = sorted({w[0] for w in bad_words if len(w) == 1 and w[0] < width})
        self._base = self._allowed
        if single:
            self._base = torch.ones(width, dtype=torch.bool) if self._allowed is None else self._allowed.clone()
            self._base[single] = False
        self._multi = [tuple(w) for w in bad_words if len(w) > 1 and w[-1] < width]
        self._width = width

    @property
    def reads_history(self) -> bool:
        """Whether the mask depends on the output so far (a word of several tokens)."""
        return bool(self._multi)

    def mask(self, output_token_ids: Sequence[int], generated: int, allowed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``allowed`` (a structured output's mask, or None for every token) narrowed to
        this filter after the first ``generated`` output tokens (None: every token). The
        bad words never leave a row without a token: where they would, they are not
        applied at that step (logged)."""
        if self._base is None and not self._multi:
            return allowed
        out = self._base if allowed is None else (allowed if self._base is None else allowed & self._base)
        banned = [w[-1] for w in self._multi
                  if generated >= len(w) - 1 and tuple(output_token_ids[generated - len(w) + 1 : generated]) == w[:-1]]
        if banned:
            out = torch.ones(self._width, dtype=torch.bool) if out is None else out.clone()
            out[banned] = False
        if out is not None and not bool(out.any()):
            log.warning("bad_words leave no token to sample after output token %d; not applied there", generated)
            if allowed is None or self._allowed is None:
                return allowed if allowed is not None else self._allowed
            return allowed & self._allowed
        return out
