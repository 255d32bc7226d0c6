"""Reasoning (``<think>`` blocks) split from the answer: the parser against a plain split
of the whole text, in any chunking; the OpenAI layer's ``reasoning_content`` on SmolLM2's
weights under a Qwen3-like template (the output opens the block) and a DeepSeek-R1-like
one (the prompt opens it), streamed and whole, and with a tool call after the reasoning."""

from __future__ import annotations

import random
import shutil

import pytest

from asyncgen import AsyncEngine
from asyncgen.reasoning import ReasoningParser, opens_reasoning, template_reasons

WS = " \t\n\r"


def split(text: str, inside: bool) -> tuple[str, str]:
    """The whole output's (reasoning, content), by plain string operations."""
    head = text.lstrip(WS)
    if head.startswith("<think>"):
        text = head[len("<think>"):]
    elif not inside:
        return "", text
    end = text.find("</think>")
    if end < 0:
        return text.strip(WS), ""
    return text[:end].strip(WS), text[end + len("</think>"):].lstrip(WS)


def streamed(text: str, inside: bool, rng: random.Random | None) -> tuple[str, str]:
    parser = ReasoningParser(inside)
    reasoning = content = ""
    i = 0
    while i < len(text):
        k = rng.randint(1, 6) if rng else len(text)
        r, c = parser.feed(text[i:i + k])
        reasoning, content, i = reasoning + r, content + c, i + k
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("inside", [False, True])
def test_parser_equals_a_split_of_the_whole_text_in_any_chunking(inside):
    pieces = ["<think>", "</think>", "<thi", "</th", " ", "\n", "a", "b c", "<", ">", "think", "x\n", "é"]
    rng = random.Random(inside)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        want = split(text, inside)
        assert streamed(text, inside, None) == want, text
        assert streamed(text, inside, rng) == want, text
    assert streamed("<think>\nPlan: add.\n</think>\n\nIt is 4.", False, None) == ("Plan: add.", "It is 4.")
    assert streamed("  Plain answer ", False, None) == ("", "  Plain answer ")  # no block: untouched


def test_prompt_and_template_checks():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n") and not opens_reasoning(None)
    assert template_reasons("{% if x %}<think>{% endif %}") and not template_reasons("{{ m }}") and not template_reasons(None)
    p = ReasoningParser()
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


QWEN3_LIKE = (
    "{%- if tools %}<|im_start|>system\nCall tools as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>."
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
R1_LIKE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)


def _model_with_template(d, smollm2_path, template: str):
    for f in smollm2_path.iterdir():
        if f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(template)
    return d


@pytest.fixture(scope="module")
def qwen3_like(tmp_path_factory, smollm2_path):
    return _model_with_template(tmp_path_factory.mktemp("qwen3-like"), smollm2_path, QWEN3_LIKE)


@pytest.fixture(scope="module")
def r1_like(tmp_path_factory, smollm2_path):
    return _model_with_template(tmp_path_factory.mktemp("r1-like"), smollm2_path, R1_LIKE)


@pytest.fixture
def anyio_backend():
    return "asyncio"


ASK = [{"role": "user", "content": "What is 2 + 2?"}]


def _joined(chunks) -> tuple[str, str, list]:
    reasoning = content = ""
    calls = []
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            reasoning += d.reasoning_content or ""
            content += d.content or ""
            for piece in d.tool_calls or ():
                if piece.id:
                    calls.append([piece.function.name, ""])
                calls[-1][1] += piece.function.arguments or ""
    return reasoning, content, [tuple(c) for c in calls]


async def _both(client, **kw):
    whole = (await client.chat.completions.create(**kw)).choices[0]
    stream = await client.chat.completions.create(stream=True, **kw)
    return whole, _joined([c async for c in stream])


@pytest.mark.anyio
async def test_reasoning_content_when_the_output_opens_the_block(qwen3_like):
    reply = "<think>\nThe user adds two and two.\n</think>\n\nIt is 4."
    async with AsyncEngine.from_pretrained(qwen3_like, max_num_seqs=4, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        assert client.adapter.reasoning_parser == "think" and client.adapter.tool_call_parser == "hermes"
        kw = dict(model=client.model, messages=ASK, max_tokens=60, temperature=0,
                  extra_body={"structured_outputs": {"choice": [reply]}})
        whole, streamed_parts = await _both(client, **kw)
        assert whole.message.reasoning_content == "The user adds two and two."
        assert whole.message.content == "It is 4." and whole.finish_reason == "stop"
        assert streamed_parts == ("The user adds two and two.", "It is 4.", [])
        # cut short inside the block: all of it is reasoning so far
        short = (await client.chat.completions.create(**{**kw, "max_tokens": 10})).choices[0]
        assert short.finish_reason == "length" and short.message.content == ""
        assert short.message.reasoning_content and "The user adds two and two.".startswith(short.message.reasoning_content)
        # reasoning, then a tool call in the answer
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        call = '<think>\nI should use the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
        kw_tools = {**kw, "tools": tools, "max_tokens": 100, "extra_body": {"structured_outputs": {"choice": [call]}}}
        whole, streamed_parts = await _both(client, **kw_tools)
        assert whole.message.reasoning_content == "I should use the tool." and whole.message.content is None
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls] == [("add", '{"a": 2, "b": 2}')]
        assert whole.finish_reason == "tool_calls"
        assert streamed_parts == ("I should use the tool.", "", [("add", '{"a": 2, "b": 2}')])
        # thinking turned off by the template: the answer is all content
        off = (await client.chat.completions.create(**{**kw, "extra_body": {
            "structured_outputs": {"choice": ["It is 4."]}, "chat_template_kwargs": {"enable_thinking": False}}})).choices[0]
        assert off.message.content == "It is 4." and off.message.reasoning_content is None
        # the parser turned off: the block stays in the content
        raw = engine.openai_client(reasoning_parser=None)
        plain = (await raw.chat.completions.create(**kw)).choices[0]
        assert plain.message.content == reply and plain.message.reasoning_content is None
        assert "reasoning_content" not in plain.message.model_dump(exclude_unset=True)


@pytest.mark.anyio
async def test_reasoning_content_when_the_prompt_opens_the_block(r1_like, smollm2_path):
    """The model's own text (greedy, read raw with the parser off) split as the prompt
    left it: inside the block. A constrained output cannot be inside it: a forced tool
    call is read as the call."""
    async with AsyncEngine.from_pretrained(r1_like, max_num_seqs=4, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        assert client.adapter.reasoning_parser == "think"
        kw = dict(model=client.model, messages=ASK, max_tokens=40, temperature=0)
        raw = (await engine.openai_client(reasoning_parser=None).chat.completions.create(**kw)).choices[0].message.content
        want = split(raw, inside=True)
        whole, streamed_parts = await _both(client, **kw)
        assert (whole.message.reasoning_content or "", whole.message.content) == want
        assert streamed_parts == (*want, [])
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        forced = (await client.chat.completions.create(tools=tools, tool_choice="required", **kw)).choices[0]
        assert forced.message.reasoning_content is None and forced.message.tool_calls[0].function.name == "add"
    async with AsyncEngine.from_pretrained(smollm2_path, max_num_seqs=2, num_kv_blocks=64) as engine:
        client = engine.openai_client()
        assert client.adapter.reasoning_parser is None  # SmolLM2's template does not think
        resp = await client.chat.completions.create(model=client.model, messages=ASK, max_tokens=8, temperature=0)
        assert "reasoning_content" not in resp.to_dict()["choices"][0]["message"]
