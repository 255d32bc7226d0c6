"""Reasoning in a thinking model's output: the text between ``<think>`` and ``</think>``
(Qwen3, QwQ, DeepSeek-R1 and their distillations), split from the answer as it streams.

A :class:`ReasoningParser` is fed one output's text in pieces; each :meth:`~ReasoningParser.feed`
returns the new reasoning and the new content. The pieces joined are the same whatever
the chunking, so a streamed reply and a whole one agree.

* The reasoning block is either opened by the output itself (its first non-blank text is
  ``<think>``; Qwen3's templates) or already open at the end of the prompt
  (``inside=True``: DeepSeek-R1's templates end the prompt with ``<think>``; an output that
  opens it again is read the same). :func:`opens_reasoning` tells from the prompt.
* It ends at ``</think>``; everything after it is content. An output that never closes
  the block (cut short by ``max_tokens``) is reasoning to the end.
* An output that does not open a block is all content.
* Blank space at the edges of the reasoning and at the start of the content (Qwen3
  writes ``</think>\\n\\n``) is layout and dropped.
"""

from __future__ import annotations

from typing import Optional

from .tools import partial_marker

__all__ = ["ReasoningParser", "THINK_END", "THINK_START", "opens_reasoning", "template_reasons"]

THINK_START = "<think>"
THINK_END = "</think>"
_WS = " \t\n\r"


def template_reasons(chat_template: Optional[str]) -> bool:
    """Whether a chat template is a thinking model's (it writes ``<think>`` blocks)."""
    return bool(chat_template) and THINK_START in chat_template


def opens_reasoning(prompt: Optional[str]) -> bool:
    """Whether the prompt ends inside a reasoning block (the template opened it)."""
    if not prompt:
        return False
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """Splits one output into reasoning and content as it streams (see the module notes)."""

    def __init__(self, inside: bool = False):
        self._buf = ""
        # "open": may still open a block (at the start); "think": in the block; "answer": after it
        self._mode = "think" if inside else "open"
        self._may_reopen = inside  # an output may repeat the <think> its prompt ended with
        self._lstrip = True  # drop blank space at the start of the reasoning / the content
        self._finished = False

    def feed(self, text: str) -> tuple[str, str]:
        """(new reasoning, new content) for the next piece of the output."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """What the end of the output makes certain (held text)."""
        if self._finished:
            return "", ""
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            s = self._buf
            if self._mode == "open" or (self._mode == "think" and self._may_reopen):
                head = s.lstrip(_WS)
                if head.startswith(THINK_START):
                    self._buf, self._mode, self._may_reopen = head[len(THINK_START):], "think", False
                    self._lstrip = True
                    continue
                if THINK_START.startswith(head) and not final:
                    break  # blank so far, or maybe the start of <think>
                self._may_reopen = False
                if self._mode == "open":  # no block: all of it is the answer, blank space included
                    self._mode, self._lstrip = "answer", False
                    continue
            if self._lstrip:
                s = s.lstrip(_WS)
                if not s:
                    self._buf = ""
                    break
                self._lstrip = False
            if self._mode == "think":
                j = s.find(THINK_END)
                if j >= 0:
                    reasoning.append(s[:j].rstrip(_WS))
                    self._buf, self._mode, self._lstrip = s[j + len(THINK_END):], "answer", True
                    continue
                if final:
                    reasoning.append(s.rstrip(_WS))
                    self._buf = ""
                    break
                keep = len(s) - partial_marker(s, THINK_END)
                sent = s[:keep].rstrip(_WS)  # blank space before </think> is layout
                reasoning.append(sent)
                self._buf = s[len(sent):]
                break
            content.append(s)  # the answer
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)
