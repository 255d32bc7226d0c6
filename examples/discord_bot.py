"""A Discord bot that streams its answers: it posts one message and keeps editing it as
the text arrives.

    DISCORD_TOKEN=... python examples/discord_bot.py [--model DIR]

Write ``!ask <question>`` in any channel the bot can read (enable the "message content"
intent for the bot in Discord's developer portal). Each channel keeps its last few
exchanges, so follow-up questions work; a question the model cannot take (too long) is
refused on its own, and the conversation goes on. An answer cut off by ``--max-tokens``
or by Discord's 2,000 characters ends in " …", one stopped by the bot closing in
" [stopped]".

Discord limits how often a message may be edited, so the reply is edited at most once per
``edit_interval`` seconds (and once more with the final text). discord.py runs every
event handler in its own task, so many people asking at once are batched together by the
engine. The engine starts in ``setup_hook`` (after login, before the gateway connects) and
closes with the bot.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict, deque
from typing import Any, Callable, Optional

import discord

from asyncgen import AsyncEngine, InvalidRequestError, SamplingParams

MESSAGE_LIMIT = 2000  # characters in one Discord message
CURSOR = " ▌"
CUT = " …"  # the end of an answer cut short by a length limit
STOPPED = " [stopped]"  # the end of one the bot stopped (it is closing)


class ThrottledEditor:
    """Shows growing text in one message, editing it at most once per ``interval`` seconds.

    ``update()`` is cheap to call for every new piece of text; it edits only when the last
    edit is ``interval`` old. ``finish()`` always writes the final text.
    """

    def __init__(self, message: Any, interval: float = 0.75, clock: Callable[[], float] = time.monotonic):
        self.message = message
        self.interval = interval
        self.clock = clock
        self.num_edits = 0
        self._shown: Optional[str] = None
        self._last_edit = float("-inf")

    async def update(self, text: str) -> None:
        if self.clock() - self._last_edit >= self.interval:
            await self._edit(text + CURSOR)

    async def finish(self, text: str) -> None:
        await self._edit(text)

    async def _edit(self, content: str) -> None:
        content = content or "…"
        if content != self._shown:
            self._last_edit = self.clock()
            await self.message.edit(content=content)
            self._shown = content
            self.num_edits += 1


class AskBot(discord.Client):
    """Answers ``!ask <question>`` with a streamed, edited reply."""

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        engine_kwargs: Optional[dict[str, Any]] = None,
        prefix: str = "!ask",
        max_tokens: int = 400,
        temperature: float = 0.7,
        edit_interval: float = 0.75,
        history_turns: int = 3,
    ):
        intents = discord.Intents.default()
        intents.message_content = True
        super().__init__(intents=intents)
        self.model = model
        self.engine_kwargs = engine_kwargs or {}
        self.prefix = prefix
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        self.edit_interval = edit_interval
        self.engine: Optional[AsyncEngine] = None
        self.history: dict[int, deque] = defaultdict(lambda: deque(maxlen=2 * history_turns))

    async def setup_hook(self) -> None:
        model = self.model or os.environ.get("ASYNCGEN_MODEL")
        if model is None:
            from asyncgen.fetch import smollm2

            model = str(smollm2())
        self.engine = AsyncEngine.from_pretrained(model, **self.engine_kwargs)
        await self.engine.start()

    async def close(self) -> None:
        await super().close()
        if self.engine is not None:
            await self.engine.aclose()

    async def on_message(self, message: Any) -> None:
        content = message.content
        if message.author.bot or not content.startswith(self.prefix):
            return
        question = content[len(self.prefix):]
        if question[:1] and not question[:1].isspace():
            return  # "!asking ...": another word, not the command
        question = question.strip()
        if not question:
            await message.channel.send(f"Ask me something: `{self.prefix} <question>`")
            return
        reply = await message.channel.send("…")
        await self.answer(message.channel.id, question, ThrottledEditor(reply, self.edit_interval))

    async def answer(self, channel_id: int, question: str, editor: ThrottledEditor) -> str:
        """Streams the answer to ``question`` into ``editor``'s message; returns the text."""
        if self.engine is None:
            raise RuntimeError("the bot's engine is not started; it starts in setup_hook")
        history = self.history[channel_id]
        messages = [
            {"role": "system", "content": "You are a friendly assistant in a Discord chat. Keep answers short."},
            *history,
            {"role": "user", "content": question},
        ]
        text, finish = "", None
        try:
            async with self.engine.stream(messages=messages, params=self.params) as stream:
                async for chunk in stream:
                    text += chunk.text
                    finish = chunk.finish_reason or finish
                    if len(text) > MESSAGE_LIMIT - len(CURSOR):
                        text, finish = text[: MESSAGE_LIMIT - len(CUT)], "length"
                        break  # the message is full; leaving the loop stops the generation
                    await editor.update(text)
        except InvalidRequestError as e:  # e.g. a question too long for the model
            await editor.finish(f"Sorry, I can't answer that: {e}")  # the conversation so far stays
            return ""
        except BaseException:  # cancelled (the bot is closing) or failed: no cursor left behind
            try:
                await editor.finish(text + STOPPED)
            except Exception:
                pass
            raise
        if finish == "abort":  # the engine closed under the stream
            await editor.finish(text + STOPPED)
            return text
        if finish == "length":  # (a character whose bytes were cut off decodes as U+FFFD: not shown)
            text = text.rstrip("\ufffd")
        await editor.finish(text + CUT if finish == "length" else text)
        history.extend([{"role": "user", "content": question}, {"role": "assistant", "content": text}])
        return text


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="A Discord bot streaming answers from asyncgen.")
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args(argv)
    token = os.environ.get("DISCORD_TOKEN")
    if not token:
        parser.error("set DISCORD_TOKEN to the bot's token")
    AskBot(args.model, max_tokens=args.max_tokens).run(token)


if __name__ == "__main__":
    main()
