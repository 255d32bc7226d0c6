"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of token ids: ``decode(ids[prefix:])`` minus
``decode(ids[prefix:read])``, where ``ids[prefix:read]`` were already turned into text.
Decoding a few tokens of context with the new ones keeps tokenizer-specific joins (a
SentencePiece word-start space, a byte split across tokens) the same as decoding
everything at once, so the emitted pieces concatenate to ``tokenizer.decode(ids)``::

    ids:      ... | prefix ......... read | new tokens
                    \\___ already text __/
    delta = decode(ids[prefix:]) [len(decode(ids[prefix:read])):]

A delta that ends in U+FFFD is held back until the next token completes the character.
Text that could still be the start of a stop string is also held back, so a stop
string is never split across two deltas and never emitted. As ``min_tokens`` keeps
stop tokens away, a stop string completed by one of the first ``min_tokens`` tokens
does not end the text. The text ends at the first stop string to appear; of several
that one token completes, at the one that starts earliest.

The window starts in the prompt (its last ``CONTEXT_TOKENS`` tokens, not part of the
text), as vLLM's does: a tokenizer that drops the word-start space of the first token it
decodes (SentencePiece's, WordPiece's) keeps the space the first output token has after
the prompt, so the text is ``decode(prompt + output)`` past ``decode(prompt)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # the prompt's tokens the first window starts with


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        prompt_token_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or ())
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # decoded text so far (cut at a stop string once one matched)
        self._emitted = 0
        self.stopped_by: Optional[str] = None
        self._decode_fn = _fast_decoder(tokenizer) or tokenizer.decode
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt that ends inside a character: its bytes would join the output's
        self.ids: list[int] = context  # the window's context, then the output's tokens
        self._context = len(context)
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> Optional[str]:
        """Appends tokens; returns the stop string if one now appears in the text.

        With ``final`` the last partial character (if any) is flushed as is, so the
        text equals a full decode.
        """
        if self.stopped_by is not None:
            return self.stopped_by
        self.ids.extend(token_ids)
        before = len(self.text)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT)):
            self.text += new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
        if self.stop and len(self.ids) - self._context > self.min_tokens:
            return self._find_stop(before)
        return None

    def complete_length(self, partial: Optional[bool] = None) -> int:
        """Characters of the text so far, counting those of a held-back piece up to the
        partial character it ends with (so where the next token's first byte falls).

        A held-back piece ends in U+FFFD, which may be a character still being completed
        or bytes no byte can complete any more; decoded text cannot tell which. ``partial``
        says it (from the tokens' bytes): True, the last U+FFFD is the character the next
        token continues; False, it is final. Left None, every U+FFFD the piece ends with
        counts as incomplete."""
        if self._read == len(self.ids) or self.stopped_by is not None:
            return len(self.text)
        held = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        if partial is None:
            return len(self.text) + len(held.rstrip(_REPLACEMENT))
        return len(self.text) + len(held) - (partial and held.endswith(_REPLACEMENT))

    def flush(self) -> Optional[str]:
        """Decodes any held-back partial character (at the end of generation); returns
        the stop string if the text it releases completes one."""
        if self.stopped_by is None and self._read < len(self.ids):
            return self.add([], final=True)
        return None

    def _find_stop(self, searched: int) -> Optional[str]:
        """Cuts the text at the first-starting stop string of those that end past its
        first ``searched`` characters. Each string's window starts where it alone could
        end there: one shared window, as long as the longest string, would also find a
        shorter one that ended inside the first ``min_tokens`` tokens' text."""
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            at = self.text.find(s, max(0, searched - len(s) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s) if self.include_stop else at]
        self.stopped_by = s
        return s

    def delta(self, finished: bool) -> str:
        """New text since the last call; unless ``finished``, minus any tail that could
        still grow into a stop string."""
        end = len(self.text)
        if not finished and self.stop and self.stopped_by is None:
            end -= self._possible_stop_prefix()
        end = max(end, self._emitted)
        piece = self.text[self._emitted : end]
        self._emitted = end
        return piece

    def _possible_stop_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def _fast_decoder(tokenizer):
    """The Rust tokenizer's own ``decode`` when it gives exactly what the transformers
    wrapper would (no clean-up pass): a third of the per-token cost, on the hot path."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return backend.decode
    return None
