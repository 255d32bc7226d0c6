"""examples/discord_bot.py: the message handler, called with fake Discord objects (no
network), streams a real SmolLM2 answer into one message with throttled edits."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import anyio
import pytest

pytest.importorskip("discord")

from asyncgen.fetch import smollm2  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "discord_bot.py"
INTERVAL = 0.5

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # discord.py runs on asyncio


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("discord_bot", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
async def bot(example, anyio_backend):
    bot = example.AskBot(
        str(smollm2()), engine_kwargs={"num_kv_blocks": 256, "max_model_len": 2048},
        max_tokens=20, temperature=0.0, edit_interval=INTERVAL,
    )
    await bot.setup_hook()  # what discord.py calls after login
    yield bot
    await bot.close()
    assert not bot.engine.is_running


class FakeSentMessage:
    def __init__(self, content: str):
        self.content = content
        self.edits: list[tuple[float, str]] = []

    async def edit(self, *, content: str) -> None:
        self.edits.append((time.monotonic(), content))
        self.content = content


class FakeChannel:
    def __init__(self, channel_id: int):
        self.id = channel_id
        self.sent: list[FakeSentMessage] = []

    async def send(self, content: str) -> FakeSentMessage:
        message = FakeSentMessage(content)
        self.sent.append(message)
        return message


class FakeAuthor:
    def __init__(self, bot: bool = False):
        self.bot = bot


class FakeMessage:
    def __init__(self, content: str, channel: FakeChannel, author_is_bot: bool = False):
        self.content = content
        self.channel = channel
        self.author = FakeAuthor(author_is_bot)


def check_reply(channel: FakeChannel, cursor: str) -> str:
    [reply] = channel.sent
    times = [t for t, _ in reply.edits]
    texts = [c for _, c in reply.edits]
    final = texts[-1]
    assert final.strip() and not final.endswith(cursor)
    for text in texts[:-1]:  # each partial edit shows a prefix of the answer, with a cursor
        assert text.endswith(cursor) and final.startswith(text[: -len(cursor)])
    gaps = [b - a for a, b in zip(times[:-1], times[1:-1])]  # the final edit is not throttled
    assert all(g >= INTERVAL * 0.95 for g in gaps), gaps
    return final


async def test_streams_one_reply_with_throttled_edits(bot, example):
    channel = FakeChannel(1)
    start = time.monotonic()
    await bot.on_message(FakeMessage("!ask What is the capital of France?", channel))
    elapsed = time.monotonic() - start
    final = check_reply(channel, example.CURSOR)
    assert len(channel.sent[0].edits) <= elapsed / INTERVAL + 2
    assert engine_idle(bot.engine)
    # the answer is the model's greedy answer to the same conversation
    history = list(bot.history[1])
    assert history[-1] == {"role": "assistant", "content": final.removesuffix(example.CUT)}


async def test_many_channels_at_once(bot, example):
    channels = [FakeChannel(100 + i) for i in range(3)]
    with anyio.fail_after(180):
        async with anyio.create_task_group() as tg:
            for i, ch in enumerate(channels):
                tg.start_soon(bot.on_message, FakeMessage(f"!ask Give me a fun fact number {i}.", ch))
    for ch in channels:
        check_reply(ch, example.CURSOR)
    assert engine_idle(bot.engine)


async def test_follow_up_uses_the_channel_history(bot):
    channel = FakeChannel(7)
    await bot.on_message(FakeMessage("!ask My name is Ada.", channel))
    await bot.on_message(FakeMessage("!ask What is my name?", channel))
    assert [m["role"] for m in bot.history[7]] == ["user", "assistant", "user", "assistant"]
    assert len(channel.sent) == 2


async def test_ignores_bots_and_other_messages(bot):
    channel = FakeChannel(2)
    await bot.on_message(FakeMessage("!ask hello", channel, author_is_bot=True))
    await bot.on_message(FakeMessage("just chatting", channel))
    await bot.on_message(FakeMessage("!asking for a friend", channel))  # another word, not the command
    assert channel.sent == []
    await bot.on_message(FakeMessage("!ask   ", channel))
    assert [m.content for m in channel.sent] == ["Ask me something: `!ask <question>`"]


async def test_a_too_long_question_gets_an_apology_and_the_conversation_stays(bot):
    channel = FakeChannel(3)
    await bot.on_message(FakeMessage("!ask My name is Ada.", channel))
    before = list(bot.history[3])
    await bot.on_message(FakeMessage("!ask " + "why " * 3000, channel))
    assert channel.sent[1].content.startswith("Sorry, I can't answer that")
    assert list(bot.history[3]) == before and len(before) == 2
    assert engine_idle(bot.engine)


async def test_an_answer_cut_by_max_tokens_says_so(bot, example):
    from asyncgen import SamplingParams

    channel, params = FakeChannel(4), bot.params
    bot.params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        await bot.on_message(FakeMessage("!ask Tell me a long story.", channel))
    finally:
        bot.params = params
    final = channel.sent[0].content
    assert final.endswith(example.CUT) and len(final) > len(example.CUT)
    assert bot.history[4][-1]["content"] == final.removesuffix(example.CUT)


async def test_an_answer_stopped_midway_does_not_keep_its_cursor(bot, example):
    channel = FakeChannel(5)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(bot.on_message, FakeMessage("!ask Tell me a long story.", channel))
            while not channel.sent or not channel.sent[0].edits:  # the first piece is shown
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # (what closing the bot does to its handlers)
    final = channel.sent[0].content
    assert final.endswith(example.STOPPED) and example.CURSOR not in final
    assert 5 not in bot.history or not bot.history[5]
    with anyio.fail_after(10):
        while not engine_idle(bot.engine):
            await anyio.sleep(0.01)


async def test_editor_throttles_with_a_fake_clock(example):
    now = [0.0]
    message = FakeSentMessage("…")
    editor = example.ThrottledEditor(message, interval=1.0, clock=lambda: now[0])
    text = ""
    for _ in range(100):  # 100 pieces over 10 seconds
        text += "x"
        now[0] += 0.1
        await editor.update(text)
    await editor.finish(text)
    assert 10 <= editor.num_edits <= 12
    assert message.content == text


def engine_idle(engine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_free_blocks == s.num_total_blocks


async def test_a_character_cut_by_max_tokens_is_not_shown_as_a_replacement_mark(example):
    """max_tokens can end the output inside a character's bytes, which decode as U+FFFD
    (as tokenizer.decode gives them): the bot shows the text up to the character."""

    class Chunk:
        def __init__(self, text, finish):
            self.text, self.finish_reason = text, finish

    class Stream:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        def __aiter__(self):
            return self._chunks()

        async def _chunks(self):
            yield Chunk("Un caf", None)
            yield Chunk("\ufffd", "length")

    class Engine:
        def stream(self, **kwargs):
            return Stream()

    bot = example.AskBot("unused", max_tokens=2)
    bot.engine = Engine()
    message = FakeSentMessage("…")
    text = await bot.answer(9, "Say coffee in French", example.ThrottledEditor(message, 0.0))
    assert message.content == "Un caf" + example.CUT and text == "Un caf"
    await bot.http.close()
